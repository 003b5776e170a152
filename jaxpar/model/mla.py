"""Multi-head latent attention (MLA, DeepSeek-V2/V3): keys and values from a small latent.

A decoder caches only the latent ``c`` and the shared rope key; a decode step attends over the
latents unexpanded (:func:`absorbed_attention`). The model's own attention kernels run it, with zero
padding to one head dim. Formulas, costs and layouts: docs/attention-and-loss.md, "Multi-head latent
attention".
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.config import ModelConfig, RopeScalingConfig
from jaxpar.model.annotate import constrain, current_layout
from jaxpar.model.attention import NEG, dense_attention
from jaxpar.model.layers import RMSNorm, _param, rope_frequencies
from jaxpar.model.lora import adapted
from jaxpar.model.mask import Positions, rope_positions
from jaxpar.model.projection import (
    Projection,
    Rebuild,
    project,
    project_all,
    sequence_slice,
    weight,
)
from jaxpar.model.remat import ATTENTION_INPUTS, ATTENTION_OUTPUT, named

# DeepSeek's latent norms use their own epsilon, not the config's rms_norm_eps.
LATENT_NORM_EPS = 1e-6
HEADS = ("batch", "seq", "heads", "head_dim")
# The up-projections as the matmuls read them: the latent whole (stored as q/kv_lora_in: split
# over fsdp under ZeRO-3, as the model dimension of the other weights is).
Q_UP = ("act_q_lora_in", "heads", "head_dim")
KV_UP = ("act_kv_lora_in", "heads", "head_dim")


def rotary(x: jax.Array, positions: jax.Array, inv_freq: jax.Array, interleave: bool,
           ) -> jax.Array:
    """RoPE of x [B, S, N, P] at ``positions`` [B, S] with frequencies ``inv_freq`` [P/2].

    ``interleave``: DeepSeek's pairs (x0, x1), (x2, x3)..., returned as [evens, odds]. That
    permutation is the same for q and k, so dot products match. Else ``rotate_half``.
    """
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    sin, cos = jnp.sin(angles)[:, :, None, :], jnp.cos(angles)[:, :, None, :]
    x32 = x.astype(jnp.float32)
    if interleave:
        x1, x2 = x32[..., 0::2], x32[..., 1::2]
    else:
        x1, x2 = jnp.split(x32, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def interleaved_rotary(x: jax.Array, positions: jax.Array, theta: float,
                       scaling: RopeScalingConfig | None = None) -> jax.Array:
    """:func:`rotary` of interleaved pairs with plain (or llama3-scaled) frequencies."""
    return rotary(x, positions, rope_frequencies(x.shape[-1], theta, scaling), True)


def _yarn_mscale(factor: float, m: float) -> float:
    return 0.1 * m * math.log(factor) + 1.0 if factor > 1 else 1.0


def yarn_frequencies(dim: int, theta: float, r: RopeScalingConfig) -> tuple[jax.Array, float]:
    """YaRN's float32 [dim/2] frequencies, and the factor that scales rotated q and k.

    As DeepSeek-V3 and transformers compute it (docs/configuration.md, "Model": ``rope_scaling``).
    """
    half = dim // 2
    inv_freq = 1.0 / theta ** (jnp.arange(half, dtype=jnp.float32) / half)

    def turns_dim(turns: float) -> float:  # the dim whose wavelength fits `turns` times
        return dim * math.log(r.original_max_position_embeddings / (turns * 2 * math.pi)) / (
            2 * math.log(theta))

    low = max(math.floor(turns_dim(r.beta_fast)), 0)
    high = min(math.ceil(turns_dim(r.beta_slow)), dim - 1)
    ramp = jnp.clip((jnp.arange(half, dtype=jnp.float32) - low) / max(high - low, 0.001), 0, 1)
    inv_freq = inv_freq / r.factor * ramp + inv_freq * (1 - ramp)
    if r.mscale and r.mscale_all_dim:
        factor = _yarn_mscale(r.factor, r.mscale) / _yarn_mscale(r.factor, r.mscale_all_dim)
    else:
        factor = _yarn_mscale(r.factor, 1.0)
    return inv_freq, factor


def softmax_temperature(r: RopeScalingConfig) -> float:
    """q's factor on top of 1/sqrt(N + P): YaRN's mscale(factor, mscale_all_dim)^2, else 1."""
    if r.type != "yarn" or not r.mscale_all_dim:
        return 1.0
    return _yarn_mscale(r.factor, r.mscale_all_dim) ** 2


class MLA(nnx.Module):
    """Multi-head latent attention: a drop-in for :class:`~jaxpar.model.layers.Attention`."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        mla, e, h = cfg.mla, cfg.d_model, cfg.n_heads
        std = cfg.init_std
        if mla.q_lora_rank:
            self.wq_a = _param(rngs, (e, mla.q_lora_rank), ("embed", "q_lora"), std)
            self.q_norm = RMSNorm(mla.q_lora_rank, LATENT_NORM_EPS, axis="q_lora")
            self.wq_b = _param(rngs, (mla.q_lora_rank, h, mla.qk_head_dim),
                               ("q_lora_in", "heads", "head_dim"), std)
        else:
            self.wq = _param(rngs, (e, h, mla.qk_head_dim), ("embed", "heads", "head_dim"), std)
        self.wkv_a = _param(rngs, (e, mla.kv_lora_rank + mla.qk_rope_head_dim),
                            ("embed", "kv_lora"), std)
        self.kv_norm = RMSNorm(mla.kv_lora_rank, LATENT_NORM_EPS, axis="kv_lora")
        self.wkv_b = _param(rngs, (mla.kv_lora_rank, h, mla.qk_nope_head_dim + mla.v_head_dim),
                            ("kv_lora_in", "heads", "head_dim"), std)
        out_std = std / (2 * cfg.n_layers) ** 0.5
        self.wo = _param(rngs, (h, mla.v_head_dim, e), ("heads", "head_dim", "embed"), out_std)
        self.config = mla
        self.rope_theta = cfg.rope_theta
        self.rope_scaling = cfg.rope_scaling

    def __call__(self, x: jax.Array, positions: Positions, x_from: Rebuild | None = None,
                 ) -> jax.Array:
        q, latent, k_rope = self.project_in(x, positions, x_from)
        cached = current_layout().latent_cache
        if cached is not None:  # decoding: the cache keeps the latent, not k and v
            return self.project_out(cached(self, q, latent, k_rope, positions))
        k, v = self.expand(latent, k_rope)
        attend = current_layout().attention or dense_attention
        q, k, v = named(ATTENTION_INPUTS, q, k, v)
        out, = named(ATTENTION_OUTPUT, padded_attention(attend, q, k, v, positions))
        return self.project_out(out)

    def project_in(self, x: jax.Array, positions: Positions, x_from: Rebuild | None,
                   ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x [B, S, E] -> (q [B, S, H, N + P] rotated, normed latent [B, S, R], rope key [B, S, 1,
        P]).

        What attention reads, and what a decoder caches.
        """
        mla = self.config
        x_from = x_from or sequence_slice(x)
        kv_proj = Projection("bse,er->bsr", (self.wkv_a,), ("act_embed", "kv_lora"))
        if hasattr(self, "wq_a"):
            q_proj = Projection("bse,er->bsr", (self.wq_a,), ("act_embed", "q_lora"))
            q_latent, kv = project_all(x, (q_proj, kv_proj), x_from=x_from)
            q_latent = adapted(self, "q_a", x, q_latent)
            q_normed = self.q_norm(constrain(q_latent, ("batch", "seq", "q_lora")))
            q = adapted(self, "q_b", q_normed, project("bsr,rhd->bshd", q_normed, self.wq_b,
                                                         Q_UP))
        else:
            q_proj = Projection("bse,ehd->bshd", (self.wq,), ("act_embed", "heads", "head_dim"))
            q, kv = project_all(x, (q_proj, kv_proj), x_from=x_from)
            q = adapted(self, "q", x, q)
        kv = adapted(self, "kv_a", x, kv)
        kv = constrain(kv, ("batch", "seq", "kv_lora"))
        latent = self.kv_norm(kv[..., :mla.kv_lora_rank])
        k_rope = kv[..., None, mla.kv_lora_rank:]
        q = constrain(q, HEADS)
        rope = rope_positions(positions)
        q_nope, q_rope = q[..., :mla.qk_nope_head_dim], q[..., mla.qk_nope_head_dim:]
        q = jnp.concatenate([q_nope, self.rotate(q_rope, rope)], axis=-1)
        temperature = softmax_temperature(self.rope_scaling)
        if temperature != 1.0:
            q = q * jnp.asarray(temperature, q.dtype)
        return q, latent, self.rotate(k_rope, rope)

    def rotate(self, x: jax.Array, rope: jax.Array) -> jax.Array:
        """RoPE of the rope dims x [B, S, N, P] (plain, llama3 or yarn frequencies)."""
        if self.rope_scaling.type == "yarn":
            inv_freq, factor = yarn_frequencies(x.shape[-1], self.rope_theta, self.rope_scaling)
            out = rotary(x, rope, inv_freq, self.config.rope_interleave)
            return out * jnp.asarray(factor, out.dtype) if factor != 1.0 else out
        inv_freq = rope_frequencies(x.shape[-1], self.rope_theta, self.rope_scaling)
        return rotary(x, rope, inv_freq, self.config.rope_interleave)

    def expand(self, latent: jax.Array, k_rope: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The latent [B, T, R] and rope key [B, T, 1, P] -> k [B, T, H, N + P], v [B, T, H, V]."""
        n = self.config.qk_nope_head_dim
        kv = constrain(adapted(self, "kv_b", latent,
                               project("bsr,rhd->bshd", latent, self.wkv_b, KV_UP)), HEADS)
        k_nope, v = kv[..., :n], kv[..., n:]
        k_rope = jnp.broadcast_to(k_rope, (*k_nope.shape[:-1], k_rope.shape[-1]))
        k = constrain(jnp.concatenate([k_nope, k_rope.astype(k_nope.dtype)], axis=-1), HEADS)
        return k, constrain(v, HEADS)

    def project_out(self, out: jax.Array) -> jax.Array:
        out = constrain(out, HEADS)
        return adapted(self, "o", out, project("bshd,hde->bse", out, self.wo,
                                               ("heads", "head_dim", "act_embed")))


def padded_attention(attend, q: jax.Array, k: jax.Array, v: jax.Array, positions) -> jax.Array:
    """``attend(q, k, v, positions)`` for v of another head dim than q and k; [B, S, H, V].

    The narrower side is zero-padded; q is rescaled to keep the scale 1/sqrt(q's width).
    """
    dqk, dv = q.shape[-1], v.shape[-1]
    if dv < dqk:
        v = _pad_last(v, dqk)
    elif dv > dqk:
        q = _pad_last(q * jnp.asarray((dv / dqk) ** 0.5, q.dtype), dv)
        k = _pad_last(k, dv)
    return attend(q, k, v, positions)[..., :dv]


def _pad_last(x: jax.Array, width: int) -> jax.Array:
    return constrain(jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - x.shape[-1])]), HEADS)


