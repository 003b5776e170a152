"""``jaxpar import-hf DIR --to OUT``: a Hugging Face model directory as a weights-only checkpoint.

Reads ``config.json`` (:mod:`jaxpar.hf.config`) and the safetensors files a block of rows at a time,
into the stacked float32 arrays of the jaxpar model (:mod:`jaxpar.hf.names`). Writes
``OUT/checkpoints/0``, a ``config.yaml`` to train from, and the tokenizer files. The config also
says how prompts are encoded and which ids end a sequence (:func:`generation_settings`). What it
writes and its memory: docs/hugging-face.md, "Import".
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml
from flax import nnx
from safetensors import safe_open

from jaxpar.checkpoint.weights import save_weights
from jaxpar.config import (
    Config,
    DataConfig,
    GenerationConfig,
    ModelConfig,
    TrainConfig,
    to_dict,
)
from jaxpar.hf.config import HFConfigError, model_config_from_hf, read_hf_config
from jaxpar.hf.fp8 import SCALE_SUFFIX, dequantized_rows, scale_name, tensor_info
from jaxpar.hf.names import (
    PLUS_ONE,
    TEXT_PREFIXES,
    Tensor,
    hf_shape,
    hf_tensors,
    jaxpar_view,
    param_at,
)
from jaxpar.model.layers import LocalLayer
from jaxpar.model.transformer import abstract_model
from jaxpar.model.vocab import fit_vocab

INDEX = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "chat_template.jinja")
BLOCK_BYTES = 2**20  # a tensor is read this many (float32) bytes at a time
# Tensors a Hugging Face directory may hold that the model does not use.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# The multimodal Gemma 3's image side: jaxpar imports its language model only.
LEFT_OUT_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                     "model.multi_modal_projector.")


@dataclass(frozen=True)
class Imported:
    checkpoint: Path  # the step directory written
    config_yaml: Path  # a jaxpar config that starts training from it
    model: ModelConfig
    tokenizer: Path | None  # the copied tokenizer.json, if the source had one
    total_bytes: int  # float32 bytes of the parameters
    generation: GenerationConfig  # how prompts are encoded, which ids end a sequence
    left_out: int = 0  # tensors of the source not imported (a multimodal model's image side)
    prediction_layers: int = 0  # DeepSeek's multi-token-prediction layers, left out


def weight_files(directory: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it."""
    index = directory / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as err:
            raise HFConfigError(f"{index}: not a safetensors index ({err})") from None
        return {name: directory / file for name, file in weight_map.items()}
    single = directory / "model.safetensors"
    if not single.is_file():
        raise HFConfigError(f"{directory}: neither model.safetensors nor {INDEX} (only "
                            "safetensors weights are read)")
    with safe_open(str(single), "np") as f:
        return dict.fromkeys(f.keys(), single)


def _host_arrays(m: ModelConfig) -> dict:
    """Empty float32 arrays shaped as the model's ``{"params": ..., "buffers": ...}``."""
    # the window flags follow the config: no tensor holds them
    _, params, _, buffers = nnx.split(abstract_model(m), nnx.Param, LocalLayer, ...)

    def build(node):
        if isinstance(node, dict):
            return {k: build(v) for k, v in node.items()}
        return np.empty(node.shape, np.float32)

    return {"params": build(nnx.to_pure_dict(params)), "buffers": build(nnx.to_pure_dict(buffers))}


def _tree(arrays: dict, t: Tensor) -> dict:
    return arrays["buffers" if t.buffer else "params"]


def _check_coverage(tensors: list[Tensor], params: dict) -> None:
    """Every slice of every parameter gets exactly one tensor (else garbage stays).

    A guard on :func:`hf_tensors`.
    """
    slices: dict[tuple[str, ...], set] = {}
    for t in tensors:
        slices.setdefault((t.buffer, *t.path), set()).add(t.index)
    paths = {(kind == "buffers", *p) for kind in params for p in _paths(params[kind])}
    assert set(slices) == paths, sorted(set(slices) ^ paths)
    for (buffer, *path), indices in slices.items():
        tree = params["buffers" if buffer else "params"]
        stacked = param_at(tree, tuple(path)).shape[:len(next(iter(indices)))]
        assert len(indices) == int(np.prod(stacked, dtype=int)), path


