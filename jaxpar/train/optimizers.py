"""Optimizers (``train.optimizer``), learning-rate schedules (``train.lr_schedule``) and the
optimizer state's storage dtype (``train.opt_state_dtype``), through optax.

Every optimizer runs after global-norm clipping on float32 copies (:func:`in_float32`); a
bfloat16 state is widened per update (:func:`stored_state`). ``adamw``, ``adafactor``,
``lion``: optax's; ``muon``: Muon on stacked layer matrices, AdamW elsewhere. The state's
layout without optax: :mod:`jaxpar.parallel.optimizer_state`. Details: docs/optimizers.md.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from optax.contrib import MuonDimensionNumbers, MuonState, scale_by_muon

# optax exports scale_by_muon but not its Newton-Schulz function, which _scale_by_muon needs to
# lay the matrices out itself before the iterations (same function, so the same numbers).
from optax.contrib._muon import orthogonalize_via_newton_schulz

from jaxpar.config import TrainConfig
from jaxpar.parallel.optimizer_state import (
    ADAFACTOR_MIN_DIM,
    MUON_NS_STEPS,
    MuonLayout,
    muon_matrix_axes,
)

MUON_BETA = 0.95  # Muon's momentum (its authors' value)


# --------------------------------------------------------------------------------------------
# Schedules


def learning_rate_schedule(t: TrainConfig) -> optax.Schedule:
    """``train.lr_schedule`` after ``train.warmup_steps`` of linear warm-up from 0: ``cosine``
    decays to ``lr * min_lr_ratio`` at ``steps``; ``wsd`` holds ``lr``, then decays linearly over
    the last ``decay_fraction`` (:func:`wsd_value`); ``constant`` stays. Optimizer step k
    (1-based) uses the schedule at k, so the first step moves the parameters."""
    if t.lr_schedule == "cosine":
        base = optax.warmup_cosine_decay_schedule(
            init_value=0.0, peak_value=t.lr, warmup_steps=t.warmup_steps,
            decay_steps=max(t.steps, t.warmup_steps + 1), end_value=t.lr * t.min_lr_ratio)
        return lambda count: base(count + 1)
    start = wsd_decay_start(t) if t.lr_schedule == "wsd" else t.steps
    end = t.lr * (t.min_lr_ratio if t.lr_schedule == "wsd" else 1.0)

    def schedule(count: jax.Array) -> jax.Array:
        s = jnp.asarray(count, jnp.float32) + 1
        warm = t.lr * s / max(t.warmup_steps, 1)
        frac = jnp.clip((s - start) / max(t.steps - start, 1), 0.0, 1.0)
        after = t.lr + (end - t.lr) * frac
        return jnp.where(s < t.warmup_steps, warm, after)

    return schedule


def wsd_decay_start(t: TrainConfig) -> int:
    """The step after which ``wsd`` decays: the last ``round(decay_fraction * steps)`` (at least
    one), never during warm-up."""
    return max(t.steps - max(1, round(t.decay_fraction * t.steps)), t.warmup_steps)


def wsd_value(t: TrainConfig, step: int) -> float:
    """The ``wsd`` learning rate of optimizer step ``step`` (1-based), in plain Python."""
    if step < t.warmup_steps:
        return t.lr * step / t.warmup_steps
    start = wsd_decay_start(t)
    if step <= start:
        return t.lr
    frac = min(1.0, (step - start) / max(t.steps - start, 1))
    return t.lr * (1 - frac * (1 - t.min_lr_ratio))


# --------------------------------------------------------------------------------------------
# Which parameters get what


def decays(name: str) -> bool:
    """Weight decay on every parameter but norm scales and biases."""
    return "norm" not in name and not name.endswith("_bias")


def muon_dimensions(name: str, names: Sequence[str | None]) -> MuonDimensionNumbers | None:
    """A parameter's matrix axes as optax's dimension numbers; None: AdamW's."""
    axes = muon_matrix_axes(name, names)
    return None if axes is None else MuonDimensionNumbers(reduction_axis=axes[0],
                                                          output_axis=axes[1])


# --------------------------------------------------------------------------------------------
# The transformation


