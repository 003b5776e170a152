"""A key/value cache for autoregressive decoding, and attention over it.

Keys and values go to ``k, v: [layers, B, L, K, D]`` (slot t: position t), laid out by
:data:`CACHE_AXES`; MLA caches latents (:data:`LATENT_AXES`). :mod:`jaxpar.inference.generation`
sets the layout's attention to :meth:`UnitCache.attend`. Details: docs/generation.md, "How it
works".
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxpar.config import ModelConfig
from jaxpar.model.annotate import Attention, constrain
from jaxpar.model.attention import NEG, dense_attention, group, soft_cap
from jaxpar.model.mask import Positions, as_mask
from jaxpar.model.mla import absorbed_attention, padded_attention

CACHE_AXES = ("layers", "batch", None, "kv_heads", "head_dim")  # k and v [layers, B, L, K, D]
UNIT_AXES = CACHE_AXES[1:]  # one layer's slice [B, L, K, D]
LATENT_AXES = ("layers", "batch", None, None, "kv_lora")  # MLA's latent and rope key


class KVCache(NamedTuple):
    k: jax.Array  # [layers, B, L, K, D]
    v: jax.Array


def empty_cache(layers: int, batch: int, max_len: int, kv_heads: int, head_dim: int,
                dtype=jnp.float32) -> KVCache:
    """Zeros of the cache's shape, laid out by :data:`CACHE_AXES`."""
    zeros = jnp.zeros((layers, batch, max_len, kv_heads, head_dim), dtype)
    return KVCache(constrain(zeros, CACHE_AXES), constrain(zeros, CACHE_AXES))


def cache_axes(m: ModelConfig) -> tuple:
    """The logical layout of ``m``'s cache: :data:`CACHE_AXES`, for MLA :data:`LATENT_AXES`."""
    return LATENT_AXES if m.mla.enabled else CACHE_AXES


def model_cache(m: ModelConfig, batch: int, max_len: int, dtype=jnp.float32) -> KVCache:
    """The empty cache of ``m``: keys and values, for MLA latents and rope keys."""
    if not m.mla.enabled:
        return empty_cache(m.n_layers, batch, max_len, m.n_kv_heads, m.resolved_head_dim, dtype)
    def zeros(width: int) -> jax.Array:
        return constrain(jnp.zeros((m.n_layers, batch, max_len, 1, width), dtype), LATENT_AXES)
    return KVCache(zeros(m.mla.kv_lora_rank), zeros(m.mla.qk_rope_head_dim))


def cache_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype=jnp.float32) -> int:
    """Bytes one position of one sequence takes in the cache."""
    return 2 * layers * kv_heads * head_dim * jnp.dtype(dtype).itemsize


def write(cache: jax.Array, new: jax.Array, positions: jax.Array, axes: tuple = UNIT_AXES
          ) -> jax.Array:
    """One layer's cache [B, L, K, D] with ``new`` [B, S, K, D] written at ``positions`` [B, S].

    S > 1 (a prefill) needs positions ``0..S-1`` in every row; S = 1 writes each row at its own.
    """
    new = new.astype(cache.dtype)
    if new.shape[1] > 1:
        return constrain(lax.dynamic_update_slice(cache, new, (0, 0, 0, 0)), axes)
    slots = jnp.arange(cache.shape[1], dtype=positions.dtype)
    here = (slots[None, :] == positions)[:, :, None, None]  # [B, L, 1, 1]
    return constrain(jnp.where(here, new, cache), axes)


def cached_attention(q: jax.Array, positions: Positions, k_cache: jax.Array,
                     v_cache: jax.Array) -> jax.Array:
    """Causal GQA of q [B, S, H, D] at ``positions`` [B, S] over the cache [B, L, K, D].

    A query at p sees slots 0..p (and within its window). Scores and softmax in float32.
    """
    b, s, h, d = q.shape
    mask = as_mask(positions)
    qg = group(q, k_cache.shape[2])  # [B, S, K, G, D]
    scores = jnp.einsum("bskgd,btkd->bkgst", qg, k_cache.astype(q.dtype),
                        preferred_element_type=jnp.float32) / math.sqrt(d)
    scores = soft_cap(scores, mask.softcap)
    slots = jnp.arange(k_cache.shape[1], dtype=mask.order.dtype)
    ago = mask.order[:, :, None] - slots[None, None, :]  # [B, S, L]
    visible = ago >= 0
    if mask.window is not None:
        visible = visible & (ago < mask.window[:, :, None])
    scores = jnp.where(visible[:, None, None], scores, NEG)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    out = jnp.einsum("bkgst,btkd->bskgd", probs, v_cache.astype(q.dtype))
    return out.reshape(b, s, h, d)


class UnitCache:
    """The cache of one scanned unit during one trace: ``k``/``v`` [blocks, B, L, K, D].

    :meth:`attend` is the hook: the unit's i-th attention reads and writes block i. :meth:`updated`
    returns the new slices.
    """

    def __init__(self, k: jax.Array, v: jax.Array, prefill: Attention = dense_attention):
        self.k, self.v, self.prefill = k, v, prefill
        self.new_k: list[jax.Array] = []
        self.new_v: list[jax.Array] = []

    def attend(self, q: jax.Array, k: jax.Array, v: jax.Array, positions: Positions
               ) -> jax.Array:
        i = self._next()
        order = as_mask(positions).order
        k_cache = write(constrain(self.k[i], UNIT_AXES), k, order)
        v_cache = write(constrain(self.v[i], UNIT_AXES), v, order)
        self.new_k.append(k_cache)
        self.new_v.append(v_cache)
        if q.shape[1] > 1:
            return self.prefill(q, k, v, positions)
        return cached_attention(q, positions, k_cache, v_cache)

    def attend_latent(self, mla: Any, q: jax.Array, latent: jax.Array, k_rope: jax.Array,
                      positions: Positions) -> jax.Array:
        """The layout's :attr:`~jaxpar.model.annotate.Layout.latent_cache`: writes, attends;
        [B, S, H, V].

        Latent [B, S, R] and rope key [B, S, 1, P] go to block i of ``k`` and ``v``.
        """
        i = self._next()
        axes, order = LATENT_AXES[1:], as_mask(positions).order
        c_cache = write(constrain(self.k[i], axes), latent[:, :, None, :], order, axes)
        r_cache = write(constrain(self.v[i], axes), k_rope, order, axes)
        self.new_k.append(c_cache)
        self.new_v.append(r_cache)
        if q.shape[1] > 1:
            k, v = mla.expand(latent, k_rope)
            return padded_attention(self.prefill, q, k, v, positions)
        return absorbed_attention(mla, q, order, c_cache[:, :, 0], r_cache[:, :, 0])

    def _next(self) -> int:
        i = len(self.new_k)
        if i >= self.k.shape[0]:
            raise ValueError(f"the unit called attention {i + 1} times for a cache of "
                             f"{self.k.shape[0]} layers")
        return i

    def updated(self) -> tuple[jax.Array, jax.Array]:
        if len(self.new_k) != self.k.shape[0]:
            raise ValueError(f"the unit called attention {len(self.new_k)} times for a cache "
                             f"of {self.k.shape[0]} layers")
        return jnp.stack(self.new_k), jnp.stack(self.new_v)
