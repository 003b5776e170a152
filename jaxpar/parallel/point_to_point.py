"""Point-to-point sends: in the same order on every device, and rings that gather or
reduce-scatter.

JAX lowers every ``lax.ppermute`` with one channel id, and XLA:CPU keys its rendezvous by (run,
channel): independent sends could meet the wrong partners, and a ring attention step failed that way
(an abort, a segfault, once a silent NaN loss). :func:`ppermute_in_order` chains the sends through
``optimization_barrier`` ops, so the scheduler keeps their order. It changes no bytes, and compute
still overlaps the sends. What was seen and tried: docs/jax-notes.md, "Collectives under control
flow (XLA:CPU)".

:func:`ring_all_gather` and :func:`ring_reduce_scatter` are ``all_gather`` and
``psum_scatter`` as n - 1 sends round a ring of n devices, each moving 1/n of the array: the
same bytes as the one collective, in steps the compiler can schedule beside independent
matmuls (the TPU compiler keeps an all-gather written inside a ``shard_map`` synchronous).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from jaxpar import platform as workarounds
from jaxpar.config import Config


def ppermute_in_order(arrays: Sequence[jax.Array], axis: str,
                      perms: Sequence[Sequence[tuple[int, int]]]) -> list[jax.Array]:
    """``lax.ppermute(arrays[i], axis, perms[i])`` for each i, one after the other."""
    received: list[jax.Array] = []
    for x, perm in zip(arrays, perms, strict=True):
        if received:
            x, _ = lax.optimization_barrier((x, received[-1]))
        received.append(lax.ppermute(x, axis, list(perm)))
    return received


def fsdp_gather_ring(cfg: Config, platform: str) -> bool:
    """Whether FSDP's gathers that the compiler keeps synchronous (the routed experts', and
    weights split over ``tensor`` too) run as rings of sends (``parallel.fsdp_gather``;
    ``auto``: on :data:`jaxpar.platform.RING_GATHER_PLATFORMS`)."""
    how = cfg.parallel.fsdp_gather
    return how == "ring" or (how == "auto"
                             and platform in workarounds.RING_GATHER_PLATFORMS)


def _ring(axes: tuple[str, ...]) -> tuple[int, list[tuple[int, int]]]:
    n = 1
    for a in axes:
        n *= lax.axis_size(a)
    return n, [(i, (i + 1) % n) for i in range(n)]


def ring_all_gather(x: jax.Array, axes: tuple[str, ...], axis: int) -> jax.Array:
    """``lax.all_gather(x, axes, axis=axis, tiled=True)`` as n - 1 sends round a ring."""
    n, perm = _ring(axes)
    pieces, piece = [x], x
    for _ in range(n - 1):
        piece = lax.ppermute(piece, axes, perm)
        pieces.append(piece)  # the k-th came from device (me - k) mod n
    me = lax.axis_index(axes)
    blocks = jnp.stack(pieces)[(me - jnp.arange(n)) % n]  # [n, ...]: block j from device j
    shape = list(x.shape)
    shape[axis] *= n
    return jnp.moveaxis(blocks, 0, axis).reshape(shape)


def ring_reduce_scatter(x: jax.Array, axes: tuple[str, ...], axis: int) -> jax.Array:
    """``lax.psum_scatter(x, axes, scatter_dimension=axis, tiled=True)`` as n - 1 sends round
    a ring: the partial sum of block j starts on device j + 1 and adds each device's block j
    on its way round to device j."""
    n, perm = _ring(axes)
    size = x.shape[axis] // n
    me = lax.axis_index(axes)

    def block(j: jax.Array) -> jax.Array:
        return lax.dynamic_slice_in_dim(x, (j % n) * size, size, axis)

    total = block(me - 1)
    for t in range(1, n):
        total = lax.ppermute(total, axes, perm) + block(me - 1 - t)
    return total
