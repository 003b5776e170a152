"""Mixture of experts: a router picks ``top_k`` of ``num_experts`` SwiGLU experts per token.

Shapes: T tokens (B x S flattened), E d_model, X experts, k top_k, F d_ff_expert, C capacity. The
router runs in float32. One device runs :func:`local_experts`; expert parallelism plugs in through
the layout's ``experts`` (:class:`jaxpar.model.annotate.Layout`). Formulas, dispatch and
statistics: docs/moe.md, "What one MoE layer computes".
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from jaxpar.config import ModelConfig, MoEConfig
from jaxpar.model.annotate import (
    constrain,
    current_layout,
    hand_split_devices,
    sum_over_hand_split,
)
from jaxpar.model.layers import SwiGLU, _param, gated_silu, stored_weight
from jaxpar.model.lora import PREFIX
from jaxpar.model.projection import weight

# w_gate [X,E,F], w_up [X,E,F], w_down [X,F,E]; under LoRA (jaxpar/model/lora.py) an adapted
# one is a triple (w, A [X,in,r], B [X,r,out] times alpha/r): see :func:`adapted_matmul`.
ExpertWeight = jax.Array | tuple[jax.Array, jax.Array, jax.Array]
Weights = tuple[ExpertWeight, ExpertWeight, ExpertWeight]
Exchange = Callable[[jax.Array], jax.Array]  # [groups, ...] -> [groups, ...] (an all-to-all)

# Logical names of the expert weights as stored (and as handed to the experts function: the
# expert-parallel hook gathers the ``embed`` split itself, see jaxpar.parallel.expert).
EXPERT_IN = ("experts", "expert_embed", "mlp")  # w_gate, w_up [X, E, F]
EXPERT_OUT = ("experts", "mlp", "expert_embed")  # w_down [X, F, E]

# Keys of a layer's aux dict. All add up over micro-steps and over layers, except
# LAYER_STACKED, which :meth:`jaxpar.model.transformer.Transformer.run_layers` keeps per layer.
LAYER_STACKED = ("layer_expert_tokens",)


class RouterBias(nnx.Variable):
    """Per-expert bias added to the router scores before top-k (``router: sigmoid_bias``).

    A buffer, not an ``nnx.Param``: the train step updates it from the load
    (:func:`update_router_bias`).
    """


def _f32(x) -> jax.Array:
    return jnp.asarray(x, jnp.float32)


# --------------------------------------------------------------------------------------------
# Building blocks (used here on one device and by jaxpar.parallel.expert on each device)


def slot_positions(groups: jax.Array, num_groups: int) -> jax.Array:
    """Each slot's rank among earlier slots of its group (slots [N], groups in [0, num_groups))."""
    one_hot = jax.nn.one_hot(groups, num_groups, dtype=jnp.int32)
    return jnp.sum((jnp.cumsum(one_hot, axis=0) - one_hot) * one_hot, axis=1)


def choice_major_positions(expert_ids: jax.Array, num_experts: int) -> jax.Array:
    """[T, k] -> each slot's place in its expert's queue, first choices before any second."""
    t, k = expert_ids.shape
    return slot_positions(expert_ids.T.reshape(t * k), num_experts).reshape(k, t).T


def expert_count(w: ExpertWeight) -> int:
    """How many experts an expert weight (or adapted triple) holds."""
    return (w[0] if isinstance(w, tuple) else w).shape[0]


def adapted_matmul(matmul: Callable) -> Callable:
    """``matmul(x, w)``, or for a triple ``(w, A, B)``: ``x w + (x A) B``, per expert."""

    def product(x: jax.Array, w: ExpertWeight) -> jax.Array:
        if not isinstance(w, tuple):
            return matmul(x, w)
        w, a, b = w
        return matmul(x, w) + matmul(matmul(x, a), b)

    return product


def swiglu(x: jax.Array, w_gate: ExpertWeight, w_up: ExpertWeight, w_down: ExpertWeight,
           matmul: Callable) -> jax.Array:
    """SwiGLU with the three matmuls done by ``matmul(x, w)`` (grouped or batched)."""
    matmul = adapted_matmul(matmul)
    return matmul(gated_silu(matmul(x, w_gate), matmul(x, w_up)), w_down)


