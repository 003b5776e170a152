"""Context parallelism: causal attention over a sequence split across the ``context`` mesh axis.

``ring`` (default) passes each device's K/V block round a ``ppermute`` ring into an online
softmax, and runs the ring again backward (custom VJP); ``allgather`` gathers K and V once per
layer. ``ulysses``, ``hybrid``: :mod:`jaxpar.parallel.ulysses`. The *zigzag* layout (device i
holds chunks i and 2N-1-i) balances the causal work. Bytes per device:
docs/attention-and-loss.md, "Context parallelism".
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxpar.model.attention import (
    block_kind,
    blockwise,
    empty_statistics,
    finish,
    fold_keys,
    group,
    kernel_mask,
    unfold_keys,
    whole,
    zeros_like,
)
from jaxpar.parallel.point_to_point import ppermute_in_order

CONTEXT_AXIS = "context"


# --------------------------------------------------------------------------------------------
# Layout


def zigzag_order(seq_len: int, n: int) -> np.ndarray:
    """Token order such that a contiguous n-way split gives device i chunks i and 2n-1-i."""
    chunks = np.arange(seq_len).reshape(2 * n, seq_len // (2 * n))
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * n - 1 - i]]) for i in range(n)])


def block_schedule(seq_len: int, n: int, zigzag: bool) -> np.ndarray:
    """kinds[device, ring step, query chunk, key chunk], from the kernel's ``block_kind`` rule on
    the host. Non-SKIP entries are the blocks each device computes."""
    order = zigzag_order(seq_len, n) if zigzag else np.arange(seq_len)
    chunks = 2 if zigzag else 1
    local = order.reshape(n, chunks, -1)  # device -> chunk -> positions
    kinds = np.zeros((n, n, chunks, chunks), np.int32)
    for device in range(n):
        for step in range(n):
            source = (device - step) % n  # whose K/V block arrives at this step
            for qc in range(chunks):
                for kc in range(chunks):
                    kinds[device, step, qc, kc] = int(block_kind(local[device, qc],
                                                                 local[source, kc]))
    return kinds


def ring_pairs(n: int, stride: int = 1) -> list[tuple[int, int]]:
    """The ring's (source, target) pairs on ``context``: device i -> i + stride (> 1: several
    rings side by side, the hybrid's outer ring)."""
    size = n * stride
    return [(i, (i + stride) % size) for i in range(size)]


def _rotate(tree, n: int, stride: int = 1):
    """Send every array to device i + stride on the ring."""
    ring = ring_pairs(n, stride)
    leaves, treedef = jax.tree.flatten(tree)
    # In order: independent ppermutes can cross on XLA:CPU (parallel/point_to_point.py).
    return jax.tree.unflatten(
        treedef, ppermute_in_order(leaves, CONTEXT_AXIS, [ring] * len(leaves)))


# --------------------------------------------------------------------------------------------
# Ring attention (runs per device, inside shard_map over `context`)


def ring_forward(q, k, v, q_pos, k_pos, n: int, block: int, count: bool = False,
                 stride: int = 1):
    """q: [B, s, K, G, D], k, v: [B, s, K, D] and masks, all local -> (out, lse), plus, with
    ``count``, the number of blocks this device computed."""
    acc = empty_statistics(q)
    blocks = jnp.zeros((), jnp.int32)
    kv_block = (k, v, k_pos)
    for step in range(n):
        # Start sending this block on before computing with it, so the transfer can overlap.
        incoming = _rotate(kv_block, n, stride) if step < n - 1 else None
        acc = fold_keys(acc, q, *kv_block[:2], q_pos, kv_block[2], block, count=count)
        if count:
            acc, computed = acc
            blocks = blocks + computed
        kv_block = incoming
    return (*finish(acc), blocks) if count else finish(acc)


def _ring_backward(q, k, v, q_pos, k_pos, out, lse, do, n: int, block: int, stride: int):
    delta = jnp.sum(do.astype(jnp.float32) * out, axis=-1)  # rowsum(dO * O)
    dq = zeros_like(q)
    # dK/dV travel with their K/V block; after n hops they are back on the block's owner.
    kv_block = (k, v, k_pos, zeros_like(k), zeros_like(v))
    for _ in range(n):
        kb, vb, kposb, dkb, dvb = kv_block
        dq, dkb, dvb = unfold_keys((dq, dkb, dvb), q, kb, vb, do, lse, delta, q_pos, kposb,
                                   block)
        kv_block = _rotate((kb, vb, kposb, dkb, dvb), n, stride)
    _, _, _, dk, dv = kv_block
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


@partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def ring_attention_local(q, k, v, q_pos, k_pos, n, block, stride=1):
    """Ring attention on one device's blocks, inside ``shard_map`` over ``context``."""
    return ring_forward(q, k, v, q_pos, k_pos, n, block, stride=stride)[0].astype(q.dtype)


def _ring_fwd(q, k, v, q_pos, k_pos, n, block, stride):
    out, lse = whole(partial(ring_forward, stride=stride), 5, 6)(q, k, v, q_pos, k_pos, n,
                                                                 block)
    # Residuals are this device's blocks only: O(S/N) per device.
    return out.astype(q.dtype), (q, k, v, q_pos, k_pos, out, lse)


def _ring_bwd(n, block, stride, residuals, do):
    q, k, v, q_pos, k_pos, out, lse = residuals
    dq, dk, dv = _ring_backward(q, k, v, q_pos, k_pos, out, lse, do, n, block, stride)
    return dq, dk, dv, None, None


ring_attention_local.defvjp(_ring_fwd, _ring_bwd)


# --------------------------------------------------------------------------------------------
# All-gather attention (runs per device, inside shard_map over `context`)


def _allgather_attention_local(q, k, v, q_pos, k_pos, block: int):
    """Local queries against the whole sequence's K/V, gathered once; the backward pass
    reduce-scatters dK/dV."""
    k_all = _gathered_sequence(k)
    v_all = _gathered_sequence(v)
    kpos_all = jax.tree.map(lambda a: lax.all_gather(a, CONTEXT_AXIS, axis=1, tiled=True), k_pos)
    return blockwise(q, k_all, v_all, q_pos, kpos_all, block)


@jax.custom_vjp
def _gathered_sequence(x: jax.Array) -> jax.Array:
    """``x`` [B, s, ...] all-gathered over ``context`` along the sequence. The gradient is
    reduce-scattered in float32, keeping N partial sums' precision (XLA:CPU cannot compile the
    bf16 one)."""
    return lax.all_gather(x, CONTEXT_AXIS, axis=1, tiled=True)


def _gathered_sequence_fwd(x):
    return _gathered_sequence(x), None


def _gathered_sequence_bwd(_, dx_all):
    summed = lax.psum_scatter(dx_all.astype(jnp.float32), CONTEXT_AXIS, scatter_dimension=1,
                              tiled=True)
    return (summed.astype(dx_all.dtype),)


_gathered_sequence.defvjp(_gathered_sequence_fwd, _gathered_sequence_bwd)


# --------------------------------------------------------------------------------------------
# Entry point used by the model's attention


def local_tokens(seq_len: int, n: int, zigzag: bool) -> int:
    """Tokens of one contiguous piece of a device's sequence: its share, or half under zigzag."""
    return seq_len // n // (2 if zigzag else 1)


def context_attention(impl: str, n: int, zigzag: bool, batch_axes: tuple[str, ...] = (),
                      block: int | None = None) -> Callable:
    """q [B,S,H,D], k/v [B,S,K,D] -> [B,S,H,D]. S is split over ``context`` and B over
    ``batch_axes``, both manual (so the batch is not gathered around the K/V collectives); heads
    are left to the compiler. ``block``: queries and keys per step (default: one zigzag chunk)."""
    rows = batch_axes or None
    seq = P(rows, CONTEXT_AXIS)
    seq4 = P(rows, CONTEXT_AXIS, None, None)
    return jax.shard_map(local_context_attention(impl, n, zigzag, block),
                         in_specs=(seq4, seq4, seq4, seq), out_specs=seq4,
                         axis_names=frozenset((CONTEXT_AXIS, *batch_axes)))


def local_context_attention(impl: str, n: int, zigzag: bool, block: int | None = None
                            ) -> Callable:
    """The same attention on one device's piece, ``context`` already manual (a pipeline stage)."""

    def local(q, k, v, positions):
        qg = group(q, k.shape[2])
        positions = kernel_mask(positions)
        size = block or positions.order.shape[1] // (2 if zigzag else 1)
        if impl == "ring":
            out = ring_attention_local(qg, k, v, positions, positions, n, size)
        else:
            out = _allgather_attention_local(qg, k, v, positions, positions, size)
        return out.reshape(q.shape)

    return local
