"""Building blocks of a Llama-style decoder: RMSNorm, rotary embeddings, GQA attention, SwiGLU.

(The decoder block that puts them together, and the mixture of experts that can replace its
SwiGLU, are in :mod:`jaxpar.model.transformer` and :mod:`jaxpar.model.moe`.)

Every parameter is created in float32 and carries logical axis names in its ``out_sharding``
metadata (``("embed", "heads", "head_dim")``...); :mod:`jaxpar.parallel.rules` turns those names
into mesh axes. Inside a layer, weights are cast to the compute dtype, while norms, softmax and
the loss stay in float32.

Shapes use: B batch, S sequence, E d_model, H query heads, K kv heads, G = H/K query heads per kv
head, D head_dim, F d_ff.
"""

from __future__ import annotations

from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.config import ModelConfig, RopeScalingConfig
from jaxpar.model.annotate import (
    attention_override,
    constrain,
    is_split,
    relayout,
    resharding_after_forward,
    weight_grad_dtype,
    weights_prepared,
)
from jaxpar.model.attention import dense_attention

RESIDUAL = ("batch", "residual_seq", "act_embed")  # between blocks
MATMUL_INPUT = ("batch", "seq", "act_embed")  # entering the column-parallel matmuls
Q_WEIGHT = ("act_embed", "heads", "head_dim")
KV_WEIGHT = ("act_embed", "kv_heads", "head_dim")
Q_BIAS = ("heads", "head_dim")
KV_BIAS = ("kv_heads", "head_dim")


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], names: tuple[str, ...], std: float,
           ) -> nnx.Param:
    value = std * jax.random.truncated_normal(rngs.params(), -2.0, 2.0, shape, jnp.float32)
    return nnx.Param(value, out_sharding=names)


def weight(param: nnx.Param, names: tuple[str, ...], dtype) -> jax.Array:
    """A weight as a layer multiplies with it: in the compute dtype, laid out as ``names``.

    Layers name the model dimension of their weights ``act_embed`` here (whole, as activations
    keep it), where the stored parameter says ``embed`` (split over ``fsdp`` under ZeRO-3). The
    change of layout is FSDP's per-layer all-gather, done in the compute dtype (half the bytes in
    bf16) and written down explicitly, so the compiler never chooses to move activations instead.
    Its gradient goes straight back to the stored layout: a reduce-scatter over ``fsdp``.
    """
    return _used_weight(param[...], names, dtype)


def _used_weight(w: jax.Array, names: tuple[str, ...], dtype) -> jax.Array:
    if weights_prepared():
        return w
    return relayout(w.astype(dtype), _stored_names(names), names)


def _stored_names(names: tuple) -> tuple:
    return tuple("embed" if name == "act_embed" else name for name in names)


def project(spec: str, x: jax.Array, param: nnx.Param, names: tuple[str, ...], *,
            x_split: jax.Array | None = None) -> jax.Array:
    """``einsum(spec, x, weight)`` with :func:`weight`'s layout (``names``) and ``x``'s dtype.

    Three things autodiff alone would get wrong for a large model, fixed by a custom VJP where
    they apply:

    - **Reshard after forward.** Under ZeRO-3 autodiff would keep the gathered weight for the
      backward pass (``dx = dy w^T`` needs it), so without remat every layer's whole weights
      would stay alive from its forward to its backward pass (torchtitan's
      ``reshard_after_forward`` fixes the same; ``remat`` dots and full already recompute the
      gather). Where :func:`resharding_after_forward` says so, the VJP keeps the stored shard
      instead and gathers it again in the backward pass: one more all-gather of the layer's
      weights per step, and one layer's whole weights alive at a time.
    - **Gradient dtype.** The compiler sums a weight gradient over the devices that share the
      weight (FSDP's reduce-scatter, sums over ``context``) where the matmul produces it, in
      that matmul's dtype: bf16 in a bf16 run. Where :func:`weight_grad_dtype` asks for a
      wider one (``parallel.reduce_dtype``), the VJP's weight-gradient matmul accumulates into
      and returns it, so the sums travel in it.
    - **Keep the sequence split** (``x_split``: ``x`` laid out as :data:`RESIDUAL`, given by
      the column-parallel matmuls, whose ``x`` is :data:`MATMUL_INPUT`). Under Megatron-SP
      ``x`` is the whole sequence, all-gathered over ``tensor``, and autodiff would keep it for
      the weight gradient (``dw = x^T dy``): every device the whole sequence, twice per layer.
      Where the VJP applies (``remat=none``; the remat policies recompute the gather anyway) it
      keeps ``x_split``, the device's own slice (cut locally, once for all the matmuls reading
      ``x``), and gathers it again in the backward pass, as Megatron-SP does: one more
      all-gather per input and layer, 1/t of the memory. Without SP the two layouts are one.

    The gradient goes back to the stored layout as :func:`weight`'s does (reduce-scatter).
    """
    return _projected(spec, x, (param[...],), tuple(names), x_split)


