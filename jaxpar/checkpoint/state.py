"""Checkpoints: orbax saves of a run, resume, restore onto another mesh, and export.

A checkpoint is one orbax step directory, ``run_dir/checkpoints/<step>/``. Its items (state, data
position, config, meta, checksums) resume a run exactly. Each array is read straight into the
target's shardings, so any mesh of the same model loads it. Details and failures:
docs/checkpoints.md.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from jaxpar.checkpoint import integrity
from jaxpar.checkpoint.integrity import leaf_name
from jaxpar.checkpoint.repad import as_saved, repadded, repadded_axes, vocab_rows
from jaxpar.config import Config, ConfigError, to_dict

CHECKPOINTS = "checkpoints"  # under run_dir
ITEMS = ("state", "data", "config", "meta", "checksums")


class CheckpointError(ConfigError):
    """A checkpoint that cannot be used here (missing, corrupt, another model): exit 2."""


class DamagedCheckpointError(CheckpointError):
    """Damaged files: unreadable, or an array that fails its checksum.

    Only on this error does ``train.resume=auto`` fall back to an older checkpoint.
    """


def item_handlers(saving: bool = False) -> dict[str, ocp.CheckpointHandler]:
    # Named handlers let a fresh process read items back without orbax guessing (and warning).
    state = ocp.StandardCheckpointHandler()
    if saving:
        # Orbax's default splits each replicated shard between its replicas so that several hosts
        # share the writing. In one process that only adds a slicing op per shard and shape
        # (docs/performance.md, "Checkpoint saves"), so it is kept for multi-process runs only.
        # Same format on disk.
        arrays = ocp.type_handlers.ArrayHandler(use_replica_parallel=jax.process_count() > 1)
        state = ocp.PyTreeCheckpointHandler(
            type_handler_registry=ocp.type_handlers.create_type_handler_registry(
                (jax.Array, arrays)))
    return {"state": state, "data": ocp.JsonCheckpointHandler(),
            "config": ocp.JsonCheckpointHandler(), "meta": ocp.JsonCheckpointHandler(),
            "checksums": integrity.ChecksumHandler()}


def checkpoints_dir(cfg: Config) -> Path:
    return Path(cfg.run_dir) / CHECKPOINTS


def complete_steps(root: Path) -> list[int]:
    """Steps of the complete (finalized) checkpoints under ``root``, oldest first."""
    if not root.is_dir():
        return []
    return sorted(ocp.path.step.checkpoint_steps(root))


def _is_step_dir(path: Path) -> bool:
    return path.name.isdigit() and (path / "state").is_dir()


def find_checkpoint(cfg: Config) -> Path | None:
    """The step directory ``train.resume`` asks for, or None to start fresh.

    ``auto``: the newest complete checkpoint in ``run_dir/checkpoints``; ``never``: None; ``N``:
    ``run_dir/checkpoints/N``. Anything else is a path (docs/checkpoints.md, "Resume"). Every
    process gets the same answer, or all raise.
    """
    return _same_on_every_process(cfg, _choose(cfg))


def _choose(cfg: Config) -> Path | None:
    resume, root = cfg.train.resume.strip(), checkpoints_dir(cfg)
    if resume == "never":
        return None
    if resume == "auto":
        steps = complete_steps(root)
        return root / str(steps[-1]) if steps else None
    if resume.isdigit():
        path = root / str(int(resume))
        if path.is_dir() and ocp.path.step.is_path_finalized(path) and _is_step_dir(path):
            return path
        steps = complete_steps(root)
        raise CheckpointError(f"train.resume={resume}: no complete checkpoint for step "
                              f"{int(resume)} in {root} (complete: "
                              f"{', '.join(map(str, steps)) or 'none'})")
    path = newest_at(Path(resume).expanduser())
    if path is not None:
        return path
    raise CheckpointError(f"train.resume={resume}: no complete checkpoint there; allowed: auto, "
                          "never, a step number, or a path to a step directory (run/checkpoints/"
                          "200) or to a directory holding them")


def _same_on_every_process(cfg: Config, path: Path | None) -> Path | None:
    """Check that every process found the same step in run_dir.

    They do when run_dir is shared: a checkpoint is final only once every process's writes are done.
    """
    if jax.process_count() == 1:
        return path
    steps = multihost_utils.process_allgather(np.int32(-1 if path is None else int(path.name)))
    if len(set(steps.tolist())) > 1:
        seen = ", ".join(f"process {i}: {step if step >= 0 else 'none'}"
                         for i, step in enumerate(steps.tolist()))
        raise CheckpointError(f"train.resume={cfg.train.resume}: the processes find different "
                              f"checkpoints to resume from ({seen}); run_dir must be on a file "
                              "system that every process shares")
    return path


def check_run_dir_free(cfg: Config, restored_step: int | None) -> None:
    """Refuse a run whose saves would overwrite newer checkpoints in run_dir."""
    root = checkpoints_dir(cfg)
    steps = complete_steps(root)
    if restored_step is None and steps:
        raise CheckpointError(f"train.resume={cfg.train.resume}: {root} already holds "
                              f"checkpoints (newest: step {steps[-1]}) that this fresh run would "
                              "overwrite; use another run_dir or remove them")
    later = [s for s in steps if restored_step is not None and s > restored_step]
    if later:
        raise CheckpointError(f"train.resume={cfg.train.resume}: restoring step {restored_step}, "
                              f"but {root} holds later checkpoints ({', '.join(map(str, later))}) "
                              "that this run would overwrite; use another run_dir or remove them")


def _open() -> ocp.Checkpointer:
    return ocp.Checkpointer(ocp.CompositeCheckpointHandler(**item_handlers()))


def _read_json_items(path: Path, names: tuple[str, ...]) -> dict[str, Any]:
    checkpointer = _open()
    try:
        with quiet_failed_reads():
            restored = checkpointer.restore(path.absolute(), args=ocp.args.Composite(
                **{n: ocp.args.JsonRestore() for n in names}))
        return {n: restored[n] for n in names}
    except Exception as err:  # noqa: BLE001  (any read failure is one user-facing line)
        raise corrupt_error(path, err) from None
    finally:
        checkpointer.close()


def read_meta(path: Path) -> dict[str, Any]:
    """The ``meta`` item (step, seed, ...) without touching any array."""
    return _read_json_items(path, ("meta",))["meta"]


def read_config(path: Path) -> dict[str, Any]:
    """The resolved config (a dict) of the run that saved ``path``."""
    return _read_json_items(path, ("config",))["config"]


def corrupt_error(path: Path, err: BaseException,
             names: Mapping[str, str] | None = None) -> DamagedCheckpointError:
    """One line for a failed read, naming the array if tensorstore's error quotes its key.

    ``names`` maps orbax's keys (``params.layers.attn.wq``) to slash names.
    """
    text = str(err)
    for key, name in (names or {}).items():
        if f"'{key}/'" in text or f'"{key}/' in text:
            return DamagedCheckpointError(f"checkpoint {path}: array '{name}' is unreadable "
                                          f"(damaged file?): {_first_line(err)}")
    return DamagedCheckpointError(f"checkpoint {path} is unreadable or corrupt: "
                                  f"{_first_line(err)}")


@contextlib.contextmanager
def quiet_failed_reads() -> Iterator[None]:
    """Around an orbax read: silence the noise of its other reads after one fails.

    Only "Event loop is closed" and "Task exception was never retrieved", for good once a read
    failed (docs/jax-notes.md, "Orbax").
    """
    previous = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        value = unraisable.exc_value
        if not (isinstance(value, RuntimeError) and str(value) == "Event loop is closed"):
            previous(unraisable)

    sys.unraisablehook = hook
    unretrieved = _UnretrievedTaskErrors()
    logging.getLogger("asyncio").addFilter(unretrieved)
    yield
    sys.unraisablehook = previous  # reached only when the read succeeded
    logging.getLogger("asyncio").removeFilter(unretrieved)


class _UnretrievedTaskErrors(logging.Filter):
    """Drops asyncio's report of a failed read nobody awaited."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Task exception was never retrieved")


