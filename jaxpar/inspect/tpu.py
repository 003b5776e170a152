"""Compile the train step for a real TPU topology on a machine without TPUs (``--target``).

libtpu (the ``tpu`` extra) describes the slice compile-only. The TPU compiler compiles for it here,
showing what XLA:CPU cannot: overlapped collectives, bf16 gathers, TPU memory. Nothing runs. Limits:
docs/inspect.md, "TPU targets"; compiler facts: docs/jax-notes.md, "Compiling for a TPU topology
from a CPU machine".
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
from dataclasses import dataclass
from importlib import metadata
from typing import Any

from jaxpar.config import ConfigError

INSTALL_HINT = "pip install -e '.[tpu]'"


@dataclass(frozen=True)
class Generation:
    """A TPU generation as libtpu names it, and the shape of its slices' topology names."""

    libtpu_name: str  # the prefix libtpu's topology names use ("v5e" in "v5e:2x4")
    dims: int  # 2 for the 2D tori of v5e/v6e, 3 for the 3D tori of v4/v5p/v7x
    example: str  # a valid slice, for the error message
    # "megacore": the chip's two TensorCores run as one device, as jax runs v4 and v5p (libtpu's
    # compile-only v4 topology otherwise has one device per core, which jax.make_mesh rejects).
    chip_config: str | None = None


# User-facing names (``tpu-<generation>:<topology>``) -> libtpu's (docs/jax-notes.md, "Compiling
# for a TPU topology from a CPU machine"); v2/v3 are left out as retired.
GENERATIONS: dict[str, Generation] = {
    "v4": Generation("v4", 3, "2x2x1", chip_config="megacore"),
    "v5e": Generation("v5e", 2, "2x4"),
    "v5p": Generation("v5p", 3, "2x2x1", chip_config="megacore"),
    "v6e": Generation("v6e", 2, "2x4"),
    "v7x": Generation("tpu7x", 3, "2x2x1"),
}

# libtpu assumes hosts of 2x2x1 chips and rejects a smaller slice unless told its host is smaller.
_DEFAULT_CHIPS_PER_HOST = (2, 2, 1)

_TARGET_RE = re.compile(r"tpu-(?P<generation>[a-z0-9]+):(?P<topology>\d+(?:x\d+)*)")


def accepted_forms() -> str:
    return ", ".join(f"tpu-{name}:{g.example}" for name, g in GENERATIONS.items())


@dataclass(frozen=True)
class TpuTarget:
    """A parsed ``--target``: a TPU generation and the chip grid of one slice."""

    generation: str  # user-facing, e.g. "v5e"
    dims: tuple[int, ...]  # chips along each torus axis, e.g. (2, 4)
    slices: int = 1  # slices of that shape, joined by the data-center network (--slices)

    @property
    def name(self) -> str:
        return f"tpu-{self.generation}:{'x'.join(map(str, self.dims))}"

    @property
    def topology_name(self) -> str:
        """What ``jax.experimental.topologies.get_topology_desc`` accepts, e.g. ``v5e:2x4``."""
        return f"{GENERATIONS[self.generation].libtpu_name}:{'x'.join(map(str, self.dims))}"

    @property
    def chips(self) -> int:
        """Chips in all the slices."""
        return math.prod(self.dims) * self.slices


def parse_target(text: str, slices: int = 1) -> TpuTarget:
    """``tpu-v5e:2x4`` -> TpuTarget (``slices`` of it); else a one-line ConfigError."""
    m = _TARGET_RE.fullmatch(text.strip().lower())
    generation = GENERATIONS.get(m.group("generation")) if m else None
    dims = tuple(int(d) for d in m.group("topology").split("x")) if m else ()
    if generation is None or len(dims) != generation.dims or min(dims) < 1:
        raise ConfigError(
            f"--target {text}: expected tpu-GENERATION:TOPOLOGY, chips per torus axis (2 axes for "
            f"v5e/v6e, 3 for v4/v5p/v7x); accepted: {accepted_forms()}, ...")
    return TpuTarget(m.group("generation"), dims, slices)


