"""Validation during training: the held-out loss every ``train.eval_every`` steps.

The eval step is a second compiled program beside the train step, never a variant of it: it takes
the train step's state and batch shardings as they are and is compiled ahead of time at start-up, so
neither program is traced again during the run. Its loss is the train step's ``loss`` metric on
another batch: the same loss code forward only, or with a pipeline the pipelined loss-and-gradient
function with the gradients dropped. The batches are the first ``train.eval_batches`` of the
validation split, read once and kept on the host, so every evaluation scores the same tokens. What
is scored and logged: docs/data.md, "Validation during training".
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.config import Config, ConfigError
from jaxpar.data.mixture import source_names
from jaxpar.mesh import step_compiler_options
from jaxpar.model.remat import Remat
from jaxpar.model.transformer import DTYPES
from jaxpar.parallel.hooks import model_hooks
from jaxpar.parallel.microbatch import split_micro_steps
from jaxpar.train.step import Batch, Trainer, TrainState, batch_token_loss, with_positions

HostBatch = dict[str, np.ndarray]


def eval_due(cfg: Config, step: int) -> bool:
    """Every ``train.eval_every`` steps and at the last step, never at step 0."""
    every = cfg.train.eval_every
    return every > 0 and (step % every == 0 or step == cfg.train.steps)


def forward_loss_fn(trainer: Trainer) -> Callable[[TrainState, Batch], jax.Array]:
    """``(state, batch) -> sum of the token losses`` without a pipeline: the train step's loss
    code, forward only, micro-step by micro-step."""
    cfg = trainer.cfg
    dtype, pieces = DTYPES[cfg.train.dtype], cfg.loss_pieces()
    remat = Remat.of_train(cfg.train)
    accum, platform = cfg.train.grad_accum, trainer.mesh.devices.flat[0].platform

    def loss_sum(state: TrainState, batch: Batch) -> jax.Array:
        def micro_step(micro: Batch) -> jax.Array:
            summed, _ = batch_token_loss(state.params, state.buffers, trainer.graphdef, micro,
                                         dtype=dtype, remat=remat, loss_pieces=pieces)
            return summed

        with model_hooks(cfg, cfg.mesh_shape, platform):
            if accum == 1:
                return micro_step(batch)
            return jnp.sum(jax.lax.map(micro_step, split_micro_steps(batch, accum)))

    return loss_sum


def eval_step_fn(trainer: Trainer) -> Callable[[TrainState, Batch], tuple[jax.Array, jax.Array]]:
    """``(state, batch) -> (sum of the token losses, valid tokens)``, float32 scalars."""
    # Positions travel with the tokens, in the train step's order (zigzag under context).
    forward = forward_loss_fn(trainer) if trainer.pipeline is None else None

    def eval_step(state: TrainState, batch: Batch) -> tuple[jax.Array, jax.Array]:
        tokens = jnp.sum(batch["mask"])
        if forward is None:  # the pipeline: its loss is already divided by the valid tokens
            loss, _, _ = trainer.jitted_loss_and_grads(state, batch)
            return loss * jnp.maximum(tokens, 1.0), tokens
        return forward(state, with_positions(batch, trainer.seq_order)), tokens

    return eval_step


def compile_eval_step(trainer: Trainer, weights_only: bool = False) -> jax.stages.Compiled:
    """The eval step compiled from the train step's abstract state and batch. ``weights_only``:
    for a state without ``opt_state`` (``jaxpar eval``), only without a pipeline."""
    shardings, abstract = trainer.state_shardings, trainer.abstract_state
    if weights_only:
        shardings, abstract = shardings._replace(opt_state=None), abstract._replace(opt_state=None)
    options = step_compiler_options(trainer.mesh.devices.flat[0].platform, trainer.cfg)
    step = jax.jit(eval_step_fn(trainer), in_shardings=(shardings, trainer.batch_sharding),
                   compiler_options=options)
    with jax.set_mesh(trainer.mesh):
        return step.lower(abstract, trainer.abstract_batch()).compile()


@dataclass
class Validation:
    """The held-out batches of a run and the compiled step that scores them. ``sets`` maps a name
    to this process's rows: ``""`` is the validation split (``val_loss``), any other name (a
    mixture's source) adds ``val_loss/<name>``."""

    trainer: Trainer
    sets: dict[str, list[HostBatch]]
    line: str  # what the run prints about it at start-up
    step_fn: Any = None  # compile_eval_step's program, once compile() has run

    def compile(self) -> None:
        self.step_fn = compile_eval_step(self.trainer)

    def evaluate(self, state: TrainState) -> dict[str, float | None]:
        """The token-weighted mean loss of every set (the same on every process)."""
        # Dispatch every batch first, read once: the device runs them back to back.
        sums = {name: [self.step_fn(state, self.trainer.put_batch(b)) for b in batches]
                for name, batches in self.sets.items()}
        sums = jax.device_get(sums)
        if "" not in sums:  # a mixture's sources: overall, every held-out token counts once
            sums[""] = [value for values in sums.values() for value in values]
        out: dict[str, float | None] = {}
        for name, values in sums.items():
            loss_sum = math.fsum(float(s) for s, _ in values)
            tokens = math.fsum(float(t) for _, t in values)
            loss = loss_sum / max(tokens, 1.0)
            suffix = f"/{name}" if name else ""
            # JSON has no NaN or Infinity: a non-finite loss (or a perplexity past float64) is
            # null, as the train loss is.
            out[f"val_loss{suffix}"] = loss if math.isfinite(loss) else None
            out[f"val_tokens{suffix}"] = tokens
            if not name:
                out["val_ppl"] = math.exp(loss) if math.isfinite(loss) and loss < 700 else None
        return out


