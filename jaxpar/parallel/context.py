"""Context parallelism: causal attention over a sequence split across the ``context`` mesh axis.

Everything outside attention is per token, so splitting the sequence over N devices splits those
activations N ways for free. Attention is the one place a token needs the others' keys and
values. Two ways to provide them, both inside ``shard_map`` over ``context`` only (``data``,
``fsdp`` and ``tensor`` stay automatic, so heads can be tensor-split at the same time):

``ring`` (default). Each device keeps its queries and passes its key/value block around a ring
with ``ppermute``: N steps, each combining one block into running (max, sum, output) statistics
of an online softmax, so no device ever holds all of K/V or an S x S score matrix. Per layer and
pass each device sends (N-1) K/V blocks of ``B x S/N x K x D`` elements each (x2 for K and V); the
backward pass runs the ring again (custom VJP) with the dK/dV accumulators travelling with their
blocks, one more hop to bring them home. Saved activations per device stay O(S/N).

``allgather`` (as in Llama 3 training). All-gather K and V over ``context`` once per layer (cheap
under grouped-query attention: K heads instead of H), attend the local queries to them; autodiff
turns the gather into a reduce-scatter of dK/dV in the backward pass. Each device holds the full
K/V of one layer: (N-1)/N x ``B x S x K x D`` x2 elements gathered.

Causal load balance (zigzag). With a contiguous split, device i's queries see i+1 of the N key
blocks, so the last device works N times as hard as the first. Cutting the sequence into 2N
chunks and giving device i chunks i and 2N-1-i evens this out: every device computes the same
number of unmasked blocks. The train step permutes tokens (and their positions) into this order
once on the host; the loss is a sum over tokens, so the order does not change it, and rotary
embeddings and the causal mask use the permuted positions, so nothing else changes either.

Blocks are classified by position ranges: all keys before all queries (full block, no mask), all
keys after all queries (skipped), otherwise masked elementwise with ``q_pos >= k_pos``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

CONTEXT_AXIS = "context"
SKIP, FULL, MASKED = 0, 1, 2
_NEG = -1e30  # a finite "minus infinity": keeps exp(m_old - m_new) free of inf - inf


# --------------------------------------------------------------------------------------------
# Layout


def zigzag_order(seq_len: int, n: int) -> np.ndarray:
    """Token order such that a contiguous n-way split gives device i chunks i and 2n-1-i."""
    chunks = np.arange(seq_len).reshape(2 * n, seq_len // (2 * n))
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * n - 1 - i]]) for i in range(n)])


def block_kind(q_pos, k_pos):
    """SKIP, FULL or MASKED for a block of queries against a block of keys (numpy or jax)."""
    skip = q_pos.max() < k_pos.min()
    full = q_pos.min() > k_pos.max()
    return jnp.where(skip, SKIP, jnp.where(full, FULL, MASKED))


def block_schedule(seq_len: int, n: int, zigzag: bool) -> np.ndarray:
    """kinds[device, ring step, query chunk, key chunk] for the ring, computed on the host.

    The same ``block_kind`` rule drives the kernel, so counting non-SKIP entries here counts the
    blocks each device really computes.
    """
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


# --------------------------------------------------------------------------------------------
# One block of attention, forward and backward (grouped-query layout [B, S, K, G, D])


def _scores(q, k, q_pos, k_pos, scale, masked):
    s = jnp.einsum("bskgd,btkd->bskgt", q, k, preferred_element_type=jnp.float32) * scale
    visible = None
    if masked:
        visible = (q_pos[:, :, None] >= k_pos[:, None, :])[:, :, None, None, :]
        s = jnp.where(visible, s, _NEG)
    return s, visible


def _forward_block(acc, q, k, v, q_pos, k_pos, scale, masked):
    """Fold one key/value block into the running (output, max, sum) of an online softmax."""
    out, m, total = acc
    s, visible = _scores(q, k, q_pos, k_pos, scale, masked)
    m_new = jnp.maximum(m, s.max(-1))
    p = jnp.exp(s - m_new[..., None])
    if masked:
        p = jnp.where(visible, p, 0.0)
    correction = jnp.exp(m - m_new)
    total_new = total * correction + p.sum(-1)
    pv = jnp.einsum("bskgt,btkd->bskgd", p.astype(v.dtype), v,
                    preferred_element_type=jnp.float32)
    return out * correction[..., None] + pv, m_new, total_new


def _backward_block(grads, q, k, v, do, lse, delta, q_pos, k_pos, scale, masked):
    """dq, dk, dv contributions of one block, from the saved log-sum-exp (FlashAttention-2)."""
    dq, dk, dv = grads
    s, visible = _scores(q, k, q_pos, k_pos, scale, masked)
    p = jnp.exp(s - lse[..., None])
    if masked:
        p = jnp.where(visible, p, 0.0)
    dv = dv + jnp.einsum("bskgt,bskgd->btkd", p, do.astype(jnp.float32))
    dp = jnp.einsum("bskgd,btkd->bskgt", do, v, preferred_element_type=jnp.float32)
    ds = p * (dp - delta[..., None]) * scale
    dq = dq + jnp.einsum("bskgt,btkd->bskgd", ds, k.astype(jnp.float32))
    dk = dk + jnp.einsum("bskgt,bskgd->btkd", ds, q.astype(jnp.float32))
    return dq, dk, dv


def _for_each_block(fn: Callable, state, q_chunks, k_chunks, qpos_chunks, kpos_chunks):
    """Apply ``fn(state, qi, ki, masked)`` to every non-skipped (query chunk, key chunk) pair.

    Which pairs are skipped depends on the device (its position in the ring), so the choice is
    made at run time with ``lax.switch``: a skipped block costs nothing.
    """
    for qi in range(len(q_chunks)):
        for ki in range(len(k_chunks)):
            kind = block_kind(qpos_chunks[qi][0], kpos_chunks[ki][0])
            state = lax.switch(kind, [
                lambda st, qi=qi, ki=ki: st,
                lambda st, qi=qi, ki=ki: fn(st, qi, ki, False),
                lambda st, qi=qi, ki=ki: fn(st, qi, ki, True),
            ], state)
    return state


def _split(x, chunks: int, axis: int = 1):
    return jnp.split(x, chunks, axis=axis)


def _rotate(tree, n: int):
    """Send every array to the next device on the ring (device i -> i+1)."""
    ring = [(i, (i + 1) % n) for i in range(n)]
    return jax.tree.map(lambda x: lax.ppermute(x, CONTEXT_AXIS, ring), tree)


def _varying_zeros(shape, manual: tuple[str, ...]):
    """float32 zeros typed as differing per device along the manual axes, as the ring's
    accumulators will once they hold per-device sums."""
    return lax.pcast(jnp.zeros(shape, jnp.float32), manual, to="varying")


def _group(q, kv_heads):
    b, s, h, d = q.shape
    return q.reshape(b, s, kv_heads, h // kv_heads, d)


# --------------------------------------------------------------------------------------------
# Ring attention (runs per device, inside shard_map over `context`)


def _ring_forward(q, k, v, q_pos, k_pos, n: int, chunks: int, manual: tuple[str, ...]):
    """q: [B, s, K, G, D] local; k, v: [B, s, K, D] local. Returns (out [B,s,K,G,D], lse)."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    q_chunks, qpos_chunks = _split(q, chunks), _split(q_pos, chunks)

    accs = [(_varying_zeros(qc.shape, manual), _varying_zeros(qc.shape[:-1], manual) + _NEG,
             _varying_zeros(qc.shape[:-1], manual)) for qc in q_chunks]
    block = (k, v, k_pos)
    for step in range(n):
        # Start sending this block on before computing with it, so the transfer can overlap.
        incoming = _rotate(block, n) if step < n - 1 else None
        k_chunks, v_chunks, kpos_chunks = (_split(x, chunks) for x in block)

        def fold(accs, qi, ki, masked, k_chunks=k_chunks, v_chunks=v_chunks,
                 kpos_chunks=kpos_chunks):
            accs = list(accs)
            accs[qi] = _forward_block(accs[qi], q_chunks[qi], k_chunks[ki], v_chunks[ki],
                                      qpos_chunks[qi], kpos_chunks[ki], scale, masked)
            return tuple(accs)

        accs = _for_each_block(fold, tuple(accs), q_chunks, k_chunks, qpos_chunks, kpos_chunks)
        block = incoming
    outs = [out / total[..., None] for out, _, total in accs]
    lses = [m + jnp.log(total) for _, m, total in accs]
    return jnp.concatenate(outs, axis=1), jnp.concatenate(lses, axis=1)