def project_stacked(spec: str, x: jax.Array, params: tuple[nnx.Param, ...],
                    names: tuple[str, ...], *, x_split: jax.Array | None = None,
                    ) -> tuple[jax.Array, ...]:
    """Projections of the same ``x`` by weights of one shape, as one matmul over the weights
    stacked on the letter ``t`` of ``spec`` (``"bse,ethd->bsthd"`` for q, k, v): one
    :func:`project` each, laid out as ``names`` (without ``t``), ``x_split`` as there.

    Why: each projection's input gradient is a partial sum where the weights are split by
    output features (tensor parallelism), and the backward pass must sum it over ``tensor``
    (all-reduce, or Megatron-SP's reduce-scatter). Summing the three (q, k, v) or two (gate,
    up) gradients before that reduction is one collective instead of several; the TPU compiler
    reassociates separate ones, XLA:CPU does not. One wider matmul also replaces narrow ones.
    The cost is a copy of the weights into the stack, and of the output gradients into one
    array for the backward matmul: the model does it only where the outputs are split. The
    stack is built inside the custom VJP, from the stored weights, so the backward pass keeps
    those (and gathers them again under ZeRO-3), not a stacked copy.
    """
    if weights_prepared():  # stacking a stage's prepared weights would stash a copy per slot
        return tuple(project(spec.replace("t", ""), x, p, names) for p in params)
    w_spec, out = spec.split("->")[0].split(",")[1], spec.split("->")[1]
    at = w_spec.index("t")
    y = _projected(spec, x, tuple(p[...] for p in params), (*names[:at], None, *names[at:]),
                   x_split, at)
    # split (not indexing): its transpose is one concatenate, where slices' are pads and adds
    return tuple(jnp.squeeze(part, out.index("t"))
                 for part in jnp.split(y, len(params), axis=out.index("t")))


def _projected(spec: str, x: jax.Array, ws: tuple[jax.Array, ...], names: tuple,
               x_split: jax.Array | None, stacked_at: int | None = None,
               ) -> jax.Array:
    """:func:`project` of the stored weight values ``ws``: one, or several stacked on axis
    ``stacked_at`` (``names`` then has ``None`` there)."""
    if weights_prepared():  # a pipeline stage gathers its weights once per step for all slots
        return jnp.einsum(spec, x, ws[0])
    grad_dtype = weight_grad_dtype()
    wider_grads = grad_dtype is not None and jnp.dtype(grad_dtype).itemsize > x.dtype.itemsize
    if not (resharding_after_forward() or wider_grads):
        return jnp.einsum(spec, x, _used_weight(_stacked(ws, stacked_at), names, x.dtype))
    how = _ProjectVJP(spec, names, _stored_names(names), resharding_after_forward(),
                      jnp.dtype(grad_dtype if wider_grads else x.dtype), ws[0].dtype,
                      x_split is not None, stacked_at)
    return _project(how, x, x_split, *ws)


def _stacked(ws: tuple[jax.Array, ...], at: int | None) -> jax.Array:
    return ws[0] if at is None else jnp.stack(ws, axis=at)


