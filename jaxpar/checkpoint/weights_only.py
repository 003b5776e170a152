"""A checkpoint's weights without its training state: what ``jaxpar generate`` loads.

Three steps, in the order a command needs them:

1. :func:`step_dir`: the step directory a user named (a step, ``checkpoints`` or run directory,
   as ``jaxpar export`` takes them);
2. :func:`saved_config`: the resolved config of the run that saved it, read as plain JSON from
   the checkpoint's ``config`` item, *without* starting jax: ``host_devices`` (the run's, or an
   override) must still be able to choose the number of virtual CPU devices, and orbax's reader
   starts a backend;
3. :func:`read_weights`: the parameters and the MoE buffers (router biases) as host numpy
   arrays, checked against the checksums recorded at the save (the optimizer state is never
   read). The caller lays them out on its own mesh.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxpar.checkpoint import integrity
from jaxpar.checkpoint.state import (
    CheckpointError,
    DamagedCheckpointError,
    corrupt_error,
    item_handlers,
    newest_at,
    quiet_failed_reads,
)


def step_dir(source: Path) -> Path:
    """``source`` if it is a complete step directory, else the newest complete checkpoint of a
    ``checkpoints`` or run directory; a one-line :class:`CheckpointError` when there is none."""
    found = newest_at(source.expanduser())
    if found is None:
        raise CheckpointError(f"{source}: no complete checkpoint there (expected a step "
                              "directory such as run/checkpoints/200, or a directory holding "
                              "them)")
    return found


def saved_config(path: Path) -> dict[str, Any]:
    """The config item of step directory ``path`` as a dict. Orbax's JSON handler keeps it as
    one JSON file, ``config/metadata``, read here directly (see the module docstring)."""
    file = path / "config" / "metadata"
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"checkpoint {path}: cannot read its config ({err})") from None
    if not isinstance(data, dict) or "model" not in data:
        raise CheckpointError(f"checkpoint {path}: {file} holds no jaxpar config")
    return data


def read_weights(path: Path) -> tuple[dict, dict, int]:
    """(parameters, buffers, step) of step directory ``path``, as numpy arrays in their stored
    dtypes, verified against the checkpoint's checksums when it has them."""
    handlers = dict(item_handlers(), state=ocp.PyTreeCheckpointHandler())
    checkpointer = ocp.Checkpointer(ocp.CompositeCheckpointHandler(**handlers))
    try:
        with quiet_failed_reads():
            state = checkpointer.metadata(path.absolute()).item_metadata["state"]
        wanted = {"params": state["params"], "buffers": state.get("buffers") or {}}
        as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), wanted)
        only_weights = ocp.args.PyTreeRestore(item=wanted, restore_args=as_numpy,
                                              partial_restore=True)
        with quiet_failed_reads():
            restored = checkpointer.restore(path.absolute(), args=ocp.args.Composite(
                state=only_weights, meta=ocp.args.JsonRestore(),
                **integrity.restore_args(path)))
    except Exception as err:  # noqa: BLE001  (any read failure is one user-facing line)
        raise corrupt_error(path, err) from None
    finally:
        checkpointer.close()
    weights = restored["state"]
    recorded = restored.get("checksums")
    if recorded is not None:
        problem = integrity.problem(recorded, weights)
        if problem is not None:
            raise DamagedCheckpointError(f"checkpoint {path}: {problem}")
    return weights["params"], weights.get("buffers") or {}, int(restored["meta"]["step"])
