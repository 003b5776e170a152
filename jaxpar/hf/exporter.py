"""``jaxpar export CKPT --to DIR --format hf``: a checkpoint as a Hugging Face model directory.

Writes ``config.json`` (:func:`jaxpar.hf.config.hf_config_from_model`), the float32 weights under
their Hugging Face names in safetensors shards, tokenizer files and ``generation_config.json``. A
LoRA run's adapters are merged (:func:`jaxpar.model.lora.merged_weights`); the vocabulary's padding
is dropped. Reads only the parameters, on the host; a shard's converted tensors are the only other
copy alive. What each file holds: docs/hugging-face.md, "Export".
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from jaxpar.checkpoint.state import read_config
from jaxpar.checkpoint.weights_only import read_weights, step_dir
from jaxpar.config import ConfigError, ModelConfig, config_from_dict
from jaxpar.hf.config import hf_config_from_model
from jaxpar.hf.importer import INDEX, TOKENIZER_FILES
from jaxpar.hf.names import Tensor, hf_tensors, param_at, slice_shape, to_hf
from jaxpar.model.lora import merged_weights
from jaxpar.model.transformer import abstract_model
from jaxpar.model.vocab import fit_vocab

DEFAULT_MAX_SHARD = "5GB"
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20,
          "GIB": 2**30}


def parse_size(text: str) -> int:
    """``5GB`` (10^9, as Hugging Face counts), ``500MiB``, ``2000`` (bytes) -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*", text, re.IGNORECASE)
    if not match or float(match.group(1)) <= 0:
        raise ConfigError(f"--max-shard-size {text!r}: expected a size such as 5GB, 500MB, "
                          "100MiB or a number of bytes")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "").upper()])


def _hf_arrays(weights: dict, tensors: list[Tensor]) -> Iterator[tuple[str, np.ndarray]]:
    """``weights``: ``{"params": ..., "buffers": ...}``."""
    for t in tensors:
        tree = weights["buffers" if t.buffer else "params"]
        yield t.hf, to_hf(t.layout, np.asarray(param_at(tree, t.path)[t.index], np.float32))


def shard_plan(sizes: list[int], max_bytes: int) -> list[int]:
    """The file number of each tensor, in order: a new file when the next would pass ``max_bytes``.

    A larger tensor gets a file of its own.
    """
    plan, number, filled = [], 0, 0
    for nbytes in sizes:
        if filled and filled + nbytes > max_bytes:
            number, filled = number + 1, 0
        plan.append(number)
        filled += nbytes
    return plan


def _write_shards(weights: dict, tensors: list[Tensor], out_dir: Path, max_bytes: int
                  ) -> list[Path]:
    sizes = [int(np.prod(slice_shape(weights["buffers" if t.buffer else "params"], t))) * 4
             for t in tensors]
    plan = shard_plan(sizes, max_bytes)
    count = plan[-1] + 1
    files = [out_dir / ("model.safetensors" if count == 1 else
                        f"model-{i + 1:05d}-of-{count:05d}.safetensors") for i in range(count)]
    shard: dict[str, np.ndarray] = {}
    current = 0
    for (name, array), number in zip(_hf_arrays(weights, tensors), plan, strict=True):
        if number != current:
            _save(shard, files[current])
            current = number
        shard[name] = array
    _save(shard, files[current])
    if count > 1:
        weight_map = {t.hf: files[number].name for t, number in zip(tensors, plan, strict=True)}
        (out_dir / INDEX).write_text(json.dumps(
            {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}, indent=2) + "\n")
    return files


def _save(tensors: dict[str, np.ndarray], path: Path) -> None:
    save_file(tensors, str(path), metadata={"format": "pt"})
    tensors.clear()  # the shard's copies go now, before the next shard is converted


def _with_buffers(m: ModelConfig, params: dict, buffers: dict) -> dict:
    """The parameters, and the buffers a Hugging Face model keeps as weights.

    DeepSeek-V3's router biases; zeros where the checkpoint has none.
    """
    if not buffers:
        _, _, abstract = nnx.split(abstract_model(m), nnx.Param, ...)
        buffers = jax.tree.map(lambda a: np.zeros(a.shape, np.float32),
                               nnx.to_pure_dict(abstract))
    return {"params": params, "buffers": buffers}


def export_hf(source: Path, out_dir: Path, max_shard_size: str = DEFAULT_MAX_SHARD
              ) -> tuple[list[Path], int]:
    """Write the Hugging Face directory of checkpoint ``source`` into ``out_dir``.

    ``source``: a step, run or checkpoints directory. Returns the weight files and the step.
    """
    max_bytes = parse_size(max_shard_size)
    path = step_dir(source)
    cfg = config_from_dict(read_config(path))
    hf_config = hf_config_from_model(cfg.model)  # refuses before anything is read
    params, buffers, step = read_weights(path)
    params = merged_weights(params, cfg.train.lora)  # a LoRA run's adapters, merged
    params = fit_vocab(params, cfg.model.vocab_size)  # the padded vocabulary's rows dropped
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in [*out_dir.glob("model*.safetensors"), out_dir / INDEX]:
        old.unlink(missing_ok=True)  # a previous export's shards would confuse loaders
    files = _write_shards(_with_buffers(cfg.model, params, buffers), hf_tensors(cfg.model),
                          out_dir, max_bytes)
    (out_dir / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    tokenizer = Path(cfg.data.tokenizer).expanduser()
    if tokenizer.name == "tokenizer.json" and tokenizer.is_file():
        for name in TOKENIZER_FILES:
            if (tokenizer.parent / name).is_file() and name != "generation_config.json":
                shutil.copyfile(tokenizer.parent / name, out_dir / name)
    eos = list(cfg.generation.eos_ids)
    if eos:
        (out_dir / "generation_config.json").write_text(json.dumps(
            {"eos_token_id": eos[0] if len(eos) == 1 else eos}, indent=2) + "\n")
    return files, step


def export_hf_main(source: Path, out_dir: Path, max_shard_size: str) -> int:
    """``jaxpar export --format hf``: export, then say what was written."""
    files, step = export_hf(source, out_dir.expanduser(), max_shard_size)
    print(f"exported step {step} as a Hugging Face model: {len(files)} safetensors file(s) and "
          f"config.json in {out_dir}")
    return 0