def first_batches(data: Any, batches: int) -> list[HostBatch]:
    """The first ``batches`` batches of a (non-shuffled) iterator, fewer if the split holds
    fewer: a repeated batch would count its rows twice."""
    state = data.get_state()
    whole = state["rows"] // state["global_batch"]
    return [next(data) for _ in range(min(batches, whole))]


def validation_data(cfg: Config, data_iterator: Callable[..., tuple[Any, str]]
                    ) -> dict[str, tuple[Any, str]] | None:
    """The validation split's iterator and line by set name (None when ``train.eval_every=0``),
    read before anything is traced so data errors are one-line config errors. A mixture has one
    set per source."""
    if cfg.train.eval_every == 0:
        return None
    if cfg.data.sources:
        paths = [s.path for s in cfg.data.sources]
        sources = list(zip(paths, source_names(paths), strict=True))
    else:
        sources = [(cfg.data.source, "")]
    held_out = {}
    for path, name in sources:
        one = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, source=path, sources=()))
        try:
            held_out[name] = data_iterator(one, "validation")
        except ConfigError as err:  # e.g. a validation split smaller than one batch
            where = f" (data.sources: {path})" if name else ""
            raise ConfigError(f"train.eval_every={cfg.train.eval_every}: {err}{where}; "
                              "data.val_fraction (or jaxpar tokenize --val-fraction) sets its "
                              "size") from None
    return held_out


def make_validation(cfg: Config, trainer: Trainer,
                    held_out: dict[str, tuple[Any, str]] | None) -> Validation | None:
    """The run's :class:`Validation`, this process's rows read, its step not yet compiled."""
    if held_out is None:
        return None
    rows = trainer.local_batch_rows()
    sets = {name: first_batches(data.with_rows(rows), cfg.train.eval_batches)
            for name, (data, _) in held_out.items()}
    t = cfg.train
    described = "; ".join(f"{name + ': ' if name else ''}the first {len(sets[name])} batch(es) "
                          f"of {t.batch_size} x {t.seq_len} ({line})"
                          for name, (_, line) in held_out.items())
    return Validation(trainer, sets,
                      f"validation every {t.eval_every} steps and at the end: {described}")