def libtpu_installed() -> bool:
    """Is libtpu importable, or named by TPU_LIBRARY_PATH? Checked without importing either."""
    if os.environ.get("TPU_LIBRARY_PATH"):
        return True
    try:
        return importlib.util.find_spec("libtpu") is not None
    except (ImportError, ValueError):
        return False


def require_libtpu() -> None:
    if not libtpu_installed():
        raise ConfigError(f"--target needs the TPU compiler (libtpu), which is not installed: "
                          f"{INSTALL_HINT}")


def libtpu_version() -> str | None:
    try:
        return metadata.version("libtpu")
    except metadata.PackageNotFoundError:  # TPU_LIBRARY_PATH build, or a nightly package name
        return None


def quiet_libtpu_env() -> None:
    """Environment for a compile-only libtpu; must run before libtpu initialises.

    It silences libtpu's probes of this machine as a TPU VM (docs/jax-notes.md, "Compiling for a TPU
    topology from a CPU machine"). User settings win, except the platform.
    """
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-8")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    # libtpu takes /tmp/libtpu_lockfile so two processes don't drive one TPU; a compile-only
    # process drives none, and must not fail because another process (a parallel test, a second
    # inspect) holds the lock.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    os.environ["JAX_PLATFORMS"] = "cpu"  # nothing may try to run on a TPU


def topology_devices(target: TpuTarget) -> list[Any]:
    """The compile-only devices of ``target``'s slices, one per TensorCore.

    With several slices each carries its ``slice_index``. libtpu's rejection of a topology is a
    ConfigError with its message.
    """
    require_libtpu()
    quiet_libtpu_env()
    import jax  # noqa: PLC0415  (after the environment above)
    from jax.experimental import topologies  # noqa: PLC0415

    jax.config.update("jax_platforms", "cpu")  # in case jax was imported before the env was set
    generation = GENERATIONS[target.generation]
    dims3 = (*target.dims, 1, 1)[:3]
    kwargs: dict[str, Any] = {}
    if generation.chip_config:
        kwargs["chip_config_name"] = generation.chip_config
    kwargs["wrap"] = torus_wrap(generation, dims3)
    if target.slices > 1:
        kwargs["num_slices"] = target.slices
    if any(d < h for d, h in zip(dims3, _DEFAULT_CHIPS_PER_HOST, strict=True)):
        # A slice smaller than a 2x2 host (tpu-v5e:1x1): libtpu needs the smaller host spelled
        # out, else it rejects the layout as "not divisible by chips_per_host_bounds".
        kwargs["chips_per_host_bounds"] = tuple(
            min(d, h) for d, h in zip(dims3, _DEFAULT_CHIPS_PER_HOST, strict=True))
    try:
        topology = topologies.get_topology_desc(
            platform="tpu", topology_name=target.topology_name, **kwargs)
    except (RuntimeError, ValueError) as err:  # JaxRuntimeError is a RuntimeError
        message = " ".join(str(err).split())  # libtpu's messages span lines
        raise ConfigError(f"--target {target.name}: libtpu rejects topology "
                          f"{target.topology_name!r}: {message}") from err
    return list(topology.devices)


def torus_wrap(generation: Generation, dims3: tuple[int, ...]) -> tuple[bool, bool, bool]:
    """Which axes of a slice ``dims3`` close into a ring, as on real hardware.

    A 3D torus (v4, v5p, v7x): every axis if all sides are 4 or more. 2D (v5e, v6e): each side of
    16.
    """
    if generation.dims == 3:
        ring = all(d >= 4 for d in dims3)
        return (ring, ring, ring)
    return tuple(d == 16 for d in dims3[:2]) + (False,)


def report_fields(target: TpuTarget, devices: list[Any]) -> dict[str, Any]:
    """What the report's ``run`` header adds for a target (JSON-able)."""
    version = libtpu_version()
    return {
        "target": target.name,
        "topology": target.topology_name,
        "chips": target.chips,
        "slices": target.slices,
        "compiler": f"libtpu {version}" if version else "libtpu",
        "cores_per_chip": len(devices) // target.chips,
    }
