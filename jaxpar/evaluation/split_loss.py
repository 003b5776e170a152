"""Evaluation of a checkpoint on a tokenized split: ``jaxpar eval``.

The split's rows are scored exactly as training reads them (:mod:`jaxpar.data.split_rows`):
documents end to end, cut into rows of ``train.seq_len`` targets, read in file order. Read
whole, every target of the split but the first is scored once; ``--batches N`` reads the first
N global batches only, and the last batch is filled with masked rows. Data ``jaxpar tokenize``
did not write (text, or chat .jsonl) is tokenized, split and packed here as training does it.

The numbers: ``loss`` (mean cross entropy in nats), ``perplexity`` and ``bits_per_byte`` (from
the UTF-8 bytes ``jaxpar tokenize`` recorded, so only for a whole split). The loss is the
validation step's (:mod:`jaxpar.train.validation_loss`), on the train step's shardings, so any
layout training runs evaluates. The parameters are read straight into their shardings; no optimizer
state is read.

What is scored at the edges, and why: docs/evaluation.md, "`jaxpar eval`".
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxpar.checkpoint.weights import restore_params
from jaxpar.checkpoint.weights_only import read_weights
from jaxpar.config import Config, ConfigError, documents_masked
from jaxpar.data.dataset import open_source
from jaxpar.data.packing import PackedDataset
from jaxpar.data.shards import split_text_bytes
from jaxpar.data.split_rows import TokenizedDataset
from jaxpar.model.transformer import initial_buffers
from jaxpar.train.step import Trainer, TrainState, make_optimizer
from jaxpar.train.validation_loss import compile_eval_step


@dataclasses.dataclass(frozen=True)
class EvalResult:
    """What ``jaxpar eval`` prints (and ``--json`` writes); module docstring for each number."""

    checkpoint: str
    step: int
    data: str
    split: str
    loss: float
    perplexity: float | None  # None past float64 (a loss over ~700 nats)
    bits_per_byte: float | None
    bits_per_byte_note: str  # why bits_per_byte is None ("" when it is given)
    tokens: int  # targets scored
    text_bytes: int | None  # the denominator of bits_per_byte
    rows: int  # rows read (the padding rows of the last batch not counted)
    split_rows: int

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def open_split(cfg: Config, directory: str, split: str) -> TokenizedDataset | PackedDataset:
    """The split to score, checked against ``cfg``'s tokenizer and vocabulary: a one-line
    :class:`ConfigError` for anything wrong, before jax starts. ``directory`` is a directory
    written by ``jaxpar tokenize``, or anything ``data.source`` reads (text files; chat .jsonl
    under ``data.loss_on=assistant``), tokenized and split here as training does."""
    label = f"--data {directory}"
    try:
        return open_source(cfg.data, directory, split, cfg.train.seq_len,
                           vocab_size=cfg.model.vocab_size, label=label)
    except ImportError as err:  # an optional package (tokenizers, jinja2) the data needs
        raise ConfigError(str(err).splitlines()[0]) from None
    except ValueError as err:
        if isinstance(err, ConfigError):
            raise
        line = str(err).splitlines()[0]
        raise ConfigError(line if line.startswith(label) else f"{label}: {line}") from None


def row_batches(ds: TokenizedDataset | PackedDataset, batch_size: int, batches: int | None,
                segments: bool = False) -> Iterator[tuple[dict[str, np.ndarray], int]]:
    """(global batch, real rows in it) for the first ``batches`` batches (None: all), in file
    order; the last batch of the split is filled with masked copies of its first row. With
    ``segments`` (the checkpoint's config masks documents) each batch has its document ids."""
    total = -(-len(ds) // batch_size)
    for b in range(total if batches is None else min(batches, total)):
        rows = np.arange(b * batch_size, min((b + 1) * batch_size, len(ds)))
        batch = ds.rows(rows)
        if segments:
            batch["segment_ids"] = ds.segment_ids(rows)
        short = batch_size - len(rows)
        if short:
            batch = {k: np.concatenate([v, np.repeat(v[:1], short, axis=0)])
                     for k, v in batch.items()}
            batch["mask"][len(rows):] = 0.0
        yield batch, len(rows)


def load_eval_state(trainer: Trainer, path: Path) -> TrainState:
    """Checkpoint ``path``'s weights laid out for ``trainer`` (module docstring, "How")."""
    abstract, shardings = trainer.abstract_state, trainer.state_shardings
    params = restore_params(path, abstract.params, vocab_size=trainer.cfg.model.vocab_size)
    # MoE router biases and window flags: small, read on the host with the weights (a
    # weights-only checkpoint has none: they start as train.init_from starts them).
    saved = read_weights(path)[1] if jax.tree.leaves(abstract.buffers) else {}
    buffers = jax.device_put(jax.tree.map(
        lambda a, *s: np.asarray(s[0], a.dtype) if s else a,
        initial_buffers(trainer.cfg.model, abstract.buffers), *([saved] if saved else [])),
        shardings.buffers)
    step = jax.device_put(np.int32(0), shardings.step)
    if trainer.pipeline is None:
        return TrainState(step, params, None, buffers)
    # The pipelined step takes a whole train state (and reorders layers with one): zeros.
    init = jax.jit(make_optimizer(trainer.cfg.train, trainer.logical_axes).init,
                   out_shardings=shardings.opt_state)
    with jax.set_mesh(trainer.mesh):
        opt_state = init(params)
    return trainer.from_model_order(TrainState(step, params, opt_state, buffers))


def evaluate(trainer: Trainer, state: TrainState, ds: TokenizedDataset | PackedDataset, *,
             checkpoint: str, step: int, batches: int | None = None) -> EvalResult:
    """Score ``ds``'s rows (module docstring) with the validation step on ``trainer``'s mesh."""
    scorer = compile_eval_step(trainer, weights_only=trainer.pipeline is None)
    local = trainer.local_batch_rows()
    sums, rows = [], 0
    for batch, real in row_batches(ds, trainer.cfg.train.batch_size, batches,
                                   documents_masked(trainer.cfg)):
        sums.append(scorer(state, trainer.put_batch({k: v[local] for k, v in batch.items()})))
        rows += real
    sums = jax.device_get(sums)  # dispatched back to back, read once
    nats = math.fsum(float(s) for s, _ in sums)
    tokens = int(round(math.fsum(float(t) for _, t in sums)))
    loss = nats / max(tokens, 1)
    text_bytes = split_text_bytes(ds.shards) if isinstance(ds, TokenizedDataset) else None
    note = _bytes_note(ds, rows, text_bytes, trainer.cfg.data.loss_on)
    bpb = nats / math.log(2) / text_bytes if not note and text_bytes else None
    return EvalResult(checkpoint=checkpoint, step=step, data=ds.source, split=ds.split,
                      loss=loss, perplexity=math.exp(loss) if loss < 700 else None,
                      bits_per_byte=bpb, bits_per_byte_note=note, tokens=tokens,
                      text_bytes=text_bytes, rows=rows, split_rows=len(ds))


def _bytes_note(ds: TokenizedDataset | PackedDataset, rows: int, text_bytes: int | None,
                loss_on: str) -> str:
    """Why bits per byte is not given ("" when it is): module docstring, "The numbers"."""
    if not isinstance(ds, TokenizedDataset):
        return ("the data was tokenized here, not by jaxpar tokenize, which records the texts' "
                "bytes" + ("; the loss is over the assistant's tokens" if loss_on == "assistant"
                           else ""))
    if rows < len(ds):
        return f"--batches covers {rows} of the split's {len(ds)} rows; the bytes are the split's"
    if text_bytes is None:
        return ("the data's index.json records no text bytes (tokenized by an older jaxpar: "
                "tokenize again to get them)")
    return ""


def describe(result: EvalResult) -> str:
    """The lines ``jaxpar eval`` prints."""
    bpb = (f"{result.bits_per_byte:.6f}" if result.bits_per_byte is not None
           else f"- ({result.bits_per_byte_note})")
    ppl = f"{result.perplexity:.6g}" if result.perplexity is not None else "inf"
    return (f"eval: step {result.step} of {result.checkpoint} on {result.data} "
            f"({result.split}: {result.rows} of {result.split_rows} rows)\n"
            f"loss           {result.loss:.6f}\n"
            f"perplexity     {ppl}\n"
            f"bits_per_byte  {bpb}\n"
            f"tokens         {result.tokens:,}")


def check_devices(cfg: Config) -> list:
    """The devices of ``cfg``'s mesh; a one-line error when there are too few."""
    wanted, have = math.prod(cfg.mesh.sizes().values()), jax.device_count()
    if wanted > have:
        raise ConfigError(f"mesh: {wanted} devices asked for, {have} available (on CPU, "
                          f"host_devices={wanted} makes them)")
    return jax.devices()[:wanted]