class _ProjectVJP(NamedTuple):
    """The static part of :func:`project`'s custom VJP."""

    spec: str
    names: tuple  # the weight's layout as used
    stored: tuple  # ... and as stored
    regather: bool  # keep the stored shard, not the used weight, for the backward pass
    grad_dtype: Any  # the dtype of the weight gradient and of its sums
    stored_dtype: Any  # the parameter's (train.param_dtype)
    split_input: bool  # keep x_split, not x, and gather it to MATMUL_INPUT again
    stacked_at: int | None  # the weights' stacking axis (project_stacked), None: one weight


def _gathered(w: jax.Array, names: tuple, dtype) -> jax.Array:
    return constrain(w.astype(dtype), names)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _project(how: _ProjectVJP, x: jax.Array, x_split: jax.Array | None, *ws: jax.Array,
             ) -> jax.Array:
    return jnp.einsum(how.spec, x, _gathered(_stacked(ws, how.stacked_at), how.names, x.dtype))


def _project_fwd(how, x, x_split, *ws):
    wg = _gathered(_stacked(ws, how.stacked_at), how.names, x.dtype)
    y = jnp.einsum(how.spec, x, wg)
    return y, (x_split if how.split_input else x, ws if how.regather else wg)


def _project_bwd(how, residuals, dy):
    x, kept = residuals
    if how.split_input:
        x = constrain(x, MATMUL_INPUT)
    wg = _gathered(_stacked(kept, how.stacked_at), how.names, x.dtype) if how.regather else kept
    # The matmul is linear in each operand: transpose it in x (no forward recomputed), and
    # write the weight's gradient as its own matmul so that it accumulates in grad_dtype.
    (dx,) = jax.linear_transpose(lambda x_: jnp.einsum(how.spec, x_, wg), x)(dy)
    inputs, out = how.spec.split("->")
    x_spec, w_spec = inputs.split(",")
    dw = jnp.einsum(f"{x_spec},{out}->{w_spec}", x, dy, preferred_element_type=how.grad_dtype)
    dw = constrain(dw.astype(how.stored_dtype), how.stored)
    # x_split only stands in for x: its gradient flows through x
    d_split = jnp.zeros(x.shape, x.dtype) if how.split_input else None
    if how.stacked_at is None:
        return dx, d_split, dw
    parts = jnp.split(dw, dw.shape[how.stacked_at], axis=how.stacked_at)
    return dx, d_split, *(jnp.squeeze(part, how.stacked_at) for part in parts)


_project.defvjp(_project_fwd, _project_bwd)


def lookup(tokens: jax.Array, param: nnx.Param, names: tuple[str, ...], dtype) -> jax.Array:
    """Rows of the table ``param`` ([vocab, d_model], laid out as ``names`` when used) for int
    ``tokens``, in ``dtype``: the embedding where the layout does not split ``vocab``.

    The forward pass is a gather: no ``[tokens, vocab]`` one-hot and none of its 2 x vocab x
    d_model flops a token. The backward pass is the one-hot matmul's weight gradient,
    ``one_hot(tokens)^T dy``, built only then from the tokens (the only residual): the
    compiler partitions and sums it like any weight gradient (a scatter-add gradient it laid
    out differently per layout). In ``parallel.reduce_dtype`` where that is wider, as
    :func:`project`'s.
    """
    w = param[...]
    grad_dtype = weight_grad_dtype()
    wider = grad_dtype is not None and jnp.dtype(grad_dtype).itemsize > jnp.dtype(dtype).itemsize
    stored = _stored_names(tuple(names))
    how = _LookupVJP(tuple(names), stored, w.shape[0], jnp.dtype(dtype),
                     jnp.dtype(grad_dtype if wider else dtype), w.dtype)
    return _lookup(how, tokens, w)


class _LookupVJP(NamedTuple):
    """The static part of :func:`lookup`'s custom VJP."""

    names: tuple  # the table's layout as used
    stored: tuple  # ... and as stored
    vocab_size: int
    dtype: Any  # the rows' (the compute dtype)
    grad_dtype: Any
    stored_dtype: Any


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _lookup(how: _LookupVJP, tokens: jax.Array, w: jax.Array) -> jax.Array:
    return jnp.take(_gathered(w, how.names, how.dtype), tokens, axis=0)