def _paths(tree: dict, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    out = []
    for key, value in tree.items():
        out += _paths(value, (*prefix, key)) if isinstance(value, dict) else [(*prefix, key)]
    return out


def text_prefix(files: dict[str, Path]) -> str:
    """Where the checkpoint keeps the language model (:data:`TEXT_PREFIXES`)."""
    return next((p for p in TEXT_PREFIXES if f"{p}embed_tokens.weight" in files), "model.")


def _check_names(tensors: list[Tensor], files: dict[str, Path], m: ModelConfig,
                 left_out: tuple[str, ...]) -> int:
    """Refuses a missing or unknown tensor; returns how many start with ``left_out``."""
    wanted = {t.hf for t in tensors}
    missing = sorted(wanted - set(files))
    if missing:
        raise HFConfigError(f"tensor {missing[0]} is missing from the safetensors files "
                            f"({len(missing)} missing)")
    unused = [n for n in set(files) - wanted if n.startswith(left_out)] if left_out else []
    extra = sorted(n for n in set(files) - wanted - set(unused)
                   if not n.endswith(IGNORED_SUFFIXES)
                   and not (n.endswith(SCALE_SUFFIX) and n[:-len(SCALE_SUFFIX)] in wanted)
                   and not (m.mla.enabled and prediction_layer(n, m) is not None)
                   and not (m.tie_embeddings and n in TEXT_PREFIXES.values()))  # tied: a copy
    if extra:
        raise HFConfigError(f"tensor {extra[0]}: the model jaxpar builds from config.json has no "
                            f"such weight ({len(extra)} unknown; an unsupported config field?)")
    return len(unused)


def prediction_layer(name: str, m: ModelConfig) -> int | None:
    """The layer of a DeepSeek multi-token-prediction tensor (past ``n_layers``), else None."""
    match = re.match(r"model\.layers\.(\d+)\.", name)
    return int(match.group(1)) if match and int(match.group(1)) >= m.n_layers else None


def read_weights(directory: Path, m: ModelConfig, block: tuple[int, int] | None = None,
                 left_out: tuple[str, ...] = ()) -> tuple[dict, int]:
    """Every tensor of ``directory`` in jaxpar's layout, float32 ``{"params", "buffers"}`` host
    arrays.

    Also the count of unread tensors starting with ``left_out``. ``block``: the float8 scale blocks.
    """
    files = weight_files(directory)
    tensors = hf_tensors(m, text_prefix(files))
    unused = _check_names(tensors, files, m, left_out)
    arrays = _host_arrays(m)
    _check_coverage(tensors, arrays)
    for t in tensors:
        scales = files.get(scale_name(t.hf))
        _read_into(files[t.hf], t, param_at(_tree(arrays, t), t.path)[t.index],
                   (scales, block) if scales is not None and block else None)
    return arrays, unused


def _read_into(file: Path, t: Tensor, target: np.ndarray,
               quantized: tuple[Path, tuple[int, int]] | None = None) -> None:
    """Tensor ``t`` of ``file`` into its float32 slice ``target``, BLOCK_BYTES at a time.

    The file is opened per block, so no whole copy or mapped pages stay resident. ``quantized``: the
    float8 scales' file and block (:mod:`jaxpar.hf.fp8`).
    """
    shape = tensor_info(file, t.hf)[1]
    if shape != hf_shape(t.layout, target.shape):
        raise HFConfigError(f"tensor {t.hf} is {list(shape)}, but config.json makes it "
                            f"{list(hf_shape(t.layout, target.shape))}")
    view, transposed = jaxpar_view(t.layout, target)
    rows = max(1, BLOCK_BYTES // max(1, 4 * int(np.prod(shape[1:], dtype=int))))
    for start in range(0, shape[0], rows):
        stop = min(start + rows, shape[0])
        if quantized is not None:
            block = dequantized_rows(file, quantized[0], t.hf, start, stop, quantized[1])
        else:
            with safe_open(str(file), "np") as f:
                block = f.get_slice(t.hf)[start:stop]
        if transposed:
            view[:, start:start + rows] = block.T  # converts to float32 as it copies
        else:
            view[start:start + rows] = block
    if t.layout == PLUS_ONE:  # Gemma's norms multiply by 1 + weight, added in float32
        target += np.float32(1.0)


def _copy_tokenizer(source: Path, out_dir: Path) -> Path | None:
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, out_dir / name)
    copied = out_dir / "tokenizer.json"
    return copied.absolute() if copied.is_file() else None


def generation_settings(source: Path, hf: dict, vocab_size: int) -> GenerationConfig:
    """How prompts are encoded and where sequences end, as transformers does.

    The model's own tokenizer; ``eos_token_id`` of ``generation_config.json``, else ``config.json``
    (one id or a list). Ids outside the vocabulary are dropped.
    """
    ids = None
    path = source / "generation_config.json"
    if path.is_file():
        try:
            ids = json.loads(path.read_text()).get("eos_token_id")
        except (OSError, ValueError, AttributeError) as err:
            raise HFConfigError(f"{path}: cannot read it as a JSON object ({err})") from None
    if ids is None:
        ids = hf.get("eos_token_id")
    ids = [] if ids is None else [ids] if isinstance(ids, int) else ids
    if not isinstance(ids, list) or not all(type(i) is int for i in ids):
        raise HFConfigError(f"eos_token_id: {ids!r} is neither a token id nor a list of them")
    return GenerationConfig(prompt="tokenizer",
                            eos_ids=tuple(dict.fromkeys(i for i in ids if 0 <= i < vocab_size)))


def import_hf(source: Path, out_dir: Path) -> Imported:
    """Convert the Hugging Face model directory ``source`` into ``out_dir``."""
    source, out_dir = source.expanduser(), out_dir.expanduser()
    if not source.is_dir():
        raise HFConfigError(f"{source}: not a directory")
    if (out_dir / "checkpoints").exists():
        raise HFConfigError(f"--to {out_dir}: already holds checkpoints; choose a new directory")
    hf = read_hf_config(source)
    model = model_config_from_hf(hf)
    generation = generation_settings(source, hf, model.vocab_size)
    multimodal = hf.get("model_type") == "gemma3"
    block = (hf.get("quantization_config") or {}).get("weight_block_size")
    arrays, left_out = read_weights(source, model, tuple(block) if block else None,
                                    LEFT_OUT_PREFIXES if multimodal else ())
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = _copy_tokenizer(source, out_dir)
    # The config to train from: the model, these weights, the tokenizer if there is one, and
    # how to prompt it.
    cfg = Config(model=model, train=TrainConfig(init_from=str(out_dir.absolute())),
                 data=DataConfig(tokenizer=str(tokenizer)) if tokenizer else DataConfig(),
                 generation=generation)
    # The vocabulary padded as one device pads it (model.vocab_multiple); a run whose layout
    # pads it further reads the rows it needs (jaxpar/checkpoint/repad.py).
    params = fit_vocab(arrays["params"], cfg.vocab_rows())
    path = save_weights(out_dir, cfg, params, {"source": str(source.absolute()),
                                               "format": "huggingface",
                                               "vocab_size": model.vocab_size,
                                               "vocab_rows": cfg.vocab_rows()},
                        buffers=arrays["buffers"] or None)
    config_yaml = out_dir / "config.yaml"
    config_yaml.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    total = sum(param_at(arrays["params"], p).nbytes for p in _paths(arrays["params"]))
    return Imported(checkpoint=path, config_yaml=config_yaml, model=model, tokenizer=tokenizer,
                    total_bytes=total, generation=generation, left_out=left_out,
                    prediction_layers=int(hf.get("num_nextn_predict_layers") or 0))


def import_hf_main(source: Path, out_dir: Path) -> int:
    """``jaxpar import-hf``: convert, then say what was written and how to train."""
    done = import_hf(source, out_dir)
    m = done.model
    if done.left_out:
        print(f"left out {done.left_out} tensors of the vision tower and projector: jaxpar "
              "imports the language model only")
    rows = Config(model=m).vocab_rows()
    print(f"imported {source}: {m.n_layers} layers, d_model {m.d_model}, vocab {m.vocab_size}"
          + (f" (padded to {rows} rows: model.vocab_multiple)" if rows > m.vocab_size else "")
          + (f", {m.moe.num_experts} experts" if m.moe.enabled else "")
          + f" ({done.total_bytes / 2**20:.1f} MiB float32) -> {done.checkpoint}")
    if done.prediction_layers:
        print(f"left out: {done.prediction_layers} multi-token-prediction layer(s) (layers "
              f"numbered from {m.n_layers}; jaxpar trains next-token prediction only)")
    tokenizer = (f"data.tokenizer={done.tokenizer} (set in it)" if done.tokenizer else
                 "no tokenizer.json there: set data.tokenizer to the model's tokenizer.json")
    print(f"train from it: jaxpar train {done.config_yaml} run_dir=RUN data.source=DATA "
          f"(train.init_from={out_dir}; {tokenizer})")
    ids = done.generation.eos_ids
    ends = (f"any of the ids {', '.join(map(str, ids))}" if len(ids) > 1 else
            f"id {ids[0]}" if ids else "the tokenizer's end-of-text token")
    print(f"generate from it: jaxpar generate {out_dir} --prompt TEXT (prompts as its tokenizer "
          f"encodes them, special tokens included; a sequence ends at {ends})")
    return 0