def grouped_swiglu(rows: jax.Array, row_expert: jax.Array, weights: Weights) -> jax.Array:
    """Rows [N, E] through their experts ``row_expert`` [N] by one ``ragged_dot``.

    ``row_expert == X_local`` marks a padding row (output zero).
    """
    num_local = expert_count(weights[0])
    order = jnp.argsort(row_expert, stable=True)  # padding (id X_local) sorts last
    group_sizes = jnp.bincount(row_expert, length=num_local).astype(jnp.int32)  # drops padding

    def grouped(x, w):
        return lax.ragged_dot(x, w, group_sizes)

    out = swiglu(rows[order], *weights, matmul=grouped)  # rows past sum(group_sizes) are zero
    return jnp.zeros_like(out).at[order].set(out, unique_indices=True)


def batched_swiglu(buffer: jax.Array, weights: Weights) -> jax.Array:
    """An [X_local, C, E] capacity buffer through the experts, as one batched matmul."""

    def batched(x, w):
        return jnp.einsum("xce,xef->xcf", x, w)

    return swiglu(buffer, *weights, matmul=batched)


def combine(slot_out: jax.Array, gates: jax.Array, dtype) -> jax.Array:
    """[T, k, E] expert outputs weighted by gates [T, k], summed over k in float32."""
    return jnp.einsum("tke,tk->te", slot_out.astype(jnp.float32), gates).astype(dtype)


def no_stats() -> dict[str, jax.Array]:
    return {"dropped": _f32(0), "a2a_rows": _f32(0), "a2a_padding": _f32(0)}


def dropless_experts(tokens: jax.Array, expert_ids: jax.Array, gates: jax.Array,
                     weights: Weights) -> tuple[jax.Array, dict]:
    """Every slot computed: tokens [T, E], expert_ids/gates [T, k] -> [T, E]."""
    t, k = expert_ids.shape
    slots = jnp.repeat(tokens, k, axis=0)  # slot (t, j) is row t*k + j
    out = grouped_swiglu(slots, expert_ids.reshape(t * k), weights)
    return combine(out.reshape(t, k, -1), gates, tokens.dtype), no_stats()


def dropping_experts(tokens: jax.Array, expert_ids: jax.Array, gates: jax.Array,
                     weights: Weights, capacity_factor: float, *, num_experts: int,
                     exchange: Exchange | None = None) -> tuple[jax.Array, dict]:
    """Capacity-limited experts: tokens [T, E], expert_ids/gates [T, k] -> [T, E].

    Slots past capacity C are dropped and read zero. ``exchange`` (an all-to-all over G devices)
    moves each buffer block to its experts' device and back.
    """
    t, k = expert_ids.shape
    e = tokens.shape[-1]
    local = expert_count(weights[0])
    groups = num_experts // local
    cap = MoEConfig(num_experts=num_experts, top_k=k, capacity_factor=capacity_factor
                    ).capacity(t)
    pos = choice_major_positions(expert_ids, num_experts)
    keep = pos < cap
    slots = jnp.broadcast_to(tokens[:, None, :], (t, k, e))
    buffer = jnp.zeros((num_experts, cap, e), tokens.dtype).at[expert_ids, pos].set(
        slots, mode="drop")
    blocks = buffer.reshape(groups, local, cap, e)
    if exchange is not None:
        blocks = exchange(blocks)  # [G sources, X/G, C, E]: this device's experts' rows
    rows = blocks.transpose(1, 0, 2, 3).reshape(local, groups * cap, e)
    out = batched_swiglu(rows, weights).reshape(local, groups, cap, e).transpose(1, 0, 2, 3)
    if exchange is not None:
        out = exchange(out)  # back to the owners of the tokens: [G owners of experts, X/G, C, E]
    slot_out = out.reshape(num_experts, cap, e).at[expert_ids, pos].get(mode="fill",
                                                                          fill_value=0)
    kept = jnp.sum(keep.astype(jnp.float32))
    stats = {"dropped": _f32(t * k) - kept, "a2a_rows": _f32(0), "a2a_padding": _f32(0)}
    if exchange is not None:  # every buffer row crosses the all-to-all, used or not
        stats.update(a2a_rows=_f32(num_experts * cap), a2a_padding=num_experts * cap - kept)
    return combine(slot_out, gates, tokens.dtype), stats


