"""Weights without the rest of a train state: export, weights-only checkpoints, ``train.init_from``.

``jaxpar export``'s flat format; weights-only checkpoints (what ``jaxpar import-hf`` writes);
starting a run from weights. Their format: docs/checkpoints.md, "Weights-only checkpoints". Reading
weights onto the host: :mod:`jaxpar.checkpoint.weights_only`.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxpar.checkpoint.integrity import leaf_name
from jaxpar.checkpoint.state import (
    CHECKPOINTS,
    CheckpointError,
    check_compatible,
    corrupt_error,
    item_handlers,
    quiet_failed_reads,
    read_config,
    read_meta,
    vocab_padding,
)
from jaxpar.checkpoint.weights_only import read_weights, step_dir
from jaxpar.config import Config, config_from_dict, to_dict

# Arrays orbax may be writing at once (in bytes, a multiple of the largest; its default is
# 96 GB): each write holds a copy of its array, so writing a whole model at once would double
# the host memory a weights-only save needs.
ARRAYS_IN_FLIGHT = 1
# Arrays are written in chunks of at most this many bytes: the encoded copy of a chunk that
# tensorstore makes on the way to the file stays small.
CHUNK_BYTES = 4 * 2**20


def is_weights_only(path: Path) -> bool:
    return bool(read_meta(path).get("weights_only"))


class _ChosenSettingNotes(logging.Filter):
    """orbax's warnings about two settings :func:`save_weights` makes on purpose."""

    NOTES = ("ArrayMetadata persistence is disabled", "Skipping merge of OCDBT")

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(note in record.getMessage() for note in self.NOTES)


def save_weights(out_dir: Path, cfg: Config, params: dict, meta: dict[str, Any],
                 buffers: dict | None = None) -> Path:
    """Write ``params`` (host arrays) as the weights-only checkpoint ``out_dir/checkpoints/0``.

    Returns that step directory. ``buffers``: model buffers saved beside them (an imported
    DeepSeek-V3's router biases).
    """
    notes = _ChosenSettingNotes()
    logging.getLogger("absl").addFilter(notes)
    try:
        return _save_weights(out_dir, cfg, {"params": params, **(
            {"buffers": buffers} if buffers else {})}, meta)
    finally:
        logging.getLogger("absl").removeFilter(notes)


def _save_weights(out_dir: Path, cfg: Config, state: dict, meta: dict[str, Any]) -> Path:
    path = (out_dir / CHECKPOINTS / "0").absolute()
    largest = max(a.nbytes for a in jax.tree.leaves(state))
    # Nor should orbax copy each array before writing it (it does by default, in case the
    # caller changes them while a save goes on in the background; these are written in the
    # foreground and dropped after).
    arrays = ocp.type_handlers.NumpyHandler(deepcopy_host_arrays=False)
    handlers = dict(item_handlers(), state=ocp.PyTreeCheckpointHandler(
        save_concurrent_gb=(ARRAYS_IN_FLIGHT * largest + 1) / 1e9,
        # One zarr directory per array: OCDBT's shared data files buffer much more (measured
        # on a 104 MB model: +85 MB against +25 MB).
        use_ocdbt=False,
        type_handler_registry=ocp.type_handlers.create_type_handler_registry(
            (np.ndarray, arrays))))
    for name in ("data", "checksums"):
        handlers.pop(name)
    checkpointer = ocp.Checkpointer(ocp.CompositeCheckpointHandler(**handlers))
    try:
        checkpointer.save(path, args=ocp.args.Composite(
            state=ocp.args.PyTreeSave(state, save_args=jax.tree.map(
                lambda _: ocp.SaveArgs(chunk_byte_size=CHUNK_BYTES), state)),
            config=ocp.args.JsonSave(to_dict(cfg)),
            meta=ocp.args.JsonSave({"step": 0, "weights_only": True, **meta})))
    finally:
        checkpointer.close()
    return path


def stored_buffers(source: Path) -> Any:
    """The model buffers' metadata that weights-only checkpoint ``source`` holds; empty if none."""
    if not is_weights_only(source):
        return {}
    handlers = dict(item_handlers(), state=ocp.PyTreeCheckpointHandler())
    checkpointer = ocp.Checkpointer(ocp.CompositeCheckpointHandler(**handlers))
    try:
        with quiet_failed_reads():
            return checkpointer.metadata(source.absolute()).item_metadata["state"].get(
                "buffers") or {}
    finally:
        checkpointer.close()