def _first_line(err: BaseException) -> str:
    text = str(err).strip() or type(err).__name__
    # Tensorstore appends its whole spec (dozens of lines) after this phrase.
    return text.splitlines()[0].split(". See full TensorStore details")[0][:300]


def _flat_shapes(tree: Any) -> dict[str, tuple[tuple[int, ...], str]]:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {leaf_name(path): (tuple(leaf.shape), np.dtype(leaf.dtype).name)
            for path, leaf in leaves}


def check_compatible(saved: Mapping[str, tuple], wanted: Mapping[str, tuple], path: Path,
                     rows: tuple[int, int] | None = None) -> None:
    """One line naming the first array that differs (missing, extra, shape or dtype).

    ``rows``: the vocabulary's (saved, wanted) rows, where dimensions differ on purpose
    (:func:`vocab_padding`).
    """
    hint = "model.*, train.param_dtype (and train.grad_clip) must match the run that saved it"
    for name, (shape, dtype) in wanted.items():
        if name not in saved:
            raise CheckpointError(f"checkpoint {path} does not fit this model: it has no array "
                                  f"{name}; {hint}")
        saved_shape, saved_dtype = saved[name]
        only_padding = (saved_dtype == dtype
                        and repadded_axes(saved_shape, shape, rows) is not None)
        if (saved_shape != shape or saved_dtype != dtype) and not only_padding:
            raise CheckpointError(f"checkpoint {path} does not fit this model: {name} is "
                                  f"{saved_dtype}{list(saved_shape)} there but {dtype}"
                                  f"{list(shape)} here; {hint}")
    extra = sorted(set(saved) - set(wanted))
    if extra:
        raise CheckpointError(f"checkpoint {path} does not fit this model: it has an array "
                              f"{extra[0]} this model lacks; {hint}")


