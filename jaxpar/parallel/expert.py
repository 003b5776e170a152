"""Expert parallelism: the experts of every MoE layer split over the ``expert`` mesh axis.

Outside the experts, ``expert`` is one more data-parallel axis. Through the layout's ``experts``
hook, per device in ``shard_map``: an all-to-all over ``expert`` sends each
slot to its expert's device, the local experts run, the reverse all-to-all brings results back.
Layout, padding per ``moe.dispatch``, bytes: docs/moe.md, "Expert parallelism".
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxpar import platform as workarounds
from jaxpar.config import BATCH_AXES, ConfigError
from jaxpar.model.annotate import Experts
from jaxpar.model.moe import (
    Weights,
    _f32,
    combine,
    dropless_experts,
    dropping_experts,
    expert_count,
    grouped_swiglu,
    slot_positions,
)
from jaxpar.model.projection import summed_grad_dtype
from jaxpar.parallel.point_to_point import ring_all_gather, ring_reduce_scatter

EXPERT_AXIS = "expert"
# The collective itself, looked up at call time (a test substitutes an emulation of its
# documented semantics to check the offsets on CPU).
ragged_all_to_all = lax.ragged_all_to_all


def _exchange(blocks: jax.Array) -> jax.Array:
    """[G, ...] -> [G, ...]: block g goes to device g; block g of the result came from g."""
    return lax.all_to_all(blocks, EXPERT_AXIS, 0, 0, tiled=True)


# --------------------------------------------------------------------------------------------
# Dropless dispatch across devices


def padded_dropless(tokens: jax.Array, expert_ids: jax.Array, gates: jax.Array,
                    weights: Weights, num_experts: int, groups: int
                    ) -> tuple[jax.Array, dict]:
    """Dropless over G = ``groups`` devices with fixed-size all-to-all blocks.

    A token's k distinct experts put at most min(k, X/G) slots on one device, so blocks of
    ``T x min(k, X/G)`` rows never overflow. Unused rows carry local expert id X/G (padding to the
    grouped matmul).
    """
    t, k = expert_ids.shape
    local = num_experts // groups
    cap = t * min(k, local)
    flat = expert_ids.reshape(t * k)
    dest, row = flat // local, slot_positions(flat // local, groups)
    send = jnp.zeros((groups, cap, tokens.shape[-1]), tokens.dtype).at[dest, row].set(
        jnp.repeat(tokens, k, axis=0), unique_indices=True)
    send_ids = jnp.full((groups, cap), local, jnp.int32).at[dest, row].set(flat % local)
    received, received_ids = _exchange(send), _exchange(send_ids)  # [G sources, cap, ...]
    out = grouped_swiglu(received.reshape(groups * cap, -1), received_ids.reshape(-1), weights)
    back = _exchange(out.reshape(groups, cap, -1))  # [G experts' owners, cap, E]
    y = combine(back[dest, row].reshape(t, k, -1), gates, tokens.dtype)
    return y, {"dropped": _f32(0), "a2a_rows": _f32(groups * cap),
               "a2a_padding": _f32(groups * cap - t * k)}


def ragged_dropless(tokens: jax.Array, expert_ids: jax.Array, gates: jax.Array,
                    weights: Weights, num_experts: int, groups: int
                    ) -> tuple[jax.Array, dict]:
    """Dropless over G devices with ``lax.ragged_all_to_all``: only real rows travel.

    Slots are sorted by destination; ``sizes[s, d]`` (all-gathered) rows go from s to d, fixing
    every offset. XLA:CPU cannot compile it: tests check the offsets against an emulation.
    """
    t, k = expert_ids.shape
    local = num_experts // groups
    flat = expert_ids.reshape(t * k)
    dest = flat // local
    order = jnp.argsort(dest, stable=True)
    rows, row_ids = jnp.repeat(tokens, k, axis=0)[order], (flat % local)[order]
    send_sizes = jnp.bincount(dest, length=groups).astype(jnp.int32)
    sizes = lax.all_gather(send_sizes, EXPERT_AXIS)  # [source, destination]
    me = lax.axis_index(EXPERT_AXIS)
    send_offsets = jnp.cumsum(send_sizes) - send_sizes
    recv_sizes = sizes[:, me]
    recv_offsets = jnp.cumsum(recv_sizes) - recv_sizes
    # Where my block lands on each destination d: after the blocks of sources before me.
    landing = (jnp.cumsum(sizes, axis=0) - sizes)[me]
    # Where each source s kept the block it sent me: after its blocks for devices before me.
    origin = (jnp.cumsum(sizes, axis=1) - sizes)[:, me]
    worst = groups * t * min(k, local)  # static: every slot of every device could come here

    def there(x, fill):
        # The collective's result takes the receive buffer's type. A buffer made invariant
        # (jnp.full) would type what each device received as the same everywhere: autodiff
        # then sums its gradient over the token axes (the transpose of the implicit pvary
        # where it meets the varying weights), a [worst, E] all-reduce that also mixes other
        # devices' rows into this one's gradient. Shaped like ``x``, it varies as ``x`` does;
        # the pvary that puts on a constant has no gradient to transpose.
        out = jnp.full_like(x, fill, shape=(worst, *x.shape[1:]))
        return ragged_all_to_all(x, out, send_offsets, send_sizes, landing, recv_sizes,
                                 axis_name=EXPERT_AXIS)

    received, received_ids = there(rows, 0), there(row_ids, local)
    out = grouped_swiglu(received, received_ids, weights)
    back = ragged_all_to_all(out, jnp.zeros_like(rows), recv_offsets, recv_sizes, origin,
                             send_sizes, axis_name=EXPERT_AXIS)
    slot_out = jnp.zeros_like(back).at[order].set(back, unique_indices=True)
    y = combine(slot_out.reshape(t, k, -1), gates, tokens.dtype)
    return y, {"dropped": _f32(0), "a2a_rows": _f32(t * k), "a2a_padding": _f32(0)}


# --------------------------------------------------------------------------------------------
# The experts' weights as used: FSDP's gather, with its gradient sums in parallel.reduce_dtype


class _Used(NamedTuple):
    """The static part of :func:`used_expert_weight`."""

    embed: tuple[str, ...]  # the axes splitting the weight's model dimension (fsdp)
    replicated: tuple[str, ...]  # the token axes the weight is replicated over (data, context)
    axis: int  # the model dimension
    dtype: Any  # the compute dtype
    sum_dtype: Any  # the gradient sums' (summed_grad_dtype)
    stored_dtype: Any
    ring: bool = False  # gather and reduce-scatter as rings of ppermutes (fsdp_gather)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def used_expert_weight(how: _Used, w: jax.Array) -> jax.Array:
    """This device's experts in the compute dtype, all-gathered over ``how.embed`` (FSDP). The
    backward pass widens the gradient to ``how.sum_dtype`` before the reduce-scatter over
    ``embed`` and the sum over ``replicated`` (autodiff would sum in the compute dtype)."""
    w = w.astype(how.dtype)
    if how.replicated:
        w = lax.pcast(w, how.replicated, to="varying")
    if how.embed and how.ring:
        return ring_all_gather(w, how.embed, how.axis)
    return lax.all_gather(w, how.embed, axis=how.axis, tiled=True) if how.embed else w


def _used_fwd(how: _Used, w: jax.Array) -> tuple[jax.Array, None]:
    return used_expert_weight(how, w), None


def _used_bwd(how: _Used, _: None, dw: jax.Array) -> tuple[jax.Array]:
    dw = dw.astype(how.sum_dtype)
    if how.embed and how.ring:
        dw = ring_reduce_scatter(dw, how.embed, how.axis)
    elif how.embed:
        dw = lax.psum_scatter(dw, how.embed, scatter_dimension=how.axis, tiled=True)
    if how.replicated:
        dw = lax.psum(dw, how.replicated)
    return (dw.astype(how.stored_dtype),)


used_expert_weight.defvjp(_used_fwd, _used_bwd)


# --------------------------------------------------------------------------------------------
# Entry point used by the model's MoE layers


def _split_axes(rules: Mapping[str, tuple[str, ...]], mesh_shape: Mapping[str, int],
                logical: str, allowed: tuple[str, ...]) -> tuple[str, ...]:
    """The mesh axes (size > 1) that split one logical dimension of the expert weights."""
    axes = tuple(a for a in rules[logical] if mesh_shape[a] > 1)
    if not set(axes) <= set(allowed):
        raise ConfigError(f"parallel.rules.{logical}={','.join(rules[logical])}: expert "
                          f"parallelism supports only mesh axes {', '.join(allowed)} here")
    return axes


class _Layout(NamedTuple):
    """How :func:`expert_parallel`'s ``shard_map`` splits a MoE layer's tokens and weights."""

    groups: int  # devices the experts are spread over
    token_axes: tuple[str, ...]  # the axes splitting the tokens (batch axes, context)
    tensor: str | None  # "tensor" where it splits the experts' hidden units
    embed: tuple[str, ...]  # the axes splitting the weights' model dimension (fsdp)
    replicated: tuple[str, ...]  # token axes the weights are replicated over: summed over
    manual: tuple[str, ...]  # the shard_map's axes
    tokens: P  # tokens, expert ids, gates
    w_in: P  # w_gate, w_up [X, E, F]
    w_out: P  # w_down [X, F, E]


def _layout(mesh_shape: Mapping[str, int], rules: Mapping[str, tuple[str, ...]],
            hand_groups: int) -> _Layout:
    groups = hand_groups if hand_groups > 1 else mesh_shape[EXPERT_AXIS]
    if groups > 1 and EXPERT_AXIS not in rules["experts"]:
        raise ConfigError("parallel.rules.experts: mesh.expert > 1 needs the experts dimension "
                          "split over expert")
    batch = tuple(a for a in BATCH_AXES if mesh_shape[a] > 1)
    context = "context" if mesh_shape["context"] > 1 else None
    token_axes = batch + ((context,) if context else ())
    expert_dim = _split_axes(rules, mesh_shape, "experts", (EXPERT_AXIS,))
    embed = _split_axes(rules, mesh_shape, "expert_embed", token_axes)
    # Only when the experts' hidden units are split does tensor need manual handling; otherwise
    # it stays automatic and every tensor shard computes the same (replicated) result.
    tensor = "tensor" if _split_axes(rules, mesh_shape, "mlp", ("tensor",)) else None
    x_dim, e_dim = expert_dim or None, embed or None
    return _Layout(groups, token_axes, tensor, embed,
                   tuple(a for a in token_axes if a not in embed + expert_dim),
                   token_axes + ((tensor,) if tensor else ()),
                   P(batch or None, context, None),
                   P(x_dim, e_dim, tensor), P(x_dim, tensor, e_dim))


def _dispatch(tokens: jax.Array, ids: jax.Array, gates: jax.Array, w: Weights, dispatch: str,
              capacity_factor: float, num_experts: int, groups: int, ragged: bool
              ) -> tuple[jax.Array, dict]:
    """One device's routed tokens through the experts, exchanged over ``groups`` devices: capacity
    buffer (dropping), or dropless with ragged or padded all-to-alls."""
    if dispatch == "dropping":
        return dropping_experts(tokens, ids, gates, w, capacity_factor, num_experts=num_experts,
                                exchange=_exchange if groups > 1 else None)
    if groups == 1:
        return dropless_experts(tokens, ids, gates, w)
    if ragged:
        return ragged_dropless(tokens, ids, gates, w, num_experts, groups)
    return padded_dropless(tokens, ids, gates, w, num_experts, groups)


def _dispatch_in_chunks(chunks: int, tokens: jax.Array, ids: jax.Array, gates: jax.Array,
                        *rest: Any) -> tuple[jax.Array, dict]:
    """:func:`_dispatch` over ``chunks`` equal runs of tokens in turn: one chunk's all-to-alls may
    overlap another's experts (MaxText's ``num_moe_token_chunks``), and buffers shrink."""
    if chunks == 1:
        return _dispatch(tokens, ids, gates, *rest)
    if tokens.shape[0] % chunks:
        raise ConfigError(f"parallel.expert_pieces={chunks} does not divide the "
                          f"{tokens.shape[0]} tokens a device routes in a MoE layer")
    parts = [_dispatch(*part, *rest) for part in
             zip(*(jnp.split(a, chunks) for a in (tokens, ids, gates)), strict=True)]
    stats = {name: sum(p[1][name] for p in parts) for name in parts[0][1]}
    return jnp.concatenate([p[0] for p in parts]), stats


def expert_parallel(mesh_shape: Mapping[str, int], rules: Mapping[str, tuple[str, ...]], *,
                    platform: str = "cpu", ragged: bool | None = None,
                    hand_groups: int = 1, chunks: int = 1, ring: bool = False) -> Experts:
    """The ``experts(x, expert_ids, gates, weights, *, dispatch, capacity_factor)`` hook: routing
    per device in ``shard_map`` (manual over the token axes and ``tensor``), all-to-alls over
    ``expert`` when it has several devices.

    - ``weights`` arrive as stored; each device gathers its experts' ``embed`` split, as FSDP.
    - ``ragged``: dropless uses ``ragged_all_to_all`` (off the platforms in
      :data:`jaxpar.platform.PADDED_ALL_TO_ALL_PLATFORMS`), else the padded ``all_to_all``.
    - ``hand_groups`` > 1: ``expert`` is already manual (a pipeline stage); no ``shard_map``
      opens unless ``tensor`` splits the experts.
    - ``chunks`` > 1 (``parallel.expert_pieces``): :func:`_dispatch_in_chunks`.
    - ``ring`` (``parallel.fsdp_gather``): gather and gradient reduce-scatter as rings of sends.
    """
    lay = _layout(mesh_shape, rules, hand_groups)
    groups, token_axes, tensor, embed, replicated = (lay.groups, lay.token_axes, lay.tensor,
                                                      lay.embed, lay.replicated)
    if ragged is None:
        ragged = platform not in workarounds.PADDED_ALL_TO_ALL_PLATFORMS
    wide_sums = platform in workarounds.FLOAT32_TENSOR_SUM_PLATFORMS
    nested = hand_groups > 1  # inside the pipeline executor's shard_map

    def experts(x: jax.Array, expert_ids: jax.Array, gates: jax.Array, weights: Weights, *,
                dispatch: str, capacity_factor: float) -> tuple[jax.Array, dict]:
        num_experts = expert_count(weights[0]) * hand_groups  # (by hand: this device's)
        dtypes = (jnp.dtype(x.dtype), summed_grad_dtype(x.dtype),
                  jnp.dtype(jax.tree.leaves(weights[0])[0].dtype))

        def gathered(w, axis: int):
            return _gathered(w, axis, embed, replicated, dtypes, ring)

        def local(x, expert_ids, gates, w_gate, w_up, w_down):
            b, s, e = x.shape
            k = expert_ids.shape[-1]
            tokens = x.reshape(b * s, e).astype(dtypes[0])
            ids, g = expert_ids.reshape(b * s, k), gates.reshape(b * s, k)
            if tensor and not nested:  # backward: one all-reduce of d(tokens) over tensor,
                tokens = _tensor_varying(tokens, tensor, wide_sums)  # not one per slot
            w = (gathered(w_gate, 1), gathered(w_up, 1), gathered(w_down, 2))
            y, stats = _dispatch_in_chunks(chunks, tokens, ids, g, w, dispatch,
                                           capacity_factor, num_experts, groups, ragged)
            if tensor:  # the experts' hidden units were split: sum the partial outputs
                y = _tensor_sum(y, tensor, wide_sums, unchecked=nested)
            if token_axes:  # global counts: every device reports the same numbers. (A count
                # that is the same on every device, such as a buffer size, is multiplied by the
                # number of devices: psum of a value invariant over an axis.)
                stats = {name: lax.psum(v, token_axes) for name, v in stats.items()}
            return y.reshape(b, s, e), stats

        if not lay.manual:  # every axis it needs is manual already (split by hand)
            return local(x, expert_ids, gates, *weights)
        stats_specs = {"dropped": P(), "a2a_rows": P(), "a2a_padding": P()}
        # Nested in the pipeline executor's shard_map, whose values carry no varying-axes
        # types, this one cannot check them either. Without the types, the boundary sums the
        # tokens' gradient over tensor itself (they enter whole over it; psum's transpose
        # then passes its cotangent through): in float32 where the sums must be, so the
        # tokens enter in float32.
        entering = x.astype(jnp.float32) if nested and wide_sums else x
        w_specs = tuple(_weight_spec(w, spec) for w, spec in
                        zip(weights, (lay.w_in, lay.w_in, lay.w_out), strict=True))
        return jax.shard_map(
            local, in_specs=(lay.tokens, lay.tokens, lay.tokens, *w_specs),
            out_specs=(lay.tokens, stats_specs), axis_names=frozenset(lay.manual),
            check_vma=not nested,
        )(entering, expert_ids, gates, *weights)

    return experts


def _gathered(w, axis: int, embed: tuple[str, ...], replicated: tuple[str, ...],
              dtypes: tuple, ring: bool) -> Any:
    """An expert weight as used, or an adapted (w, A, B) with A and B gathered on the side that
    has the model dimension."""
    def one(w: jax.Array, axis: int | None) -> jax.Array:
        how = (_Used(embed, replicated, axis, *dtypes, ring) if axis is not None else
               _Used((), replicated + embed, 0, *dtypes))
        if not (how.embed or how.replicated):  # nothing to gather or sum: the weight itself,
            return w.astype(dtypes[0])  # which a pipeline stage's stash then leaves out
        return used_expert_weight(how, w)

    if not isinstance(w, tuple):
        return one(w, axis)
    w, a, b = w  # A shares the weight's input axes, B its output axes
    return one(w, axis), one(a, axis if axis == 1 else None), one(b, axis if axis == 2 else None)


def _weight_spec(w, spec: P):
    """The ``shard_map`` spec of an expert weight, or of an adapted triple (w, A, B)."""
    if not isinstance(w, tuple):
        return spec
    return spec, P(spec[0], spec[1], None), P(spec[0], None, spec[2])


def _tensor_varying(x: jax.Array, tensor: str, wide: bool) -> jax.Array:
    """``x`` marked varying over ``tensor``; its gradient is summed over ``tensor`` (in float32
    where ``wide``)."""
    if not wide:
        return lax.pcast(x, tensor, to="varying")
    return lax.pcast(x.astype(jnp.float32), tensor, to="varying").astype(x.dtype)


def _tensor_sum(y: jax.Array, tensor: str, wide: bool, unchecked: bool) -> jax.Array:
    """``psum`` of ``y`` over ``tensor`` (float32 where ``wide``).

    ``unchecked`` (``check_vma=False``, ``tensor`` not in the output spec): autodiff would
    all-reduce a cotangent equal on every device; :func:`_sum_of_replicated` multiplies instead.
    """
    total = _sum_of_replicated if unchecked else lax.psum
    if not wide:
        return total(y, tensor)
    return total(y.astype(jnp.float32), tensor).astype(y.dtype)


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def _sum_of_replicated(y: jax.Array, axis: str) -> jax.Array:
    """``psum`` over ``axis`` of a result whose cotangent is equal on every device: axis size
    times it, no all-reduce."""
    return lax.psum(y, axis)


def _sum_of_replicated_fwd(y: jax.Array, axis: str) -> tuple[jax.Array, None]:
    return lax.psum(y, axis), None


def _sum_of_replicated_bwd(axis: str, _: None, ct: jax.Array) -> tuple[jax.Array]:
    return (ct * lax.axis_size(axis),)


_sum_of_replicated.defvjp(_sum_of_replicated_fwd, _sum_of_replicated_bwd)
