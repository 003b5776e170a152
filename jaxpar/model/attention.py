"""Causal grouped-query attention in plain JAX: dense, and blockwise (flash-style).

q ``[B, S, H, D]``, k and v ``[B, S, K, D]``, ``H = K x G``: query head h reads kv head ``h // G``.
Ring attention reuses the block kernels (:func:`fold_keys`, :func:`unfold_keys`); fused kernels:
:mod:`jaxpar.model.fused`. The formulas: docs/attention-and-loss.md, "Blockwise attention".
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from jaxpar.model.mask import (  # noqa: F401 (SKIP, FULL, MASKED, block_kind: re-exported)
    FULL,
    MASKED,
    SKIP,
    AttentionMask,
    Positions,
    as_mask,
    block_kind,
    visible,
)

NEG = -1e30  # a finite "minus infinity": keeps exp(m_old - m_new) free of inf - inf


def group(q: jax.Array, kv_heads: int) -> jax.Array:
    """``[B, S, H, D]`` -> ``[B, S, K, G, D]``."""
    b, s, h, d = q.shape
    return q.reshape(b, s, kv_heads, h // kv_heads, d)


# --------------------------------------------------------------------------------------------
# Dense


def dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, positions: Positions | None = None
                    ) -> jax.Array:
    """Causal GQA over the whole square, masked by ``positions`` (:mod:`jaxpar.model.mask`)."""
    b, s, h, d = q.shape
    qg = group(q, k.shape[2])
    scores = jnp.einsum("bskgd,btkd->bkgst", qg, k, preferred_element_type=jnp.float32)
    scores = scores / jnp.sqrt(jnp.float32(d))
    if positions is None:
        causal = jnp.tril(jnp.ones((s, s), dtype=bool))
    else:
        mask = as_mask(positions)
        causal = visible(mask, mask)[:, None, None]
        scores = soft_cap(scores, mask.softcap)
    # An additive bias, not jnp.where(causal, scores, NEG): where's derivative keeps the mask
    # and a broadcast of zeros as residuals ([B, K, G, S, S] each), which a pipeline would
    # stash per microbatch; an addition keeps nothing.
    scores = scores + jnp.where(causal, 0.0, NEG)
    return weighted_values(scores, v).reshape(b, s, h, d)


def soft_cap(scores: jax.Array, cap: float) -> jax.Array:
    """``cap tanh(scores / cap)`` (Gemma 2's soft-capping); ``cap=0``: off."""
    return scores if not cap else cap * jnp.tanh(scores / cap)


@jax.custom_vjp
def weighted_values(scores: jax.Array, v: jax.Array) -> jax.Array:
    """``softmax(scores) @ v``: scores ``[B, K, G, S, T]``, v ``[B, T, K, D]`` -> ``[B, S, K, G,
    D]``.

    Probabilities in ``v``'s dtype; the backward pass keeps them in float32 (docs/memory.md, "Remat
    policies").
    """
    return _weighted_values_fwd(scores, v)[0]


def _weighted_values_fwd(scores, v):
    probs = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum("bkgst,btkd->bskgd", probs.astype(v.dtype), v), (probs, v)


def _weighted_values_bwd(residuals, d_out):
    probs, v = residuals
    d_v = jnp.einsum("bkgst,bskgd->btkd", probs.astype(v.dtype), d_out)
    d_probs = jnp.einsum("bskgd,btkd->bkgst", d_out, v, preferred_element_type=jnp.float32)
    d_scores = probs * (d_probs - jnp.sum(d_probs * probs, axis=-1, keepdims=True))
    return d_scores.astype(probs.dtype), d_v


weighted_values.defvjp(_weighted_values_fwd, _weighted_values_bwd)


# --------------------------------------------------------------------------------------------
# One block, forward and backward (grouped layout)


def _scores(q, k, q_pos: AttentionMask, k_pos: AttentionMask, masked: bool):
    """(scores, visibility or None, d capped / d raw scores or None) of one block."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    s = jnp.einsum("bskgd,btkd->bskgt", q, k, preferred_element_type=jnp.float32) * scale
    cap, slope = q_pos.softcap, None
    if cap:
        s = soft_cap(s, cap)
        # Taken before masking: NEG squared would overflow and 0 * inf poison the gradient.
        slope = 1.0 - jnp.square(s / cap)
    seen = None
    if masked:
        seen = visible(q_pos, k_pos)[:, :, None, None, :]
        s = jnp.where(seen, s, NEG)
    return s, seen, slope


def forward_block(acc: tuple, q, k, v, q_pos, k_pos, masked: bool) -> tuple:
    """Fold one key/value block into the running (output, max, sum) of an online softmax."""
    out, m, total = acc
    s, visible, _ = _scores(q, k, q_pos, k_pos, masked)
    m_new = jnp.maximum(m, s.max(-1))
    p = jnp.exp(s - m_new[..., None])
    if masked:  # a row with no visible key yet must add nothing (exp(NEG - NEG) = 1)
        p = jnp.where(visible, p, 0.0)
    correction = jnp.exp(m - m_new)
    total_new = total * correction + p.sum(-1)
    pv = jnp.einsum("bskgt,btkd->bskgd", p.astype(v.dtype), v,
                    preferred_element_type=jnp.float32)
    return out * correction[..., None] + pv, m_new, total_new


def backward_block(grads: tuple, q, k, v, do, lse, delta, q_pos, k_pos, masked: bool) -> tuple:
    """(dq, dk, dv) plus one block's contributions, from the saved log-sum-exp."""
    dq, dk, dv = grads
    scale = 1.0 / math.sqrt(q.shape[-1])
    s, visible, slope = _scores(q, k, q_pos, k_pos, masked)
    p = jnp.exp(s - lse[..., None])
    if masked:
        p = jnp.where(visible, p, 0.0)
    dv = dv + jnp.einsum("bskgt,bskgd->btkd", p, do.astype(jnp.float32))
    dp = jnp.einsum("bskgd,btkd->bskgt", do, v, preferred_element_type=jnp.float32)
    ds = p * (dp - delta[..., None]) * scale
    if slope is not None:  # the chain rule through cap tanh(s / cap)
        ds = ds * slope
    dq = dq + jnp.einsum("bskgt,btkd->bskgd", ds, k.astype(jnp.float32))
    dk = dk + jnp.einsum("bskgt,bskgd->btkd", ds, q.astype(jnp.float32))
    return dq, dk, dv


def _by_kind(fn: Callable, state, q_pos, k_pos, count: jax.Array | None = None):
    """``fn(state, masked)`` for a block that is not skipped; a skipped block costs nothing.

    Chosen at run time; no collective in the branches. With ``count``: ``(state, blocks computed)``.
    """
    if count is None:
        return lax.switch(block_kind(q_pos, k_pos), [
            lambda st: st, lambda st: fn(st, False), lambda st: fn(st, True)], state)
    return lax.switch(block_kind(q_pos, k_pos), [
        lambda st: st, lambda st: (fn(st[0], False), st[1] + 1),
        lambda st: (fn(st[0], True), st[1] + 1)], (state, count))


# --------------------------------------------------------------------------------------------
# Many blocks: queries and keys tiled


def _tiles(x: jax.Array, size: int) -> jax.Array:
    """``[B, S, ...]`` -> ``[S/size, B, size, ...]``."""
    b, s = x.shape[:2]
    return jnp.moveaxis(x.reshape(b, s // size, size, *x.shape[2:]), 1, 0)


def _untile(x: jax.Array) -> jax.Array:
    n, b, size = x.shape[:3]
    return jnp.moveaxis(x, 0, 1).reshape(b, n * size, *x.shape[3:])


def zeros_like(x: jax.Array, shape: tuple[int, ...] | None = None) -> jax.Array:
    """float32 zeros (``shape``, default ``x``'s) varying over ``x``'s manual mesh axes."""
    return lax.full_like(x, 0, jnp.float32, shape)  # full_like keeps x's manual axis types


def empty_statistics(q: jax.Array) -> tuple:
    """(output, max, sum) of an online softmax that has seen no key, for grouped ``q``."""
    zeros = zeros_like(q, q.shape[:-1])
    return zeros_like(q), zeros + NEG, zeros


def _tiled(tree, size: int):
    return jax.tree.map(lambda a: _tiles(a, size), tree)


def fold_keys(acc: tuple, q, k, v, q_pos: AttentionMask, k_pos: AttentionMask, block: int,
              count: bool = False) -> tuple:
    """``acc`` (:func:`empty_statistics`) after every key of ``k``/``v``, ``block`` at a time.

    ``count``: ``(acc, blocks)``, the int32 number of block pairs computed.
    """
    bq, bk = min(block, q.shape[1]), min(block, k.shape[1])
    keys = (_tiles(k, bk), _tiles(v, bk), _tiled(k_pos, bk))
    start = jnp.zeros((), jnp.int32) if count else None

    def one_query_block(args):
        acc, qb, qpos = args

        def one_key_block(state, key):
            kb, vb, kpos = key

            def compute(a, masked):
                return forward_block(a, qb, kb, vb, qpos, kpos, masked)

            if start is None:
                return _by_kind(compute, state, qpos, kpos), None
            return _by_kind(compute, state[0], qpos, kpos, state[1]), None

        return lax.scan(one_key_block, acc if start is None else (acc, start), keys)[0]

    out = lax.map(one_query_block, (_tiled(acc, bq), _tiles(q, bq), _tiled(q_pos, bq)))
    if start is None:
        return jax.tree.map(_untile, out)
    return jax.tree.map(_untile, out[0]), jnp.sum(out[1])


def unfold_keys(grads: tuple, q, k, v, do, lse, delta, q_pos, k_pos, block: int) -> tuple:
    """(dq, dk, dv) float32 plus the gradients of grouped ``q`` attending to ``k``/``v``.

    From the forward's ``lse`` and ``delta = rowsum(do * out)``.
    """
    bq, bk = min(block, q.shape[1]), min(block, k.shape[1])
    dq, dk, dv = grads
    queries = (*(_tiles(a, bq) for a in (q, do, lse, delta)), _tiled(q_pos, bq))

    def one_key_block(dq_tiles, key):
        kb, vb, kpos, dkb, dvb = key

        def one_query_block(kv_grads, query):
            (qb, dob, lseb, deltab, qpos), dqb = query[:5], query[5]

            def block_grads(state, masked):
                return backward_block(state, qb, kb, vb, dob, lseb, deltab, qpos, kpos, masked)

            dqb, dkb, dvb = _by_kind(block_grads, (dqb, *kv_grads), qpos, kpos)
            return (dkb, dvb), dqb

        (dkb, dvb), dq_tiles = lax.scan(one_query_block, (dkb, dvb), (*queries, dq_tiles))
        return dq_tiles, (dkb, dvb)

    dq_tiles, (dk, dv) = lax.scan(one_key_block, _tiles(dq, bq),
                                  (_tiles(k, bk), _tiles(v, bk), _tiled(k_pos, bk),
                                   _tiles(dk, bk), _tiles(dv, bk)))
    return _untile(dq_tiles), _untile(dk), _untile(dv)


def finish(acc: tuple) -> tuple[jax.Array, jax.Array]:
    """(normalised output, log-sum-exp) from an online softmax's statistics."""
    out, m, total = acc
    return out / total[..., None], m + jnp.log(total)


# --------------------------------------------------------------------------------------------
# Blockwise attention on one device


def _blockwise_forward(q, k, v, q_pos, k_pos, block):
    return finish(fold_keys(empty_statistics(q), q, k, v, q_pos, k_pos, block))


@partial(jax.custom_vjp, nondiff_argnums=(5,))
def blockwise(q, k, v, q_pos, k_pos, block: int) -> jax.Array:
    """Grouped ``q`` [B, Sq, K, G, D] attending to ``k``/``v`` [B, Sk, K, D] in blocks.

    ``q_pos``/``k_pos``: :class:`AttentionMask`. Keeps O(S) for the backward pass.
    """
    return _blockwise_forward(q, k, v, q_pos, k_pos, block)[0].astype(q.dtype)


def whole(fn: Callable, *static: int) -> Callable:
    """``fn`` under ``jax.checkpoint``: a custom VJP's forward in a scan, kept whole.

    Why: docs/jax-notes.md, "Residuals as data".
    """
    return jax.checkpoint(fn, static_argnums=static)


def _blockwise_fwd(q, k, v, q_pos, k_pos, block):
    out, lse = whole(_blockwise_forward, 5)(q, k, v, q_pos, k_pos, block)
    return out.astype(q.dtype), (q, k, v, q_pos, k_pos, out, lse)


def _blockwise_bwd(block, residuals, do):
    q, k, v, q_pos, k_pos, out, lse = residuals
    delta = jnp.sum(do.astype(jnp.float32) * out, axis=-1)
    zeros = tuple(zeros_like(a) for a in (q, k, v))
    dq, dk, dv = unfold_keys(zeros, q, k, v, do, lse, delta, q_pos, k_pos, block)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None


blockwise.defvjp(_blockwise_fwd, _blockwise_bwd)


def blockwise_attention(block: int) -> Callable:
    """``attention(q, k, v, positions)``, ``block`` queries x ``block`` keys at a time.

    ``block`` must divide the sequence, or exceed it.
    """
    def attend(q, k, v, positions=None):
        b, s = q.shape[:2]
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
        mask = kernel_mask(positions)
        out = blockwise(group(q, k.shape[2]), k, v, mask, mask, block)
        return out.reshape(q.shape)
    return attend


def kernel_mask(positions: Positions) -> AttentionMask:
    """What a kernel reads of ``positions``: all but the rope positions."""
    mask = as_mask(positions)
    return AttentionMask(mask.order, mask.segments, window=mask.window, softcap=mask.softcap)
