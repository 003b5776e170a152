"""Platform and compiler workarounds, in one place.

Each entry names what it works around and the compiler version it was seen on, so it can go
when that compiler is gone. The rest of the library asks here instead of testing the platform
itself. Only the standard library is imported: the config layer, which must not import jax,
uses this module too. What was tried and measured: docs/jax-notes.md and docs/performance.md.
"""

from __future__ import annotations

import ctypes
import os

# The TPU compiler the refusals below were seen on (named in their error messages).
CHECKED_LIBTPU = "libtpu 0.0.42.1"

# Platforms whose compiler aborts on a ``shard_map`` nested in the pipeline executor's.
# libtpu 0.0.42.1: "Check failed: target.IsManualSubgroup() == sharding().IsManualSubgroup()",
# in the backward pass's copy of the inner shard_map. jax 0.12 and libtpu 0.0.48 compile it.
# Used by parallel/hooks.py; docs/jax-notes.md, "A `shard_map` nested in a pipeline stage
# aborts libtpu".
NO_SHARD_MAP_IN_STAGES = ("tpu",)

# Platforms whose compiler fails on a ragged all-to-all (the dropless dispatch over ``expert``)
# inside the pipeline executor's loops. libtpu 0.0.42.1: a RET_CHECK in its
# "MaskAggregatorBlock" lowering; libtpu 0.0.48 compiles it. The capacity dispatch compiles.
NO_RAGGED_IN_STAGES = ("tpu",)

# Platforms whose compiler keeps FSDP's gathers of some weights synchronous, where a ring of
# sends lets the scheduler overlap them (parallel.fsdp_gather=auto picks the ring there): the
# routed experts' gathers inside their shard_map, and those of weights split over tensor too,
# which libtpu 0.0.52's collective matmul does not decompose. XLA:CPU runs every collective
# synchronously (nothing to gain); GPUs are unmeasured.
RING_GATHER_PLATFORMS = ("tpu",)

# Platforms without a ragged all-to-all: the dropless dispatch sends padded blocks there
# (parallel/expert.py). XLA:CPU in jax 0.10.2: "UNIMPLEMENTED".
PADDED_ALL_TO_ALL_PLATFORMS = ("cpu",)

# Platforms whose compiler aborts on bfloat16 sums inside a pipeline stage ("Invalid binary
# instruction opcode copy", XLA:CPU in jax 0.10.2): the sums there run in float32. The
# executor's handovers over ``pipe`` (parallel/pipeline/stages.py), and the experts' sums over
# ``tensor`` (parallel/expert.py).
FLOAT32_STAGE_SUM_PLATFORMS = ("cpu",)
FLOAT32_TENSOR_SUM_PLATFORMS = ("cpu",)

# Platforms that cannot compile bfloat16 gradient sums. XLA:CPU in jax 0.10.2 aborts on the
# train step's bfloat16 psums ("Invalid binary instruction opcode copy"), over data and pipe.
NO_BF16_GRADIENT_SUMS = ("cpu",)

# The TPU compiler's libtpu flags for ``parallel.pipeline_overlap``. libtpu 0.0.42 makes an
# all-to-all inside a loop asynchronous only with this flag, and only then can the other pass's
# matmuls hide it (docs/jax-notes.md, "Backward jaxprs, asynchronous all-to-alls").
OVERLAP_LIBTPU_FLAGS = ("--xla_tpu_enable_async_all_to_all=true",)

# Compiler options of every TPU step. By default (libtpu 0.0.42 to 0.0.52) the TPU compiler
# makes a collective matmul only of an all-gather its own partitioner inserts. FSDP's weight
# gather is written before the matmul (model/projection.py), so it would stay synchronous.
# The post-SPMD mode decomposes it after partitioning (docs/jax-notes.md, "Collective matmuls
# on the TPU compiler"; measured in docs/performance.md, "Collective matmuls for the weight
# gathers").
TPU_COMPILER_OPTIONS = {"xla_tpu_all_gather_collective_matmul_mode": "post_spmd"}
# The same for the reduce-scatters after matmuls, under sequence parallelism only. Elsewhere it
# gains nothing and costs: reduce-scatters outside rings become all-reduces and slices.
SP_TPU_COMPILER_OPTIONS = {"xla_tpu_reduce_scatter_collective_matmul_mode": "post_spmd"}

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8


def splash_possible(pipe: int, tensor: int) -> bool:
    """Whether the TPU splash kernel can run in a mesh of ``pipe`` stages and ``tensor``.

    Not in pipeline stages that split heads over ``tensor``: libtpu 0.0.42.1's partitioner
    aborts on the kernel's nested shard_map there (see :data:`NO_SHARD_MAP_IN_STAGES`)."""
    return not (pipe > 1 and tensor > 1)


def partitioner_sum_dtype(xla_cpu: bool, dtype: str) -> str:
    """The dtype in which the partitioner sums a weight gradient that a matmul in ``dtype``
    made. XLA:CPU runs bfloat16 dots in float32, so there it is float32 (jax 0.10.2);
    GPU and TPU compilers sum in the matmul's dtype."""
    return "float32" if xla_cpu else dtype


def tpu_compiler_options(platform: str, sequence_parallel: bool) -> dict[str, str] | None:
    """The compiler options of a step on ``platform`` (None: the compiler's defaults).

    :data:`TPU_COMPILER_OPTIONS` on a TPU, with :data:`SP_TPU_COMPILER_OPTIONS` under
    sequence parallelism; an option the user set in ``LIBTPU_INIT_ARGS`` stays theirs."""
    if platform != "tpu":
        return None
    wanted = dict(TPU_COMPILER_OPTIONS)
    if sequence_parallel:
        wanted.update(SP_TPU_COMPILER_OPTIONS)
    names = {flag.split("=")[0].lstrip("-") for flag in
             os.environ.get("LIBTPU_INIT_ARGS", "").split()}
    return {name: value for name, value in wanted.items() if name not in names}


def add_libtpu_flags(flags: tuple[str, ...]) -> None:
    """Add ``flags`` to ``LIBTPU_INIT_ARGS`` before libtpu loads. A flag the user set stays as
    set; other platforms read none of them."""
    current = os.environ.get("LIBTPU_INIT_ARGS", "")
    names = {flag.split("=")[0] for flag in current.split()}
    added = [flag for flag in flags if flag.split("=")[0] not in names]
    if added:
        os.environ["LIBTPU_INIT_ARGS"] = " ".join([current, *added]).strip()


def keep_host_memory() -> None:
    """Have XLA:CPU's step buffers reuse memory instead of faulting fresh pages in every step.

    XLA:CPU mallocs each device's temporary buffer when a step starts and frees it at the end.
    glibc maps allocations that large afresh each time, so every step zero-fills every page
    again. One arena, never ``mmap``ed and trimmed only past 2 GiB free, keeps the pages
    mapped, as a GPU or TPU runtime keeps its pool. It must run before jax starts its threads
    (each would take an arena of its own). glibc only; elsewhere nothing changes. Why and what
    it saves: docs/jax-notes.md, "XLA:CPU memory between steps"."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    mallopt(_M_ARENA_MAX, 1)
    mallopt(_M_MMAP_MAX, 0)
    mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)  # an int: the largest it takes