def vocab_padding(path: Path, saved: Mapping[str, tuple], wanted: Mapping[str, tuple],
                  vocab_size: int | None) -> tuple[int, int] | None:
    """(saved, wanted) vocabulary rows where ``path`` pads differently from this run, else None.

    ``vocab_size``: this run's true vocabulary, which must be the checkpoint's; None checks and
    repads nothing.
    """
    if vocab_size is None:
        return None
    model = read_config(path).get("model") or {}
    if model.get("vocab_size", vocab_size) != vocab_size:
        raise CheckpointError(f"checkpoint {path} does not fit this model: its vocabulary has "
                              f"model.vocab_size={model['vocab_size']} ids, this run's "
                              f"{vocab_size}; model.* must match the run that saved it")
    have, want = vocab_rows(saved), vocab_rows(wanted)
    return None if have is None or want is None or have == want else (have, want)


@dataclass(frozen=True)
class Restored:
    state: Any  # TrainState, laid out as the abstract state asked
    data: dict[str, Any]  # data iterator state
    meta: dict[str, Any]
    seconds: float
    path: Path  # the step directory it came from
    verified: bool  # False: saved before checksums were recorded, so not checked


def restore(path: Path, abstract_state: Any, vocab_size: int | None = None) -> Restored:
    """Read checkpoint ``path`` into ``abstract_state``'s shapes and shardings; verify every array.

    ``abstract_state``: ``build_trainer(cfg, mesh).abstract_state`` for *this* run's mesh; no host
    holds a whole array. Raises :class:`DamagedCheckpointError` for damaged files,
    :class:`CheckpointError` for another model. ``vocab_size`` given: a differently padded
    vocabulary is repadded (:mod:`jaxpar.checkpoint.repad`).
    """
    start = time.perf_counter()
    wanted = _flat_shapes(abstract_state)
    keys = {name.replace("/", "."): name for name in wanted}  # orbax's key -> our name
    checkpointer = _open()
    try:
        try:
            with quiet_failed_reads():
                metadata = checkpointer.metadata(path.absolute()).item_metadata
            saved = _flat_shapes(metadata["state"])
        except Exception as err:  # noqa: BLE001  (any read failure is one user-facing line)
            raise corrupt_error(path, err, keys) from None
        rows = vocab_padding(path, saved, wanted, vocab_size)
        check_compatible(saved, wanted, path, rows)
        target = abstract_state if rows is None else as_saved(abstract_state, saved)
        try:
            with quiet_failed_reads():
                restored = checkpointer.restore(path.absolute(), args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(target),
                    data=ocp.args.JsonRestore(), meta=ocp.args.JsonRestore(),
                    **integrity.restore_args(path)))
        except Exception as err:  # noqa: BLE001
            raise corrupt_error(path, err, keys) from None
    finally:
        checkpointer.close()
    verified = _verify(path, restored["state"], restored.get("checksums"))
    state = restored["state"] if rows is None else repadded(restored["state"], abstract_state)
    return Restored(state=state, data=restored["data"], meta=restored["meta"],
                    seconds=time.perf_counter() - start, path=path, verified=verified)


def _verify(path: Path, state: Any, recorded: Mapping[str, Any] | None) -> bool:
    """Raise if an array of ``state`` fails its ``recorded`` checksum; False if none are recorded.
    """
    if recorded is None:
        return False
    problem = integrity.problem(recorded, state)
    if problem is not None:
        raise DamagedCheckpointError(f"checkpoint {path}: {problem}")
    return True


