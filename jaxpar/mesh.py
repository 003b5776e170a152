"""The device mesh: six named axes, virtual CPU devices, and the device count validation needs.

Axis order (outermost first) is ``pipe, data, fsdp, expert, context, tensor``: ``jax.make_mesh``
lays the innermost axis over the devices with the fastest links, which is where the chattiest
parallelism (tensor) belongs.

``host_devices=N`` must take effect before jax initialises a backend, so
:func:`use_host_devices` is called by the CLI right after the config is read and before anything
touches ``jax.devices()``. With several processes it means N devices *per process*.

Multi-process runs (the ``distributed`` config section): :func:`start_distributed` joins JAX's
multi-controller runtime, also before any backend starts; afterwards ``jax.devices()`` lists the
devices of every process and the mesh spans them all. Each process then feeds only the batch rows
its own devices hold (:func:`process_batch_rows`).
"""

from __future__ import annotations

import os
import re

import numpy as np

from jaxpar.config import MESH_AXES, Config, DistributedConfig


class DistributedError(RuntimeError):
    """The multi-process runtime could not start, or another process failed (exit code 1)."""


def use_host_devices(count: int | None) -> None:
    """Ask for ``count`` virtual CPU devices (and the CPU platform), before jax starts a backend."""
    if count is None:
        return
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "",
                   os.environ.get("XLA_FLAGS", ""))
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax  # noqa: PLC0415  (imported late on purpose: the flags above must come first)

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", count)


def device_count(cfg: Config) -> int:
    """Devices the mesh will span: every device of every process (``host_devices`` of them per
    process when set). Call :func:`start_distributed` first in a multi-process run."""
    use_host_devices(cfg.host_devices)
    import jax  # noqa: PLC0415

    local = jax.local_device_count()
    if cfg.host_devices is not None and local != cfg.host_devices:
        raise RuntimeError(
            f"host_devices={cfg.host_devices} asked for, but jax already started with {local} "
            "devices (set host_devices before anything imports and uses jax)")
    return jax.device_count()


def cluster_process_count() -> int:
    """Processes in this job as JAX's own cluster detection sees them (SLURM, Open MPI, TPU pod
    slices, Kubernetes); 1 outside a cluster.

    JAX keeps that detection private (``jax._src.clusters``); if it moves, this says 1 and
    ``distributed.enabled=on`` still reaches it through ``jax.distributed.initialize``."""
    try:
        from jax._src.clusters import ClusterEnv  # noqa: PLC0415
    except ImportError:
        return 1
    for env in ClusterEnv._cluster_types:
        if not env.opt_in_only_method and env.is_env_present():
            return int(env.get_process_count())
    return 1


def wants_distributed(d: DistributedConfig) -> bool:
    """``enabled=on``; or ``auto`` with a process field given or a multi-process cluster."""
    if d.enabled == "off":
        return False
    return d.enabled == "on" or d.fields_given() or cluster_process_count() > 1


def start_distributed(d: DistributedConfig) -> bool:
    """Join the multi-controller runtime if ``d`` asks for it (before any jax backend starts);
    True if it did. Unset fields come from JAX's cluster detection.

    ``timeout_s`` bounds the three waits of the runtime: for every process to connect at
    start-up, for a silent process to be declared dead (its heartbeats stop; the runtime then
    ends every other process), and for the others at shut-down.
    """
    if not wants_distributed(d):
        return False
    import jax  # noqa: PLC0415

    ids = ([int(i) for i in d.local_device_ids.split(",")] if d.local_device_ids is not None
           else None)
    try:
        jax.distributed.initialize(
            coordinator_address=d.coordinator, num_processes=d.num_processes,
            process_id=d.process_id, local_device_ids=ids, initialization_timeout=d.timeout_s,
            heartbeat_timeout_seconds=d.timeout_s, shutdown_timeout_seconds=d.timeout_s)
    except (RuntimeError, ValueError) as err:
        who = f"process {d.process_id}" if d.process_id is not None else "this process"
        raise DistributedError(f"{who} could not join the multi-process runtime (distributed."
                               f"coordinator={d.coordinator}, timeout_s={d.timeout_s}): "
                               f"{_first_line(err)}") from None
    return True


def process_label() -> str:
    """``process 1 of 2`` (empty in a one-process run): the prefix of every error line."""
    import jax  # noqa: PLC0415

    count = jax.process_count()
    return f"process {jax.process_index()} of {count}" if count > 1 else ""


def barrier(name: str, timeout_s: int) -> None:
    """Wait until every process reached ``name``; a DistributedError after ``timeout_s``.

    JAX's public barrier (``multihost_utils.sync_global_devices``) has no timeout, so this uses
    the runtime client's ``wait_at_barrier``; one process: nothing to wait for."""
    import jax  # noqa: PLC0415
    from jax._src import distributed  # noqa: PLC0415

    client = distributed.global_state.client
    if jax.process_count() == 1 or client is None:
        return
    try:
        client.wait_at_barrier(f"jaxpar_{name}", timeout_in_ms=timeout_s * 1000)
    except Exception as err:  # noqa: BLE001  (the runtime raises its own error types)
        raise DistributedError(f"{process_label()}: not every process reached {name} within "
                               f"{timeout_s} s (distributed.timeout_s): {_first_line(err)}"
                               ) from None


def lost_processes() -> list[int]:
    """Processes the runtime no longer hears from (their heartbeats stopped, or they left);
    empty when every process is alive or the runtime cannot be asked (its coordinator, process
    0, is among the lost)."""
    import jax  # noqa: PLC0415
    from jax._src import distributed  # noqa: PLC0415

    client = distributed.global_state.client
    if client is None:
        return []
    everyone = list(range(jax.process_count()))
    try:
        live = client.get_live_nodes(everyone)
    except Exception:  # noqa: BLE001  (the coordinator itself is gone)
        return [0] if jax.process_index() != 0 else []
    return [p for p in everyone if p not in live]


def _first_line(err: BaseException) -> str:
    return (str(err).strip() or type(err).__name__).splitlines()[0][:300]


def make_mesh(cfg: Config, devices=None):
    """A ``jax.sharding.Mesh`` with the six named axes, all ``Auto`` (sharding by annotation).

    ``cfg`` must be validated (no ``-1`` left in ``cfg.mesh``). ``devices`` defaults to all of
    them; tests pass a prefix to compare a layout with the 1-device run in one process.
    """
    import jax  # noqa: PLC0415

    shape = tuple(getattr(cfg.mesh, axis) for axis in MESH_AXES)
    return jax.make_mesh(shape, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(shape),
                         devices=devices)


def process_batch_rows(sharding, shape: tuple[int, ...]) -> np.ndarray:
    """The rows of a global ``shape`` array laid out by ``sharding`` that this process's devices
    hold, sorted: the rows this process must read.

    Derived from the sharding's device-to-index map, not from the process index: wherever an
    axis that replicates the batch (``pipe``, ``context``, ``tensor``) spans processes, several
    processes hold the same rows, and the rows of one process need not be contiguous."""
    rows: set[int] = set()
    for index in sharding.addressable_devices_indices_map(tuple(shape)).values():
        rows.update(range(*index[0].indices(shape[0])))
    return np.array(sorted(rows), dtype=np.int64)
