"""The device mesh: six named axes, virtual CPU devices, and the device count validation needs.

Axis order (outermost first) is ``pipe, data, fsdp, expert, context, tensor``: ``jax.make_mesh``
lays the innermost axis over the devices with the fastest links, which is where the chattiest
parallelism (tensor) belongs.

``host_devices=N`` must take effect before jax initialises a backend, so
:func:`use_host_devices` is called by the CLI right after the config is read and before anything
touches ``jax.devices()``. With several processes it means N devices *per process*. It also
keeps the memory of one step's buffers for the next
(:func:`jaxpar.platform.keep_host_memory`).

In a multi-process run (``jaxpar/distributed.py`` joins the runtime, also before any backend
starts) ``jax.devices()`` lists the devices of every process and the mesh spans them all; each
process then feeds only the batch rows its own devices hold (:func:`process_batch_rows`).
"""

from __future__ import annotations

import math
import os
import re

import numpy as np

from jaxpar.config import MESH_AXES, Config
from jaxpar.platform import (
    OVERLAP_LIBTPU_FLAGS,
    add_libtpu_flags,
    keep_host_memory,
    tpu_compiler_options,
)


def use_host_devices(count: int | None) -> None:
    """Ask for ``count`` virtual CPU devices (and the CPU platform), before jax starts a backend."""
    if count is None:
        return
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "",
                   os.environ.get("XLA_FLAGS", ""))
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()
    os.environ["JAX_PLATFORMS"] = "cpu"
    keep_host_memory()
    import jax  # noqa: PLC0415  (imported late on purpose: the flags above must come first)

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", count)


def step_compiler_options(platform: str, cfg: Config) -> dict[str, str] | None:
    """The compiler options ``cfg``'s step compiles with on ``platform`` (None: the compiler's
    defaults): :func:`jaxpar.platform.tpu_compiler_options`, sequence parallelism counted
    where ``tensor`` splits anything."""
    return tpu_compiler_options(platform, cfg.parallel.sequence_parallel and cfg.mesh.tensor > 1)


def use_compiler_flags(cfg: Config) -> None:
    """Add the libtpu flags ``cfg`` needs to ``LIBTPU_INIT_ARGS``, before libtpu loads
    (:data:`jaxpar.platform.OVERLAP_LIBTPU_FLAGS` for ``parallel.pipeline_overlap``)."""
    if cfg.parallel.pipeline_overlap:
        add_libtpu_flags(OVERLAP_LIBTPU_FLAGS)


def device_count(cfg: Config) -> int:
    """Devices the mesh will span: every device of every process (``host_devices`` of them per
    process when set). Join the runtime first in a multi-process run
    (:func:`jaxpar.distributed.start_distributed`)."""
    use_host_devices(cfg.host_devices)
    import jax  # noqa: PLC0415

    local = jax.local_device_count()
    if cfg.host_devices is not None and local != cfg.host_devices:
        raise RuntimeError(
            f"host_devices={cfg.host_devices} asked for, but jax already started with {local} "
            "devices (set host_devices before anything imports and uses jax)")
    return jax.device_count()


def make_mesh(cfg: Config, devices=None):
    """A ``jax.sharding.Mesh`` with the six named axes, all ``Auto``, for a validated ``cfg``.
    ``devices`` defaults to all (tests pass a prefix to compare with one device); over several
    slices they are arranged by :func:`hybrid_device_mesh`."""
    import jax  # noqa: PLC0415

    shape = tuple(getattr(cfg.mesh, axis) for axis in MESH_AXES)
    axis_types = (jax.sharding.AxisType.Auto,) * len(shape)
    if cfg.mesh.dcn.slices > 1:
        return jax.sharding.Mesh(hybrid_device_mesh(cfg, devices), MESH_AXES,
                                 axis_types=axis_types)
    try:
        return jax.make_mesh(shape, MESH_AXES, axis_types=axis_types, devices=devices)
    except NotImplementedError:
        # A TPU slice whose torus axes cannot each be given whole to one mesh axis: tensor=8 and
        # fsdp=8 on a 4x4x4 v5p slice ("Failed to find assignment for logical_axis_index ...").
        # Then a mesh axis may span parts of several torus axes (tensor over 4 x 2 chips), as
        # jax.make_mesh itself allows on v5e; the devices of each axis still form a sub-torus.
        return jax.sharding.Mesh(split_device_mesh(shape, devices), MESH_AXES,
                                 axis_types=axis_types)


def hybrid_device_mesh(cfg: Config, devices=None) -> np.ndarray:
    """The device array of a mesh over several slices (``mesh.dcn``): along each axis its ``dcn``
    outer factor steps from slice to slice, so a collective over an axis with ``dcn`` 1 never
    leaves a slice. A slice is the devices' ``slice_index``, else a process, else (virtual CPU
    devices) consecutive blocks in id order."""
    import jax  # noqa: PLC0415
    from jax.experimental import mesh_utils  # noqa: PLC0415

    dcn = tuple(cfg.mesh.dcn.sizes().values())
    ici = tuple(getattr(cfg.mesh, a) // d for a, d in zip(MESH_AXES, dcn, strict=True))
    devices = list(jax.devices() if devices is None else devices)[: math.prod(ici) * math.prod(dcn)]
    slices = cfg.mesh.dcn.slices
    for key in ("slice_index", "process_index"):
        if len({getattr(d, key, None) for d in devices}) == slices:
            return mesh_utils.create_hybrid_device_mesh(
                ici, dcn, devices, process_is_granule=key == "process_index",
                allow_split_physical_axes=True)
    found = len({d.process_index for d in devices})
    if found > 1:
        raise ValueError(f"mesh.dcn: {slices} slices asked for, but the devices come from "
                         f"{found} processes and carry no slice index; run one process per slice")
    # One process: slice s is devices [s * n, (s + 1) * n). Its block, laid out by the inner
    # sizes, sits at the slice's position in the dcn grid (np.block's arrangement).
    grid = np.empty(len(devices), dtype=object)
    grid[:] = sorted(devices, key=lambda d: d.id)
    blocks = grid.reshape(*dcn, *ici)
    n = len(MESH_AXES)
    order = [i for axis in range(n) for i in (axis, n + axis)]  # dcn_0, ici_0, dcn_1, ...
    return blocks.transpose(order).reshape(tuple(cfg.mesh.sizes().values()))


def split_device_mesh(shape: tuple[int, ...], devices=None) -> np.ndarray:
    """``mesh_utils.create_device_mesh`` with ``allow_split_physical_axes=True``: the device
    array for ``shape`` when a mesh axis must split a physical (torus) axis."""
    import jax  # noqa: PLC0415
    from jax.experimental import mesh_utils  # noqa: PLC0415

    devices = list(jax.devices() if devices is None else devices)[: int(np.prod(shape))]
    return mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)


def process_batch_rows(sharding, shape: tuple[int, ...]) -> np.ndarray:
    """The rows of a global ``shape`` array laid out by ``sharding`` that this process's devices
    hold, sorted: the rows it must read. From the sharding, not the process index: where an axis
    that replicates the batch spans processes, several hold the same rows."""
    rows: set[int] = set()
    for index in sharding.addressable_devices_indices_map(tuple(shape)).values():
        rows.update(range(*index[0].indices(shape[0])))
    return np.array(sorted(rows), dtype=np.int64)