def make_optimizer(t: TrainConfig, logical_axes: Mapping | None = None,
                   muon_specs: Mapping | None = None) -> optax.GradientTransformation:
    """``train.optimizer`` after clipping, in float32, state stored in ``train.opt_state_dtype``.
    Muon alone needs ``logical_axes`` and ``muon_specs`` (a
    :class:`~jaxpar.parallel.optimizer_state.MuonLayout` per matrix; None: the partitioner's)."""
    from jaxpar.parallel.rules import param_name  # noqa: PLC0415

    def decay_mask(params: dict) -> dict:
        return jax.tree_util.tree_map_with_path(lambda path, _: decays(param_name(path)), params)

    lr = learning_rate_schedule(t)
    parts = [optax.clip_by_global_norm(t.grad_clip)] if t.grad_clip > 0 else []
    if t.optimizer == "adamw":
        parts.append(optax.adamw(lr, b1=t.b1, b2=t.b2, eps=t.eps,
                                 weight_decay=t.weight_decay, mask=decay_mask))
    elif t.optimizer == "lion":
        parts.append(optax.lion(lr, b1=t.b1, b2=t.b2, weight_decay=t.weight_decay,
                                mask=decay_mask))
    elif t.optimizer == "adafactor":
        # optax adds weight_decay_rate x parameter after the learning rate: a schedule of
        # lr x weight_decay makes it the decoupled decay the other optimizers apply.
        parts.append(optax.adafactor(
            lr, min_dim_size_to_factor=ADAFACTOR_MIN_DIM, weight_decay_mask=decay_mask,
            weight_decay_rate=(lambda count: t.weight_decay * lr(count)) if t.weight_decay
            else None))
    elif t.optimizer == "muon":
        if logical_axes is None:
            raise ValueError("train.optimizer=muon needs the parameters' logical axes")
        parts.append(_muon(t, lr, logical_axes, decay_mask, muon_specs))
    else:
        raise ValueError(f"unknown train.optimizer {t.optimizer}")
    return in_float32(stored_state(optax.chain(*parts), t.opt_state_dtype))


def _muon(t: TrainConfig, lr: optax.Schedule, logical_axes: Mapping,
          decay_mask: Any, specs: Mapping | None) -> optax.GradientTransformation:
    """Muon on the stacked layer matrices, AdamW (no decay on norms) on the rest."""
    from jaxpar.parallel.rules import is_axes_leaf, param_name  # noqa: PLC0415

    dims = jax.tree_util.tree_map_with_path(
        lambda path, names: muon_dimensions(param_name(path), names), logical_axes,
        is_leaf=is_axes_leaf)
    labels = jax.tree.map(lambda d: "adamw" if d is None else "muon", dims,
                          is_leaf=lambda x: x is None or isinstance(x, MuonDimensionNumbers))

    def muon_dims(updates: Any) -> Any:
        # Muon's half sees optax.MaskedNode()s in place of AdamW's parameters.
        return jax.tree.map(lambda d, _: d if d is not None else optax.MaskedNode(), dims, labels,
                            is_leaf=lambda x: x is None or isinstance(x, MuonDimensionNumbers))

    muon = optax.chain(
        _scale_by_muon(t.eps, muon_dims, specs),
        _scale_by_matrix_shape(muon_dims),
        optax.add_decayed_weights(t.weight_decay),
        optax.scale_by_learning_rate(lr))
    adam = optax.adamw(lr, b1=t.b1, b2=t.b2, eps=t.eps, weight_decay=t.weight_decay,
                       mask=decay_mask)
    return optax.partition({"muon": muon, "adamw": adam}, labels)


