"""Building blocks of a Llama-style decoder: RMSNorm, rotary embeddings, GQA attention, SwiGLU.

Every parameter is created in float32 with logical axis names (:mod:`jaxpar.parallel.rules`).
Weights are cast to the compute dtype; norms, softmax and the loss stay float32. The norm and the
activation have custom VJPs that keep less than autodiff would (docs/memory.md, "Remat policies").
The block itself: :mod:`jaxpar.model.transformer`; the matmuls: :mod:`jaxpar.model.projection`.

Shapes: B batch, S sequence, E d_model, H query heads, K kv heads, G = H/K, D head_dim, F d_ff.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.config import ModelConfig, RopeScalingConfig
from jaxpar.model.annotate import (
    constrain,
    current_layout,
    is_split,
    relayout,
)
from jaxpar.model.attention import dense_attention
from jaxpar.model.lora import adapted
from jaxpar.model.mask import UNLIMITED, Positions, rope_positions, with_window
from jaxpar.model.projection import (
    MATMUL_INPUT,
    RESIDUAL,
    USED_NAMES,
    Projection,
    Rebuild,
    add_bias,
    project,
    project_all,
    sequence_slice,
)
from jaxpar.model.remat import ATTENTION_INPUTS, ATTENTION_OUTPUT, named

Q_WEIGHT = ("act_embed", "heads", "head_dim")
KV_WEIGHT = ("act_embed", "kv_heads", "head_dim")
Q_BIAS = ("heads", "head_dim")
KV_BIAS = ("kv_heads", "head_dim")


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], names: tuple[str, ...], std: float,
           ) -> nnx.Param:
    value = std * jax.random.truncated_normal(rngs.params(), -2.0, 2.0, shape, jnp.float32)
    return nnx.Param(value, out_sharding=names)


def stored_weight(param: nnx.Param, names: tuple[str, ...]) -> jax.Array:
    """A weight as stored (dtype and layout ``names``): the experts' weights.

    The experts function casts them and the expert-parallel hook gathers them.
    """
    if current_layout().weights_prepared:
        return param[...]
    return constrain(param[...], names)


# Parameters a layer uses in float32 whatever the compute dtype: norm scales and the router.
FULL_PRECISION = frozenset({"scale", "router"})


def prepare_weight(value: jax.Array, name: str, stored: tuple, dtype) -> jax.Array:
    """``value`` cast to the layer's compute dtype and laid out as used (FSDP's gather).

    What :func:`weight`, :func:`stored_weight` or a norm hands its layer, computed once.
    """
    dtype = jnp.float32 if name in FULL_PRECISION else dtype
    if "experts" in stored:
        return constrain(value.astype(dtype), stored)
    return constrain(value.astype(dtype), tuple(USED_NAMES.get(n, n) for n in stored))


def prepared_weight_grad(grad: jax.Array, stored: tuple) -> jax.Array:
    """The transpose of :func:`prepare_weight`: a float32 gradient in the stored layout."""
    return constrain(grad.astype(jnp.float32), stored)


class RMSNorm(nnx.Module):
    """Root-mean-square norm over the last axis with a learned scale.

    ``axis``: ``embed`` on the residual stream, ``head_dim`` for ``model.qk_norm``'s q/k norms.
    """

    def __init__(self, dim: int, eps: float, axis: str = "embed"):
        self.scale = nnx.Param(jnp.ones((dim,), jnp.float32), out_sharding=(axis,))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.scale[...], self.eps)

    def for_matmul(self, x: jax.Array) -> tuple[jax.Array, Rebuild]:
        """The norm of ``x`` laid out for the column-parallel matmuls (:data:`MATMUL_INPUT`).

        Also how they rebuild it rather than keep it (:func:`project`'s ``x_from``).
        """
        rebuild = Rebuild(_NormedInput(self.eps), (x, self.scale[...]))
        return rebuild.fn(*rebuild.kept), rebuild


class _NormedInput(NamedTuple):
    """:meth:`RMSNorm.for_matmul`'s output rebuilt from the norm's input and scale."""

    eps: float

    def __call__(self, x: jax.Array, scale: jax.Array) -> jax.Array:
        return relayout(rms_norm(x, scale, self.eps), RESIDUAL, MATMUL_INPUT)


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """``x / rms(x) * scale`` over the last axis, in float32, returned in ``x``'s dtype.

    The backward pass keeps only ``x`` and the reciprocal rms.
    """
    return _rms_norm_fwd(x, scale, eps)[0]


def _rms_norm_fwd(x, scale, eps):
    x32 = x.astype(jnp.float32)
    rstd = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * rstd * scale).astype(x.dtype), (x, rstd, scale)


def _rms_norm_bwd(eps, residuals, dy):
    x, rstd, scale = residuals
    normed = x.astype(jnp.float32) * rstd
    dy32 = dy.astype(jnp.float32)
    d_scale = jnp.sum(dy32 * normed, axis=tuple(range(x.ndim - 1)))
    d_normed = dy32 * scale
    dx = rstd * (d_normed - normed * jnp.mean(d_normed * normed, axis=-1, keepdims=True))
    return dx.astype(x.dtype), d_scale.astype(scale.dtype)


rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


@jax.custom_vjp
def gated_silu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """``silu(gate) * up``, SwiGLU; the backward pass keeps only ``gate`` and ``up``."""
    return jax.nn.silu(gate) * up


def _gated_silu_fwd(gate, up):
    return gated_silu(gate, up), (gate, up)


def _gated_silu_bwd(residuals, d_hidden):
    gate, up = residuals
    sig = jax.nn.sigmoid(gate)
    d_up = d_hidden * gate * sig
    d_gate = d_hidden * up * sig * (1 + gate * (1 - sig))
    return d_gate, d_up


gated_silu.defvjp(_gated_silu_fwd, _gated_silu_bwd)

_GELU_C = (2 / jnp.pi) ** 0.5  # tanh approximation: 0.5 x (1 + tanh(c (x + 0.044715 x^3)))


@jax.custom_vjp
def gated_gelu_tanh(gate: jax.Array, up: jax.Array) -> jax.Array:
    """``gelu_tanh(gate) * up``, GeGLU (Gemma); the backward pass keeps only ``gate`` and ``up``."""
    return jax.nn.gelu(gate, approximate=True) * up


def _gated_gelu_tanh_fwd(gate, up):
    return gated_gelu_tanh(gate, up), (gate, up)


def _gated_gelu_tanh_bwd(residuals, d_hidden):
    gate, up = residuals
    t = jnp.tanh(_GELU_C * (gate + 0.044715 * gate ** 3))
    d_up = d_hidden * 0.5 * gate * (1 + t)
    d_act = 0.5 * (1 + t) + 0.5 * gate * (1 - t * t) * _GELU_C * (1 + 3 * 0.044715 * gate * gate)
    return d_hidden * up * d_act, d_up


gated_gelu_tanh.defvjp(_gated_gelu_tanh_fwd, _gated_gelu_tanh_bwd)
GATED_ACTIVATIONS = {"silu": gated_silu, "gelu_tanh": gated_gelu_tanh}


def rope_frequencies(head_dim: int, theta: float,
                     scaling: RopeScalingConfig | None = None) -> jax.Array:
    """float32 [head_dim/2] frequencies theta^(-i/half), rescaled by ``scaling``.

    ``llama3`` (Llama 3.1) stretches long wavelengths by ``factor`` and interpolates a band, as
    Meta's code does; ``linear`` (Gemma 3's global layers) divides by ``factor``.
    """
    half = head_dim // 2
    inv_freq = 1.0 / theta ** (jnp.arange(half, dtype=jnp.float32) / half)
    if scaling is None or not scaling.enabled:
        return inv_freq
    if scaling.type == "linear":
        return inv_freq / scaling.factor
    original = scaling.original_max_position_embeddings
    wavelength = 2 * jnp.pi / inv_freq
    smooth = (original / wavelength - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    interpolated = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    return jnp.where(wavelength < original / scaling.high_freq_factor, inv_freq,
                     jnp.where(wavelength > original / scaling.low_freq_factor,
                               inv_freq / scaling.factor, interpolated))


def rotary_embedding(x: jax.Array, positions: jax.Array, theta: float,
                     scaling: RopeScalingConfig | None = None,
                     frequencies: jax.Array | None = None) -> jax.Array:
    """Hugging Face's "rotate half" RoPE of x [B, S, N, D] at ``positions`` [B, S].

    Their q/k weights load unpermuted (docs/hugging-face.md, "RoPE convention").
    """
    inv_freq = (rope_frequencies(x.shape[-1], theta, scaling) if frequencies is None
                else frequencies)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, S, D/2]
    sin, cos = jnp.sin(angles)[:, :, None, :], jnp.cos(angles)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)


class LocalLayer(nnx.Variable):
    """int32 per layer: 1 where attention is within ``model.sliding_window``, 0 where global.

    A buffer, not an ``nnx.Param``: every scan and pipeline split hands each layer its own value.
    """


class Attention(nnx.Module):
    """Grouped-query attention: QKV column-parallel (split on heads), output row-parallel.

    Options from Hugging Face models: ``model.qkv_bias``, ``model.qk_norm``, ``model.query_scale``,
    ``model.sliding_window`` with ``global_every``, ``model.attn_softcap``, a local RoPE base.
    """

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        e, h, k, d = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.resolved_head_dim
        self.wq = _param(rngs, (e, h, d), ("embed", "heads", "head_dim"), cfg.init_std)
        self.wk = _param(rngs, (e, k, d), ("embed", "kv_heads", "head_dim"), cfg.init_std)
        self.wv = _param(rngs, (e, k, d), ("embed", "kv_heads", "head_dim"), cfg.init_std)
        # Residual-branch output scaled down with depth (GPT-2 style) to keep early steps stable.
        out_std = cfg.init_std / (2 * cfg.n_layers) ** 0.5
        self.wo = _param(rngs, (h, d, e), ("heads", "head_dim", "embed"), out_std)
        if cfg.qkv_bias:
            self.q_bias = nnx.Param(jnp.zeros((h, d), jnp.float32), out_sharding=Q_BIAS)
            self.k_bias = nnx.Param(jnp.zeros((k, d), jnp.float32), out_sharding=KV_BIAS)
            self.v_bias = nnx.Param(jnp.zeros((k, d), jnp.float32), out_sharding=KV_BIAS)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.norm_eps, axis="head_dim")
            self.k_norm = RMSNorm(d, cfg.norm_eps, axis="head_dim")
        self.rope_theta = cfg.rope_theta
        self.rope_scaling = cfg.rope_scaling
        self.window, self.softcap = cfg.sliding_window, cfg.attn_softcap
        self.rope_local_theta = cfg.rope_local_theta
        if self.window is not None:
            self.local = LocalLayer(jnp.ones((), jnp.int32), out_sharding=())
        # q pre-multiplied so that every attention kernel's head_dim**-0.5 gives query_scale's.
        self.q_multiplier = 1.0 if cfg.query_scale is None else (d / cfg.query_scale) ** 0.5

    def __call__(self, x: jax.Array, positions: Positions, x_from: Rebuild | None = None,
                 ) -> jax.Array:
        """``positions``: [B, S] positions, or a mask description (:mod:`jaxpar.model.mask`)."""
        q, k, v = self._qkv(x, x_from)
        q, k, v = (adapted(self, "q", x, q), adapted(self, "k", x, k), adapted(self, "v", x, v))
        if hasattr(self, "q_bias"):
            q = add_bias(q, self.q_bias, Q_BIAS)
            k = add_bias(k, self.k_bias, KV_BIAS)
            v = add_bias(v, self.v_bias, KV_BIAS)
        q = constrain(q, ("batch", "seq", "heads", "head_dim"))
        k = constrain(k, ("batch", "seq", "kv_heads", "head_dim"))
        v = constrain(v, ("batch", "seq", "kv_heads", "head_dim"))
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        rope = rope_positions(positions)
        frequencies = self._frequencies(q.shape[-1])
        q = rotary_embedding(q, rope, self.rope_theta, self.rope_scaling, frequencies)
        k = rotary_embedding(k, rope, self.rope_theta, self.rope_scaling, frequencies)
        if self.q_multiplier != 1.0:
            q = q * jnp.asarray(self.q_multiplier, q.dtype)
        attend = current_layout().attention or dense_attention
        q, k, v = named(ATTENTION_INPUTS, q, k, v)
        out, = named(ATTENTION_OUTPUT, attend(q, k, v, self._mask(positions)))
        out = constrain(out, ("batch", "seq", "heads", "head_dim"))
        return adapted(self, "o", out, project("bshd,hde->bse", out, self.wo,
                                               ("heads", "head_dim", "act_embed")))

    def _mask(self, positions: Positions) -> Positions:
        """``positions`` with this layer's window (unlimited if global) and soft cap."""
        if self.window is None and not self.softcap:
            return positions
        window = (None if self.window is None else
                  jnp.where(self.local[...] > 0, self.window, UNLIMITED))
        return with_window(positions, window, self.softcap)

    def _frequencies(self, head_dim: int) -> jax.Array | None:
        """RoPE frequencies chosen by this layer's kind when local layers have their own base.

        None: the usual ones.
        """
        if self.rope_local_theta is None:
            return None
        local = rope_frequencies(head_dim, self.rope_local_theta)
        overall = rope_frequencies(head_dim, self.rope_theta, self.rope_scaling)
        return jnp.where(self.local[...] > 0, local, overall)

    def _qkv(self, x: jax.Array, x_from: Rebuild | None,
             ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The q, k, v projections in one VJP (:func:`project_all`).

        Split heads are stacked into one matmul (equal heads) or two (q; k with v).
        """
        q = Projection("bse,ehd->bshd", (self.wq,), Q_WEIGHT)
        if not is_split("heads"):
            kv = (Projection("bse,ekd->bskd", (self.wk,), KV_WEIGHT),
                  Projection("bse,ekd->bskd", (self.wv,), KV_WEIGHT))
        elif self.wq.shape == self.wk.shape:
            kv, q = (), Projection("bse,ethd->bsthd", (self.wq, self.wk, self.wv), Q_WEIGHT)
        else:
            kv = (Projection("bse,etkd->bstkd", (self.wk, self.wv), KV_WEIGHT),)
        return project_all(x, (q, *kv), x_from=x_from or sequence_slice(x))


class SwiGLU(nnx.Module):
    """gate/up column-parallel (split on mlp), down row-parallel.

    ``d_ff`` None: ``cfg.d_ff``. ``model.mlp_activation: gelu_tanh``: GeGLU (Gemma).
    """

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, d_ff: int | None = None):
        e, f = cfg.d_model, d_ff if d_ff is not None else cfg.d_ff
        self.w_gate = _param(rngs, (e, f), ("embed", "mlp"), cfg.init_std)
        self.w_up = _param(rngs, (e, f), ("embed", "mlp"), cfg.init_std)
        out_std = cfg.init_std / (2 * cfg.n_layers) ** 0.5
        self.w_down = _param(rngs, (f, e), ("mlp", "embed"), out_std)
        self.activation = cfg.mlp_activation

    def __call__(self, x: jax.Array, x_from: Rebuild | None = None) -> jax.Array:
        w_names = ("act_embed", "mlp")
        if is_split("mlp"):  # one wider matmul, see project_all
            both = (Projection("bse,etf->bstf", (self.w_gate, self.w_up), w_names),)
        else:
            both = (Projection("bse,ef->bsf", (self.w_gate,), w_names),
                    Projection("bse,ef->bsf", (self.w_up,), w_names))
        gate, up = project_all(x, both, x_from=x_from or sequence_slice(x))
        gate, up = adapted(self, "gate", x, gate), adapted(self, "up", x, up)
        hidden = constrain(GATED_ACTIVATIONS[self.activation](gate, up), ("batch", "seq", "mlp"))
        return adapted(self, "down", hidden,
                       project("bsf,fe->bse", hidden, self.w_down, ("mlp", "act_embed")))
