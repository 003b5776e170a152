"""Ulysses context attention (all-to-all) and the hybrid of Ulysses and the ring.

``ulysses`` (DeepSpeed-Ulysses): per layer, all-to-alls over ``context`` turn the sequence
split into a head split, any one-device kernel attends, one all-to-all turns it back::

    q [B, S/c, H, D]  --all-to-all-->  [B, S, H/c, D]        (k and v likewise)

``hybrid`` ("USP"): Ulysses inside groups of u = ``parallel.ulysses_size`` neighbouring
devices, the ring between the c/u groups. Kv heads that do not split are repeated. Bytes,
memory, constraints, pipeline fallback: docs/attention-and-loss.md, "Ulysses and the hybrid".
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxpar.model.attention import blockwise_attention, group, kernel_mask
from jaxpar.model.mask import Positions
from jaxpar.parallel.context import CONTEXT_AXIS, ring_attention_local, zigzag_order

# attention(q [B,S,H,D], k [B,S,K,D], v [B,S,K,D], mask) -> [B,S,H,D] on one device's heads.
Kernel = Callable[[jax.Array, jax.Array, jax.Array, Positions], jax.Array]


# --------------------------------------------------------------------------------------------
# The exchanges


def exchange_groups(n: int, size: int) -> list[list[int]] | None:
    """The all-to-all's groups on ``context`` (n devices): runs of ``size``; None if size == n."""
    if size == n:
        return None
    return [list(range(g * size, (g + 1) * size)) for g in range(n // size)]


def kv_repeats(kv_heads: int, size: int) -> int:
    """Copies of each of a tensor shard's ``kv_heads`` so they split ``size`` ways (1 if they
    do)."""
    return size // math.gcd(kv_heads, size)


def _all_to_all(x: jax.Array, split_axis: int, concat_axis: int, n: int, size: int
                ) -> jax.Array:
    return lax.all_to_all(x, CONTEXT_AXIS, split_axis, concat_axis, tiled=True,
                          axis_index_groups=exchange_groups(n, size))


def sequence_to_heads(x: jax.Array, n: int, size: int, head_split: int) -> jax.Array:
    """[B, s, N, D] (own tokens, all heads) -> [B, s x size, N/size, D] (the group's tokens, own
    heads). Only one tensor shard's heads move (``head_split``)."""
    b, s, h, d = x.shape
    x = x.reshape(b, s, head_split, h // head_split, d)
    x = _all_to_all(x, split_axis=3, concat_axis=1, n=n, size=size)
    return x.reshape(b, s * size, h // size, d)


def heads_to_sequence(x: jax.Array, n: int, size: int, head_split: int) -> jax.Array:
    """The inverse of :func:`sequence_to_heads`: [B, s x size, N/size, D] -> [B, s, N, D]."""
    b, t, h, d = x.shape
    x = x.reshape(b, t, head_split, h // head_split, d)
    x = _all_to_all(x, split_axis=1, concat_axis=3, n=n, size=size)
    return x.reshape(b, t // size, h * size, d)


def _repeat_kv(x: jax.Array, size: int, head_split: int) -> jax.Array:
    """k or v [B, s, K, D], kv heads repeated until a tensor shard's split ``size`` ways."""
    r = kv_repeats(x.shape[2] // head_split, size)
    return jnp.repeat(x, r, axis=2) if r > 1 else x


def _gather_mask(mask: Positions, n: int, size: int) -> Positions:
    """Each ``[B, s]`` mask array all-gathered in the groups, in the device's new token order."""
    groups = exchange_groups(n, size)
    return jax.tree.map(lambda a: lax.all_gather(a, CONTEXT_AXIS, axis=1, tiled=True,
                                                 axis_index_groups=groups), mask)


def _reorder(x: jax.Array, chunks: np.ndarray) -> jax.Array:
    """``x``'s sequence cut into ``len(chunks)`` chunks, reordered by ``chunks`` (static
    slices)."""
    pieces = jnp.split(x, len(chunks), axis=1)
    return jnp.concatenate([pieces[int(c)] for c in chunks], axis=1)


# --------------------------------------------------------------------------------------------
# Per-device attention


def ulysses_local(n: int, zigzag: bool, head_split: int, kernel: Kernel) -> Callable:
    """Ulysses over all n ``context`` devices on [B, S/n, H, D]: ``kernel`` attends the whole
    sequence in natural order."""
    # Storage chunk j holds natural chunk stored[j] (context.zigzag_order, with 2n chunks).
    stored = zigzag_order(2 * n, n) if zigzag else None
    natural = np.argsort(stored) if zigzag else None

    def local(q, k, v, positions):
        k, v = (_repeat_kv(a, n, head_split) for a in (k, v))
        q, k, v = (sequence_to_heads(a, n, n, head_split) for a in (q, k, v))
        mask = _gather_mask(kernel_mask(positions), n, n)
        if stored is not None:  # natural order, so the kernel sees an ordinary sequence
            q, k, v, mask = jax.tree.map(lambda a: _reorder(a, natural), (q, k, v, mask))
        out = kernel(q, k, v, mask)
        if stored is not None:
            out = _reorder(out, stored)
        return heads_to_sequence(out, n, n, head_split)

    return local


def hybrid_local(n: int, size: int, zigzag: bool, head_split: int, block: int | None
                 ) -> Callable:
    """Ulysses in groups of ``size`` consecutive devices, the ring over groups, on [B, S/n, H, D].
    ``block``: the ring kernel's tile."""
    outer = n // size

    def local(q, k, v, positions):
        tile = block or q.shape[1] // (2 if zigzag else 1)
        k, v = (_repeat_kv(a, size, head_split) for a in (k, v))
        q, k, v = (sequence_to_heads(a, n, size, head_split) for a in (q, k, v))
        mask = _gather_mask(kernel_mask(positions), n, size)
        qg = group(q, k.shape[2])
        out = ring_attention_local(qg, k, v, mask, mask, outer, tile, size)
        return heads_to_sequence(out.reshape(q.shape), n, size, head_split)

    return local


def local_ulysses_attention(n: int, size: int, zigzag: bool, head_split: int = 1,
                            block: int | None = None, kernel: Kernel | None = None
                            ) -> Callable:
    """``ulysses`` (``size == n``) or ``hybrid`` on one device's piece, ``context`` manual.
    ``head_split``: pieces ``tensor`` splits the kv heads into; ``kernel``: Ulysses' attention."""
    if size == n:
        if kernel is None:
            def kernel(q, k, v, mask):
                tile = block or q.shape[1] // (2 * n)
                return blockwise_attention(tile)(q, k, v, mask)
        return ulysses_local(n, zigzag, head_split, kernel)
    return hybrid_local(n, size, zigzag, head_split, block)


def ulysses_attention(n: int, size: int, zigzag: bool, batch_axes: tuple[str, ...] = (),
                      block: int | None = None, *, head_axes: tuple[str, ...] = (),
                      kernel: Kernel | None = None, one_device_kernel: bool = False
                      ) -> Callable:
    """``attention(q, k, v, positions)`` for ``ulysses`` or ``hybrid``, as
    :func:`jaxpar.parallel.context.context_attention`, with ``head_axes`` manual too.
    ``one_device_kernel`` (splash): every mesh axis manual, output variance unchecked."""
    rows = batch_axes or None
    heads = P(rows, CONTEXT_AXIS, head_axes or None, None)
    local = local_ulysses_attention(n, size, zigzag, 1, block, kernel)
    named = frozenset((CONTEXT_AXIS, *batch_axes, *head_axes))

    def call(q, k, v, positions):
        names = named
        if one_device_kernel:
            mesh = jax.sharding.get_abstract_mesh()
            names = names | {a for a, kind in zip(mesh.axis_names, mesh.axis_types, strict=True)
                             if kind != jax.sharding.AxisType.Manual}
        return jax.shard_map(local, in_specs=(heads, heads, heads, P(rows, CONTEXT_AXIS)),
                             out_specs=heads, axis_names=names,
                             check_vma=not one_device_kernel)(q, k, v, positions)

    return call