def _scale_by_muon(eps: float, dims_fn: Any, specs: Mapping | None
                   ) -> optax.GradientTransformation:
    """optax's ``scale_by_muon`` (Nesterov momentum, then Newton-Schulz; same state and numbers),
    iterations laid out per ``specs``: owner-computes, or gathered through ``layout.stages``. Left
    to the partitioner they reshard between matmuls (docs/optimizers.md)."""
    base = scale_by_muon(beta=MUON_BETA, eps=eps, ns_steps=MUON_NS_STEPS, nesterov=True,
                         weight_dimension_numbers=dims_fn)
    if specs is None:
        return base
    beta = MUON_BETA
    is_dims = lambda x: isinstance(x, MuonDimensionNumbers)  # noqa: E731

    def update(updates: Any, state: MuonState, params: Any = None) -> tuple[Any, MuonState]:
        del params
        # optax's scale_by_muon update, nesterov=True, mu_dtype=None, step for step (the
        # version copied: docs/optimizers.md, "What Muon's Newton-Schulz iterations cost").
        mu = optax.tree.update_moment(updates, state.mu, beta, 1)
        count = optax.safe_increment(state.count)
        mu_hat = jax.tree.map(lambda m, g: beta * m + (1 - beta) * g,
                              optax.tree.bias_correction(mu, beta, optax.safe_increment(count)),
                              optax.tree.bias_correction(updates, beta, count))

        def orthogonalize(x: jax.Array, d: MuonDimensionNumbers, layout: MuonLayout
                          ) -> jax.Array:
            if layout.owners:
                return _owner_newton_schulz(x, d, layout, state.ns_coeffs, eps)
            stages = layout.stages
            for spec in stages:
                x = jax.lax.with_sharding_constraint(x, spec)
            out = _newton_schulz(x, d, state.ns_coeffs, eps)
            # Whole on the way out too, or the partitioner splits the last iterations after
            # the parameter's layout (and reshards between them).
            return jax.lax.with_sharding_constraint(out, stages[-1])

        out = jax.tree.map(orthogonalize, mu_hat, dims_fn(updates), _masked_like(specs, updates),
                           is_leaf=is_dims)
        return out, MuonState(count=count, mu=mu, ns_coeffs=state.ns_coeffs)

    return optax.GradientTransformation(base.init, update)


def _newton_schulz(x: jax.Array, d: MuonDimensionNumbers, coeffs: jax.Array,
                   eps: float) -> jax.Array:
    """optax's orthogonalisation, vmapped over the leading batch axes one at a time (optax's
    flattened [layers x experts] would lose the ``expert`` split)."""
    matrix = (*d.reduction_axis, *d.output_axis)
    batch = x.ndim - len(matrix)
    # One batch axis: optax's own flattening (it keeps the split; and XLA:CPU's compiled peak
    # for it is half that of the vmapped form). Else jaxpar's [layers, experts, ...] vmapped.
    if batch < 2 or sorted(matrix) != list(range(batch, x.ndim)):
        return orthogonalize_via_newton_schulz(x, coeffs, MUON_NS_STEPS, "frobenius", eps, d)
    inner = MuonDimensionNumbers(reduction_axis=tuple(a - batch for a in d.reduction_axis),
                                 output_axis=tuple(a - batch for a in d.output_axis))

    def one(m: jax.Array) -> jax.Array:
        return orthogonalize_via_newton_schulz(m, coeffs, MUON_NS_STEPS, "frobenius", eps,
                                               inner)

    for _ in range(batch):
        one = jax.vmap(one)
    return one(x)