def _lookup_fwd(how, tokens, w):
    return _lookup(how, tokens, w), tokens


def _lookup_bwd(how, tokens, dy):
    one_hot = constrain(jax.nn.one_hot(tokens, how.vocab_size, dtype=dy.dtype),
                        ("batch", "seq", "vocab"))
    dw = jnp.einsum("bsv,bse->ve", one_hot, dy, preferred_element_type=how.grad_dtype)
    return None, constrain(dw.astype(how.stored_dtype), how.stored)  # None: ints have none


_lookup.defvjp(_lookup_fwd, _lookup_bwd)


def stored_weight(param: nnx.Param, names: tuple[str, ...], dtype) -> jax.Array:
    """A weight in the compute dtype but laid out as stored (``names``): the experts' weights,
    which the expert-parallel hook gathers itself."""
    if weights_prepared():
        return param[...]
    return constrain(param[...].astype(dtype), names)


# Parameters a layer uses in float32 whatever the compute dtype: norm scales and the router.
FULL_PRECISION = frozenset({"scale", "router"})


def prepare_weight(value: jax.Array, name: str, stored: tuple, dtype) -> jax.Array:
    """What :func:`weight` (or :func:`stored_weight`, or a norm) hands its layer, computed once:
    ``value`` (the parameter ``name``, laid out as ``stored``) cast to the dtype the layer
    multiplies in and laid out as it uses it (the model dimension whole: FSDP's gather)."""
    dtype = jnp.float32 if name in FULL_PRECISION else dtype
    if "experts" in stored:
        return constrain(value.astype(dtype), stored)
    return constrain(value.astype(dtype),
                     tuple("act_embed" if n == "embed" else n for n in stored))


def prepared_weight_grad(grad: jax.Array, stored: tuple) -> jax.Array:
    """The transpose of :func:`prepare_weight`: a float32 gradient, back in the stored layout
    (FSDP's reduce-scatter)."""
    return constrain(grad.astype(jnp.float32), stored)


class RMSNorm(nnx.Module):
    """Root-mean-square norm over the last axis with a learned scale (named ``axis``: ``embed``
    on the residual stream, ``head_dim`` for the per-head q/k norms of ``model.qk_norm``)."""

    def __init__(self, dim: int, eps: float, axis: str = "embed"):
        self.scale = nnx.Param(jnp.ones((dim,), jnp.float32), out_sharding=(axis,))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (normed * self.scale[...]).astype(x.dtype)


def rope_frequencies(head_dim: int, theta: float,
                     scaling: RopeScalingConfig | None = None) -> jax.Array:
    """float32 [head_dim/2] angular frequencies: theta^(-i/half), rescaled by ``scaling``.

    ``llama3`` (Llama 3.1): wavelengths 2 pi / f longer than original / low_freq_factor are
    stretched by ``factor``, those shorter than original / high_freq_factor kept, and the band
    between interpolated linearly in original / wavelength (as Meta's reference code does).
    """
    half = head_dim // 2
    inv_freq = 1.0 / theta ** (jnp.arange(half, dtype=jnp.float32) / half)
    if scaling is None or not scaling.enabled:
        return inv_freq
    original = scaling.original_max_position_embeddings
    wavelength = 2 * jnp.pi / inv_freq
    smooth = (original / wavelength - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    interpolated = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    return jnp.where(wavelength < original / scaling.high_freq_factor, inv_freq,
                     jnp.where(wavelength > original / scaling.low_freq_factor,
                               inv_freq / scaling.factor, interpolated))


def rotary_embedding(x: jax.Array, positions: jax.Array, theta: float,
                     scaling: RopeScalingConfig | None = None) -> jax.Array:
    """Rotate pairs (first half, second half) of the head dim by position-dependent angles.

    This pairing ("rotate half") is the one Hugging Face's Llama-family models use, so their q/k
    projection weights load unpermuted (``jaxpar/train/hf_names.py``).
    x: [B, S, N, D]; positions: [B, S] (explicit, so a sequence shard knows its offsets).
    """
    inv_freq = rope_frequencies(x.shape[-1], theta, scaling)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, S, D/2]
    sin, cos = jnp.sin(angles)[:, :, None, :], jnp.cos(angles)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)


