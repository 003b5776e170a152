"""A checkpoint's weights without its training state: what ``jaxpar generate`` loads.

Three steps, in the order a command needs them: :func:`step_dir` finds the step;
:func:`saved_config` reads its config as plain JSON, before jax starts (docs/jax-notes.md, "Orbax");
:func:`read_weights` reads parameters and MoE buffers onto the host, verified. The optimizer state
is never read; the caller lays the arrays out on its own mesh.
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
    """``source`` as a complete step directory (or the newest under it).

    A one-line :class:`CheckpointError` when there is none.
    """
    found = newest_at(source.expanduser())
    if found is None:
        raise CheckpointError(f"{source}: no complete checkpoint there (expected a step "
                              "directory such as run/checkpoints/200, or a directory holding "
                              "them)")
    return found


def saved_config(path: Path) -> dict[str, Any]:
    """The config item of step directory ``path`` as a dict, read as JSON without orbax."""
    file = path / "config" / "metadata"
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"checkpoint {path}: cannot read its config ({err})") from None
    if not isinstance(data, dict) or "model" not in data:
        raise CheckpointError(f"checkpoint {path}: {file} holds no jaxpar config")
    return data


def read_weights(path: Path) -> tuple[dict, dict, int]:
    """(parameters, buffers, step) of step directory ``path``, numpy in their stored dtypes.

    Verified against the checkpoint's checksums when it has them.
    """
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