def _owner_newton_schulz(x: jax.Array, d: MuonDimensionNumbers, layout: MuonLayout,
                         coeffs: jax.Array, eps: float) -> jax.Array:
    """Owner-computes: in each group of ``layout.owners``, an all-to-all gives each device whole
    matrices of its share; it iterates; a second sends each its pieces back
    (docs/optimizers.md)."""
    owners, held = layout.owners, tuple(layout.held)
    matrix = (*d.reduction_axis, *d.output_axis)
    nb = x.ndim - len(matrix)  # the leading batch axes
    # For each matrix axis, the owner axes splitting it (major first), as positions in owners.
    splits = [[owners.index(a) for a in ((e,) if isinstance(e, str) else e or ()) if a in owners]
              for e in held[nb:]]
    inner = MuonDimensionNumbers(reduction_axis=tuple(a - nb + 1 for a in d.reduction_axis),
                                 output_axis=tuple(a - nb + 1 for a in d.output_axis))

    def local(xl: jax.Array) -> jax.Array:
        sizes = [jax.lax.axis_size(a) for a in owners]
        k, b, piece = math.prod(sizes), math.prod(xl.shape[:nb]), xl.shape[nb:]
        c = -(-b // k)
        y = xl.reshape(b, *piece)
        y = jnp.pad(y, [(0, c * k - b)] + [(0, 0)] * len(piece))
        # Block j of the entries to device j of the group; received blocks in sender order.
        y = jax.lax.all_to_all(y, owners, 0, 0, tiled=True)
        y = y.reshape(*sizes, c, *piece)
        n = len(owners)
        order = [n] + [p for i, s in enumerate(splits) for p in (*s, n + 1 + i)]
        whole = [math.prod(sizes[p] for p in s) * piece[i] for i, s in enumerate(splits)]
        y = y.transpose(order).reshape(c, *whole)
        y = _newton_schulz(y, inner, coeffs, eps)
        y = y.reshape(c, *[dim for i, s in enumerate(splits)
                           for dim in (*[sizes[p] for p in s], piece[i])])
        y = y.transpose([order.index(j) for j in range(len(order))])
        y = jax.lax.all_to_all(y.reshape(k * c, *piece), owners, 0, 0, tiled=True)
        return y[:b].reshape(xl.shape)

    manual = frozenset(a for e in held for a in ((e,) if isinstance(e, str) else e or ()))
    return jax.shard_map(local, in_specs=(layout.held,), out_specs=layout.held,
                         axis_names=manual)(x)


def _masked_like(specs: Mapping, updates: Any) -> Any:
    """``specs`` (PartitionSpecs per Muon matrix, None elsewhere) with optax.MaskedNode()s where
    ``updates`` has them."""
    return jax.tree.map(lambda s, u: optax.MaskedNode() if isinstance(u, optax.MaskedNode) else s,
                        specs, updates,
                        is_leaf=lambda x: x is None or isinstance(x, (tuple,
                                                                     optax.MaskedNode)))


def _scale_by_matrix_shape(dims_fn: Any) -> optax.GradientTransformation:
    """Muon's update scale ``sqrt(max(1, fan_out / fan_in))``, keeping wide matrices' update RMS
    up."""

    def scale(u: jax.Array, d: MuonDimensionNumbers) -> jax.Array:
        fan_in = math.prod(u.shape[i] for i in d.reduction_axis)
        fan_out = math.prod(u.shape[i] for i in d.output_axis)
        return u * math.sqrt(max(1.0, fan_out / fan_in))

    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        del params
        return jax.tree.map(scale, updates, dims_fn(updates),
                            is_leaf=lambda x: isinstance(x, MuonDimensionNumbers)), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


# --------------------------------------------------------------------------------------------
# Dtypes of the update and of the state


def as_float32(tree: Any) -> Any:
    return jax.tree.map(lambda a: a.astype(jnp.float32), tree)


def in_float32(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """``tx`` on float32 copies of gradients and parameters: moments, clipping norm and update
    are float32 whatever ``train.param_dtype``. No float32 master copy
    (docs/mixed-precision.md)."""

    def update(grads: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        return tx.update(as_float32(grads), state,
                         None if params is None else as_float32(params))

    return optax.GradientTransformation(lambda params: tx.init(as_float32(params)), update)


def per_parameter(path: Sequence[Any]) -> bool:
    """Whether a state leaf at ``path`` is per parameter: its path ends in a dict key; counters
    and Muon's coefficients end in an attribute."""
    return bool(path) and isinstance(path[-1], jax.tree_util.DictKey)


def cast_state(state: Any, dtype: Any) -> Any:
    """The per-parameter floating arrays of ``state`` in ``dtype``; the rest as they are."""
    return jax.tree_util.tree_map_with_path(
        lambda path, a: a.astype(dtype)
        if per_parameter(path) and jnp.issubdtype(a.dtype, jnp.floating) else a, state)


def stored_state(tx: optax.GradientTransformation, dtype: str) -> optax.GradientTransformation:
    """``tx`` with per-parameter state stored in ``dtype``, widened to float32 per update."""
    if dtype == "float32":
        return tx
    stored = jnp.dtype(dtype)

    def update(grads: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        updates, state = tx.update(grads, cast_state(state, jnp.float32), params)
        return updates, cast_state(state, stored)

    return optax.GradientTransformation(lambda params: cast_state(tx.init(params), stored),
                                        update)