class Attention(nnx.Module):
    """QKV projections are column-parallel (split on heads), the output projection row-parallel.

    Optional, for models imported from Hugging Face: biases on q, k, v (``model.qkv_bias``,
    Qwen2) and an RMSNorm of each q and k head before RoPE (``model.qk_norm``, Qwen3)."""

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

    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        q, k, v = self._qkv(x)
        if hasattr(self, "q_bias"):
            q = q + weight(self.q_bias, Q_BIAS, x.dtype)
            k = k + weight(self.k_bias, KV_BIAS, x.dtype)
            v = v + weight(self.v_bias, KV_BIAS, x.dtype)
        q = constrain(q, ("batch", "seq", "heads", "head_dim"))
        k = constrain(k, ("batch", "seq", "kv_heads", "head_dim"))
        v = constrain(v, ("batch", "seq", "kv_heads", "head_dim"))
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q = rotary_embedding(q, positions, self.rope_theta, self.rope_scaling)
        k = rotary_embedding(k, positions, self.rope_theta, self.rope_scaling)
        attend = attention_override() or dense_attention
        out = attend(q, k, v, positions)
        out = constrain(out, ("batch", "seq", "heads", "head_dim"))
        return project("bshd,hde->bse", out, self.wo, ("heads", "head_dim", "act_embed"))

    def _qkv(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The q, k, v projections: one matmul where heads are split (three with equal heads,
        else q and a k/v pair), see :func:`project_stacked`."""
        s = constrain(x, RESIDUAL)  # each device's slice of the sequence (Megatron-SP)
        if not is_split("heads"):
            return (project("bse,ehd->bshd", x, self.wq, Q_WEIGHT, x_split=s),
                    project("bse,ekd->bskd", x, self.wk, KV_WEIGHT, x_split=s),
                    project("bse,ekd->bskd", x, self.wv, KV_WEIGHT, x_split=s))
        if self.wq.shape == self.wk.shape:
            return project_stacked("bse,ethd->bsthd", x, (self.wq, self.wk, self.wv), Q_WEIGHT,
                                   x_split=s)
        k, v = project_stacked("bse,etkd->bstkd", x, (self.wk, self.wv), KV_WEIGHT, x_split=s)
        return project("bse,ehd->bshd", x, self.wq, Q_WEIGHT, x_split=s), k, v


class SwiGLU(nnx.Module):
    """gate/up are column-parallel (split on mlp), down is row-parallel. ``d_ff`` defaults to
    ``cfg.d_ff`` (MoE shared experts pass their own)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, d_ff: int | None = None):
        e, f = cfg.d_model, d_ff if d_ff is not None else cfg.d_ff
        self.w_gate = _param(rngs, (e, f), ("embed", "mlp"), cfg.init_std)
        self.w_up = _param(rngs, (e, f), ("embed", "mlp"), cfg.init_std)
        out_std = cfg.init_std / (2 * cfg.n_layers) ** 0.5
        self.w_down = _param(rngs, (f, e), ("mlp", "embed"), out_std)

    def __call__(self, x: jax.Array) -> jax.Array:
        w_names, s = ("act_embed", "mlp"), constrain(x, RESIDUAL)  # s: see Attention._qkv
        if is_split("mlp"):  # one input-gradient sum over tensor, see project_stacked
            gate, up = project_stacked("bse,etf->bstf", x, (self.w_gate, self.w_up), w_names,
                                       x_split=s)
        else:
            gate = project("bse,ef->bsf", x, self.w_gate, w_names, x_split=s)
            up = project("bse,ef->bsf", x, self.w_up, w_names, x_split=s)
        hidden = constrain(jax.nn.silu(gate) * up, ("batch", "seq", "mlp"))
        return project("bsf,fe->bse", hidden, self.w_down, ("mlp", "act_embed"))