def resume(cfg: Config, source: Path, abstract_state: Any,
           say: Callable[[str], None]) -> Restored:
    """Restore ``source`` (:func:`find_checkpoint`'s choice).

    Under ``train.resume=auto`` a damaged checkpoint gives way to the next older one. Once one is
    intact, each damaged one is renamed ``<step>.damaged`` and ``say`` gets a line for it. If none
    is intact, or the checkpoint was named, the damage is the error.
    """
    candidates = [source]
    if cfg.train.resume.strip() == "auto":
        root = checkpoints_dir(cfg)
        candidates += [root / str(s) for s in reversed(complete_steps(root))
                       if s < int(source.name)]
    damaged: list[tuple[Path, DamagedCheckpointError]] = []
    for path in candidates:
        try:
            restored = restore(path, abstract_state, cfg.model.vocab_size)
        except DamagedCheckpointError as err:
            if len(candidates) == 1:
                raise
            damaged.append((path, err))
            continue
        for bad, err in damaged:
            moved = _move_aside(bad)
            say(f"{err}; resuming from step {path.name} ({path}), the newest intact "
                f"checkpoint, instead (moved the damaged one to {moved.name})")
        if not restored.verified:
            say(f"checkpoint {path} holds no checksums (saved by an older jaxpar): its arrays "
                "cannot be verified")
        return restored
    older = ", ".join(p.name for p, _ in damaged[1:])
    raise DamagedCheckpointError(f"{damaged[0][1]}; " + (
        f"the older checkpoints are damaged too (steps {older})" if older else
        "there is no older checkpoint to fall back to"))


def _move_aside(path: Path) -> Path:
    """Rename a damaged step directory out of orbax's sight (kept for a look).

    The primary process renames; all wait for it.
    """
    target = path.with_name(f"{path.name}.damaged")
    for n in range(2, 1000):
        if not target.exists():
            break
        target = path.with_name(f"{path.name}.damaged.{n}")
    _all_processes_reach(f"jaxpar: {path} is to be moved aside")  # all chose the same target
    if jax.process_index() == 0:
        path.rename(target)
    _all_processes_reach(f"jaxpar: {path} was moved aside")
    return target


def _all_processes_reach(name: str) -> None:
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


class Saver:
    """Asynchronous saves into ``run_dir/checkpoints``, keeping the newest ``checkpoint.keep``."""

    def __init__(self, cfg: Config, abstract_state: Any = None):
        """``abstract_state``: the saved states' layout, to compile their checksums now."""
        if abstract_state is not None:
            integrity.warm_up(abstract_state)
        self.root = checkpoints_dir(cfg)
        self._cfg = to_dict(cfg)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=cfg.checkpoint.keep, enable_async_checkpointing=True,
            # Temporary directories of saves killed part-way are garbage: drop them.
            cleanup_tmp_directories=True)
        self._manager = ocp.CheckpointManager(self.root.absolute(), options=options,
                                              item_handlers=item_handlers(saving=True))
        self.last_step: int | None = None

    def save(self, step: int, state: Any, data_state: dict[str, Any],
             meta: dict[str, Any]) -> float:
        """Start saving ``state`` as ``step``; returns the seconds the caller was blocked.

        Blocks while the arrays are copied to host memory, and while a previous save is being
        written. ``state`` may then be donated.
        """
        start = time.perf_counter()
        self._manager.save(step, args=ocp.args.Composite(
            state=ocp.args.PyTreeSave(state), data=ocp.args.JsonSave(data_state),
            config=ocp.args.JsonSave(self._cfg), meta=ocp.args.JsonSave(meta),
            # Computed on device while orbax copies the arrays; written in its background.
            checksums=integrity.ChecksumSave(integrity.start(state))))
        self.last_step = step
        return time.perf_counter() - start

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Wait for the save in flight to be on disk, then release orbax's threads."""
        self._manager.wait_until_finished()
        self._manager.close()


def newest_at(path: Path) -> Path | None:
    """``path`` if it is a complete step directory, else the newest checkpoint under it; or None."""
    if _is_step_dir(path) and ocp.path.step.is_path_finalized(path):
        return path
    for candidate in (path / CHECKPOINTS, path):
        steps = complete_steps(candidate)
        if steps:
            return candidate / str(steps[-1])
    return None