def _ring_backward(q, k, v, q_pos, k_pos, out, lse, do, n: int, chunks: int,
                   manual: tuple[str, ...]):
    scale = 1.0 / math.sqrt(q.shape[-1])
    delta = jnp.sum(do.astype(jnp.float32) * out, axis=-1)  # rowsum(dO * O)
    q_chunks, qpos_chunks = _split(q, chunks), _split(q_pos, chunks)
    do_chunks, lse_chunks, delta_chunks = _split(do, chunks), _split(lse, chunks), _split(
        delta, chunks)
    dq = [_varying_zeros(qc.shape, manual) for qc in q_chunks]
    # dK/dV travel with their K/V block; after n hops they are back on the block's owner.
    block = (k, v, k_pos, _varying_zeros(k.shape, manual), _varying_zeros(v.shape, manual))
    for _ in range(n):
        kb, vb, kposb, dkb, dvb = block
        k_chunks, v_chunks, kpos_chunks = _split(kb, chunks), _split(vb, chunks), _split(
            kposb, chunks)
        dk_chunks, dv_chunks = _split(dkb, chunks), _split(dvb, chunks)

        def fold(state, qi, ki, masked, k_chunks=k_chunks, v_chunks=v_chunks,
                 kpos_chunks=kpos_chunks):
            dq, dk, dv = (list(x) for x in state)
            dq[qi], dk[ki], dv[ki] = _backward_block(
                (dq[qi], dk[ki], dv[ki]), q_chunks[qi], k_chunks[ki], v_chunks[ki],
                do_chunks[qi], lse_chunks[qi], delta_chunks[qi], qpos_chunks[qi],
                kpos_chunks[ki], scale, masked)
            return tuple(dq), tuple(dk), tuple(dv)

        dq, dk_chunks, dv_chunks = _for_each_block(
            fold, (tuple(dq), tuple(dk_chunks), tuple(dv_chunks)), q_chunks, k_chunks,
            qpos_chunks, kpos_chunks)
        dq = list(dq)
        block = _rotate((kb, vb, kposb, jnp.concatenate(dk_chunks, axis=1),
                         jnp.concatenate(dv_chunks, axis=1)), n)
    _, _, _, dk, dv = block
    return (jnp.concatenate(dq, axis=1).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype))


@partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _ring_attention_local(q, k, v, q_pos, k_pos, n, chunks, manual):
    return _ring_forward(q, k, v, q_pos, k_pos, n, chunks, manual)[0].astype(q.dtype)


def _ring_fwd(q, k, v, q_pos, k_pos, n, chunks, manual):
    out, lse = _ring_forward(q, k, v, q_pos, k_pos, n, chunks, manual)
    # Residuals are this device's blocks only: O(S/N) per device.
    return out.astype(q.dtype), (q, k, v, q_pos, k_pos, out, lse)


def _ring_bwd(n, chunks, manual, residuals, do):
    q, k, v, q_pos, k_pos, out, lse = residuals
    dq, dk, dv = _ring_backward(q, k, v, q_pos, k_pos, out, lse, do, n, chunks, manual)
    return dq, dk, dv, None, None


_ring_attention_local.defvjp(_ring_fwd, _ring_bwd)


# --------------------------------------------------------------------------------------------
# All-gather attention (runs per device, inside shard_map over `context`)


def _allgather_attention_local(q, k, v, q_pos, k_pos):
    """Local queries against the whole sequence's K/V, gathered once; autodiff gives the
    reduce-scatter of dK/dV."""
    k_all = lax.all_gather(k, CONTEXT_AXIS, axis=1, tiled=True)
    v_all = lax.all_gather(v, CONTEXT_AXIS, axis=1, tiled=True)
    kpos_all = lax.all_gather(k_pos, CONTEXT_AXIS, axis=1, tiled=True)
    scale = 1.0 / math.sqrt(q.shape[-1])
    s, visible = _scores(q, k_all, q_pos, kpos_all, scale, masked=True)
    p = jax.nn.softmax(s, axis=-1)
    p = jnp.where(visible, p, 0.0)
    out = jnp.einsum("bskgt,btkd->bskgd", p.astype(v.dtype), v_all,
                     preferred_element_type=jnp.float32)
    return out.astype(q.dtype)


# --------------------------------------------------------------------------------------------
# Entry point used by the model's attention


def context_attention(impl: str, n: int, zigzag: bool, batch_axes: tuple[str, ...] = ()
                      ) -> Callable:
    """``attention(q, k, v, positions)`` for the model: q [B,S,H,D], k/v [B,S,K,D] -> [B,S,H,D],
    with S split over ``context`` and B over ``batch_axes`` (both manual: each device attends
    its own rows, which keeps the compiler from gathering the batch around the K/V collectives),
    and the heads left to the compiler (tensor parallelism)."""
    chunks = 2 if zigzag else 1
    manual = (CONTEXT_AXIS, *batch_axes)

    def local(q, k, v, positions):
        kv_heads = k.shape[2]
        qg = _group(q, kv_heads)
        if impl == "ring":
            out = _ring_attention_local(qg, k, v, positions, positions, n, chunks, manual)
        else:
            out = _allgather_attention_local(qg, k, v, positions, positions)
        return out.reshape(q.shape)

    rows = batch_axes or None
    seq = P(rows, CONTEXT_AXIS)
    seq4 = P(rows, CONTEXT_AXIS, None, None)
    return jax.shard_map(local, in_specs=(seq4, seq4, seq4, seq), out_specs=seq4,
                         axis_names=frozenset(manual))