def absorbed_attention(mla: MLA, q: jax.Array, positions: jax.Array, latent: jax.Array,
                       k_rope: jax.Array) -> jax.Array:
    """Causal attention of q [B, S, H, N + P] over latents [B, L, R] and rope keys [B, L, P].

    DeepSeek-V2's absorbed form: no expansion. A query at p sees slots 0..p. Returns [B, S, H, V];
    scores and softmax in float32.
    """
    n = mla.config.qk_nope_head_dim
    w = weight(mla.wkv_b, KV_UP, q.dtype)  # [R, H, N + V]
    q_latent = jnp.einsum("bshn,rhn->bshr", q[..., :n], w[..., :n])
    latent, k_rope = latent.astype(q.dtype), k_rope.astype(q.dtype)
    scores = (jnp.einsum("bshr,btr->bhst", q_latent, latent, preferred_element_type=jnp.float32)
              + jnp.einsum("bshp,btp->bhst", q[..., n:], k_rope,
                           preferred_element_type=jnp.float32)) / jnp.sqrt(
        jnp.float32(q.shape[-1]))
    slots = jnp.arange(latent.shape[1], dtype=positions.dtype)
    visible = slots[None, None, :] <= positions[:, :, None]  # [B, S, L]
    scores = jnp.where(visible[:, None], scores, NEG)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    out_latent = jnp.einsum("bhst,btr->bshr", probs, latent)
    return constrain(jnp.einsum("bshr,rhv->bshv", out_latent, w[..., n:]), HEADS)