def local_experts(x: jax.Array, expert_ids: jax.Array, gates: jax.Array, weights: Weights, *,
                  dispatch: str, capacity_factor: float) -> tuple[jax.Array, dict]:
    """The experts on one device: x [B, S, E], expert_ids/gates [B, S, k] -> ([B, S, E], stats).

    ``weights`` as stored. Also the signature of the :attr:`~jaxpar.model.annotate.Layout.experts`
    hook.
    """
    b, s, e = x.shape
    k = expert_ids.shape[-1]
    tokens, ids, g = x.reshape(b * s, e), expert_ids.reshape(b * s, k), gates.reshape(b * s, k)
    weights = jax.tree.map(lambda w: w.astype(x.dtype), weights)
    if dispatch == "dropless":
        y, stats = dropless_experts(tokens, ids, g, weights)
    else:
        y, stats = dropping_experts(tokens, ids, g, weights, capacity_factor,
                                    num_experts=expert_count(weights[0]))
    return y.reshape(b, s, e), stats


# --------------------------------------------------------------------------------------------
# The layer


def top_k(scores: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """``lax.top_k`` over the last axis (ties to the lower index), as a sort.

    Why a sort: docs/jax-notes.md, "Mesh and shardings".
    """
    order = jnp.argsort(-scores, axis=-1, stable=True)[..., :k]
    return jnp.take_along_axis(scores, order, axis=-1), order


def route(logits: jax.Array, moe: MoEConfig, bias: jax.Array | None
          ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """float32 logits [..., X] -> (expert_ids [..., k], gates [..., k], balance probs [..., X])."""
    if moe.router == "softmax":
        probs = balance = jax.nn.softmax(logits, axis=-1)
        choice = probs
    else:
        probs = jax.nn.sigmoid(logits)
        choice = probs + lax.stop_gradient(bias)
        balance = probs / jnp.sum(probs, axis=-1, keepdims=True)
    _, expert_ids = top_k(limit_groups(choice, moe.n_group, moe.topk_group), moe.top_k)
    gates = jnp.take_along_axis(probs, expert_ids, axis=-1)
    if moe.normalise_gates:  # the k gates sum to 1 (+ DeepSeek-V3's guard against 0/0)
        gates = gates / (jnp.sum(gates, axis=-1, keepdims=True) + 1e-20)
    if moe.routed_scaling_factor != 1.0:
        gates = gates * moe.routed_scaling_factor
    return expert_ids, gates, balance


def limit_groups(choice: jax.Array, n_group: int, topk_group: int) -> jax.Array:
    """DeepSeek-V3's group-limited routing: tokens keep their ``topk_group`` best groups.

    docs/moe.md, "Group-limited routing"; the others' scores become -inf.
    """
    if n_group == 1:
        return choice
    *lead, x = choice.shape
    grouped = choice.reshape(*lead, n_group, x // n_group)
    best_two = jnp.sum(top_k(grouped, 2)[0], axis=-1)  # [..., G]
    _, kept = top_k(best_two, topk_group)
    keep = jnp.sum(jax.nn.one_hot(kept, n_group, dtype=jnp.int32), axis=-2) > 0
    return jnp.where(keep[..., None], grouped, -jnp.inf).reshape(choice.shape)


class MoE(nnx.Module):
    """Router + ``num_experts`` SwiGLU experts (+ optional shared experts).

    Expert weights are stacked on ``experts`` (split over ``expert``); ``mlp`` and ``embed`` split
    as in the dense SwiGLU.
    """

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        moe = cfg.moe
        e, x, f = cfg.d_model, moe.num_experts, cfg.resolved_d_ff_expert
        out_std = cfg.init_std / (2 * cfg.n_layers) ** 0.5
        # The router's expert dimension is not split: every device routes its own tokens.
        self.router = _param(rngs, (e, x), ("embed", None), cfg.init_std)
        self.w_gate = _param(rngs, (x, e, f), EXPERT_IN, cfg.init_std)
        self.w_up = _param(rngs, (x, e, f), EXPERT_IN, cfg.init_std)
        self.w_down = _param(rngs, (x, f, e), EXPERT_OUT, out_std)
        if moe.router == "sigmoid_bias":
            self.router_bias = RouterBias(jnp.zeros((x,), jnp.float32), out_sharding=(None,))
        if moe.num_shared_experts:
            self.shared = SwiGLU(cfg, rngs, d_ff=moe.num_shared_experts * f)
        self.config = moe

    def __call__(self, x: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        """x [B, S, E] (a matmul input) -> (y [B, S, E], this layer's aux dict)."""
        moe = self.config
        logits = jnp.einsum("bse,ex->bsx", x.astype(jnp.float32),
                            weight(self.router, ("act_embed", None), jnp.float32))
        logits = constrain(logits, ("batch", "seq", None))
        bias = self.router_bias[...] if moe.router == "sigmoid_bias" else None
        expert_ids, gates, probs = route(logits, moe, bias)

        # Statistics over the whole micro-batch: plain sums over sharded dimensions, which the
        # compiler turns into all-reduces of X floats, so no layout changes the numbers. Where
        # the tokens are split by hand over n devices (a pipeline stage), each device sees its
        # own: the load's counts are summed over the others (they carry no gradient), and each
        # device adds its share of the mean probabilities and of the z-loss, 1/n of its local
        # means; the shares add up (over the devices, as the step's aux sums do) to the terms
        # of the whole micro-batch, and each device's gradient is its share's.
        n = hand_split_devices()
        slots = math.prod(expert_ids.shape)
        counts = jnp.sum(jax.nn.one_hot(expert_ids, moe.num_experts, dtype=jnp.float32),
                         axis=(0, 1, 2))
        load = sum_over_hand_split(counts) / (slots * n)
        balance = moe.num_experts * jnp.sum(load * jnp.mean(probs, axis=(0, 1))) / n
        z_loss = jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2) / n

        # As stored: on one device the experts cast them to x's dtype; the expert-parallel hook
        # casts and all-gathers the fsdp split of ``embed`` per device, and sums the gradient
        # back (reduce-scatter) in parallel.reduce_dtype, as `weight` does for the other layers.
        weights = (self._expert_weight("gate", EXPERT_IN), self._expert_weight("up", EXPERT_IN),
                   self._expert_weight("down", EXPERT_OUT))
        experts = current_layout().experts or local_experts
        y, stats = experts(x, expert_ids, gates, weights, dispatch=moe.dispatch,
                           capacity_factor=moe.capacity_factor)
        if moe.num_shared_experts:
            y = y + self.shared(x)
        aux = {"aux_loss": balance, "z_loss": z_loss, "layer_expert_tokens": counts,
               "routed": _f32(slots), **stats}
        return y, aux

    def _expert_weight(self, target: str, names: tuple[str, ...]) -> ExpertWeight:
        """The experts' ``target`` weight as stored, or with LoRA the triple (w, A, B alpha / r)."""
        w = stored_weight(getattr(self, f"w_{target}"), names)
        adapter = getattr(self, PREFIX + target, None)
        if adapter is None:
            return w
        b = stored_weight(adapter.b, adapter.b_stored)
        return (w, stored_weight(adapter.a, adapter.a_stored),
                b * jnp.asarray(adapter.scale, b.dtype))


# --------------------------------------------------------------------------------------------
# What the train step does with the aux dict


def moe_loss(aux: Mapping[str, jax.Array], moe: MoEConfig) -> jax.Array:
    """The weighted auxiliary losses to add (0 for a dense model).

    From ``aux``'s sums over one micro-step's MoE layers.
    """
    if not aux:
        return _f32(0)
    return moe.aux_loss_weight * aux["aux_loss"] + moe.z_loss_weight * aux["z_loss"]


def update_router_bias(bias: jax.Array, layer_tokens: jax.Array, rate: float) -> jax.Array:
    """Aux-loss-free balancing: ``b_i += rate * sign(mean load - load_i)`` per layer.

    ``bias``, ``layer_tokens``: [MoE layers, X]. The gates ignore the bias.
    """
    if bias.shape != layer_tokens.shape:
        raise ValueError(f"router bias {bias.shape} and expert load {layer_tokens.shape} differ")
    mean = jnp.mean(layer_tokens, axis=-1, keepdims=True)
    return bias + rate * jnp.sign(mean - layer_tokens)


def moe_metrics(aux: Mapping[str, jax.Array], cfg: ModelConfig, micro_steps: int
                ) -> dict[str, jax.Array]:
    """Per-step numbers for ``metrics.jsonl`` from the aux dict summed over micro-steps."""
    layers = cfg.n_moe_layers * micro_steps
    tokens = jnp.sum(aux["layer_expert_tokens"], axis=0)  # [X], all MoE layers
    return {
        "moe_aux_loss": aux["aux_loss"] / layers,  # per layer and micro-step; 1.0 = balanced
        "moe_z_loss": aux["z_loss"] / layers,
        "expert_tokens": tokens,
        "expert_load_min_max": jnp.min(tokens) / jnp.maximum(jnp.max(tokens), 1.0),
        "dropped_fraction": aux["dropped"] / jnp.maximum(aux["routed"], 1.0),
        "a2a_padding_fraction": aux["a2a_padding"] / jnp.maximum(aux["a2a_rows"], 1.0),
    }