def restore_params(source: Path, wanted: Any, item: str = "params",
                   vocab_size: int | None = None) -> Any:
    """The parameters (or ``item``) of checkpoint ``source``, read into ``wanted``'s shardings.

    ``wanted``: ``jax.ShapeDtypeStruct`` with shardings; any mesh may have saved it. Only that item
    is read. ``vocab_size`` given: another padding is zero-padded or cut as it is read
    (:mod:`jaxpar.checkpoint.repad`).
    """

    def shapes(tree: Any) -> dict[str, tuple]:  # shapes only: any stored dtype converts
        return {f"{item}/{leaf_name(p)}": (tuple(a.shape), "")
                for p, a in jax.tree_util.tree_flatten_with_path(tree)[0]}

    handlers = dict(item_handlers(), state=ocp.PyTreeCheckpointHandler())
    checkpointer = ocp.Checkpointer(ocp.CompositeCheckpointHandler(**handlers))
    try:
        with quiet_failed_reads():
            saved = checkpointer.metadata(source.absolute()).item_metadata["state"][item]
        rows = vocab_padding(source, shapes(saved), shapes(wanted), vocab_size)
        check_compatible(shapes(saved), shapes(wanted), source, rows)
        args = jax.tree.map(lambda a: ocp.ArrayRestoreArgs(
            sharding=a.sharding, global_shape=a.shape, dtype=a.dtype, strict=rows is None),
            wanted)
        # PyTreeCheckpointHandler (not Standard) can restore a part of the tree.
        only_item = ocp.args.PyTreeRestore(item={item: wanted}, restore_args={item: args},
                                           partial_restore=True)
        with quiet_failed_reads():
            return checkpointer.restore(source.absolute(), args=ocp.args.Composite(
                state=only_item))["state"][item]
    except CheckpointError:
        raise
    except Exception as err:  # noqa: BLE001  (any read failure is one user-facing line)
        raise corrupt_error(source, err) from None
    finally:
        checkpointer.close()


# --------------------------------------------------------------------------------------------
# Export in jaxpar's own flat format.


def export(source: Path, out_dir: Path) -> tuple[Path, Path, int]:
    """Write ``model.safetensors`` and ``config.json`` into ``out_dir``; returns both paths and the
    step.

    ``source``: a step, ``checkpoints`` or run directory. Only the parameters are read, verified, on
    the host. The format: docs/checkpoints.md, "Export".
    """
    from safetensors.numpy import save_file  # noqa: PLC0415  (only export needs it)

    from jaxpar.model.transformer import abstract_model  # noqa: PLC0415
    from jaxpar.model.vocab import fit_vocab  # noqa: PLC0415
    from jaxpar.parallel.rules import param_logical_axes  # noqa: PLC0415

    path = step_dir(source)
    cfg = config_from_dict(read_config(path))
    params, _, step = read_weights(path)
    params = fit_vocab(params, cfg.model.vocab_size)  # the padded vocabulary's rows dropped
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    # float32 whatever train.param_dtype stored (bf16 -> f32 is exact; safetensors' numpy
    # writer and most readers expect a numpy dtype).
    tensors = {leaf_name(p): np.ascontiguousarray(v, dtype=np.float32) for p, v in leaves}
    axes = jax.tree_util.tree_flatten_with_path(
        param_logical_axes(abstract_model(cfg.model)),
        is_leaf=lambda x: isinstance(x, tuple))[0]
    out_dir.mkdir(parents=True, exist_ok=True)
    weights, config_json = out_dir / "model.safetensors", out_dir / "config.json"
    save_file(tensors, str(weights), metadata={"format": "np", "step": str(step)})
    info = {"model": to_dict(cfg)["model"], "step": step, "source": str(path),
            "dtype": "float32",
            "params": {name: {"shape": list(tensors[name].shape)} for name in tensors}}
    for p, names in axes:
        if leaf_name(p) in info["params"]:
            info["params"][leaf_name(p)]["axes"] = list(names)
    config_json.write_text(json.dumps(info, indent=2) + "\n")
    return weights, config_json, step
