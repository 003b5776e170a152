"""A pipeline chunk run one layer at a time, and a round's forward and backward in one loop.

Two modes run a slot's chunk as a ``lax.scan`` of one layer under ``jax.vjp``:
``parallel.pipeline_fsdp=per_layer`` (each layer gathered as it runs,
:class:`~jaxpar.parallel.pipeline.per_layer.LayerFsdp`) and ``parallel.pipeline_overlap=true``
(:func:`layer_forward_backward`: one microbatch's forward beside another's backward, so one's
collectives may hide behind the other's matmuls). Why, and the cost: docs/pipelines.md,
"Forward and backward in one layer loop".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxpar.parallel.pipeline.backward_split import SplitBackward, split_backward
from jaxpar.parallel.pipeline.per_layer import LayerFsdp
from jaxpar.parallel.pipeline.stages import Residuals, Stages


@dataclass(frozen=True)
class LayerWeights:
    """How a layer-by-layer slot reads a layer's weights and returns its gradient: gathered and
    reduce-scattered at once (``fsdp``), or sliced from the stage's prepared weights; the
    gradient in the stored layout, float32."""

    stages: Stages
    fsdp: LayerFsdp | None = None

    def take(self, stored: Any) -> Any:
        """One layer's slice -> its weights as a one-unit stack ``[1, ...]``."""
        if self.fsdp is not None:
            return self.fsdp.gathered(stored)
        return jax.tree.map(lambda a: a[None], stored)

    def give(self, grad: Any) -> Any:
        """The gradient w.r.t. :meth:`take`'s weights -> the layer's, float32, stored layout."""
        if self.fsdp is not None:
            return self.fsdp.scattered(grad)
        return jax.tree.map(lambda g: g[0].astype(jnp.float32), self.stages.unprepare(grad))

    def leaves(self, stored: Any, const: Any) -> list:
        """What a layer's VJP holds of its weights (left out of the stash)."""
        return jax.tree.leaves((self.take(stored), {}, _units(const)))


def _objective(stages: Stages, shared: dict, consts: Any, mb: dict):
    def run(layer: Any, x: jax.Array) -> tuple:
        y, aux = stages.layers(shared, layer, consts, x, mb)
        return (y, stages.aux_loss(aux)), aux
    return run


def _units(tree: Any) -> Any:
    return jax.tree.map(lambda a: a[None], tree)


def _flipped(tree: Any) -> Any:
    return jax.tree.map(lambda a: a[::-1], tree)


# --------------------------------------------------------------------------------------------
# One layer of each slot kind


def _forward_one(lw: LayerWeights, residuals: Residuals, shared: dict, mb: dict, x: jax.Array,
                 stored: Any, const: Any) -> tuple[jax.Array, tuple[list, dict]]:
    layer, const = lw.take(stored), _units(const)
    (y, _), vjp_fn, aux = jax.vjp(_objective(lw.stages, shared, const, mb), layer, x,
                                  has_aux=True)
    return y, (residuals.split(vjp_fn, jax.tree.leaves((layer, {}, const))), aux)


def _backward_one(lw: LayerWeights, residuals: Residuals, dy: jax.Array,
                  aux_cotangent: jax.Array, stored: Any, const: Any, stash: list,
                  ) -> tuple[jax.Array, Any]:
    vjp_fn = residuals.join(stash, lw.leaves(stored, const))
    d_layer, dx = vjp_fn((dy, aux_cotangent))
    return dx, lw.give(d_layer)


def _input_one(lw: LayerWeights, split: SplitBackward, dy: jax.Array, aux_cotangent: jax.Array,
               stored: Any, const: Any, stash: list) -> tuple[jax.Array, list]:
    return split.input_part((stash, lw.leaves(stored, const)), (dy, aux_cotangent))


def _stacked_aux(stages: Stages, aux: dict) -> dict:
    """One row per layer for layer-stacked statistics; the rest summed over layers."""
    return {k: a.reshape(-1, *a.shape[2:]) if k in stages.layer_stacked else jnp.sum(a, axis=0)
            for k, a in aux.items()}


# --------------------------------------------------------------------------------------------
# Slots


def layer_forward(lw: LayerWeights, residuals: Residuals, shared: dict, chunk: Any, consts: Any,
                  x: jax.Array, mb: dict) -> tuple[tuple[jax.Array, dict], list]:
    """A chunk's layers on ``x`` one at a time -> ((y, aux), stashable residuals
    ``[layers, ...]``). ``residuals`` splits a VJP into what waits in the stash."""
    def one(x: jax.Array, xs: tuple) -> tuple:
        return _forward_one(lw, residuals, shared, mb, x, *xs)

    y, (stash, aux) = lax.scan(one, x, (chunk, consts))
    return (y, _stacked_aux(lw.stages, aux)), stash


def added(sums: Any, on: jax.Array, at: Any, grads: Any) -> Any:
    """``sums`` (float32, ``[chunks, layers, ...]``) plus ``grads`` at ``at`` where ``on``."""
    return jax.tree.map(
        lambda acc, g: acc.at[at].add(jnp.where(on, g, jnp.zeros_like(g)).astype(acc.dtype)),
        sums, grads)


def _rows(chunk: Any) -> jax.Array:
    """0 .. chunk layers - 1: the sums' row each loop iteration adds to."""
    return jnp.arange(jax.tree.leaves(chunk)[0].shape[0])


def layer_backward(lw: LayerWeights, residuals: Residuals, chunk: Any, consts: Any,
                   stashed: list, dy: jax.Array, aux_cotangent: jax.Array, sums: Any,
                   j: jax.Array, on: jax.Array) -> tuple[Any, jax.Array]:
    """(``sums`` plus chunk ``j``'s weight gradients where ``on``; input gradient), layers in
    reverse from the stashed residuals. Gradients are added inside the loop, avoiding a second
    sums-sized buffer (docs/pipelines.md, "FSDP layer by layer")."""
    def one(carry: tuple, xs: tuple) -> tuple:
        dy, sums = carry
        row, *layer = xs
        dx, d_layer = _backward_one(lw, residuals, dy, aux_cotangent, *layer)
        return (dx, added(sums, on, (j, row), d_layer)), None

    (dx, sums), _ = lax.scan(one, (dy, sums), (_rows(chunk), chunk, consts, stashed),
                             reverse=True)
    return sums, dx


def layer_backward_input(lw: LayerWeights, split: SplitBackward, chunk: Any, consts: Any,
                         stashed: list, dy: jax.Array, aux_cotangent: jax.Array,
                         ) -> tuple[jax.Array, list]:
    """An I, layers in reverse: the input gradient, and what each W needs ``[layers, ...]``."""
    def one(dy: jax.Array, xs: tuple) -> tuple:
        return _input_one(lw, split, dy, aux_cotangent, *xs)

    return lax.scan(one, dy, (chunk, consts, stashed), reverse=True)


def layer_backward_weights(lw: LayerWeights, split: SplitBackward, chunk: Any, consts: Any,
                           stashed: list, crossing: list, sums: Any, j: jax.Array,
                           on: jax.Array) -> Any:
    """A W, layer by layer: ``sums`` plus each layer's weight gradients where ``on``. Under FSDP
    a layer is gathered again only where its W reads its weights (LoRA)."""
    reads_weights = any(split.primal_reads[len(stashed):])

    def one(sums: Any, xs: tuple) -> tuple:
        row, stored, const, stash, crossed = xs
        if reads_weights:
            weights = lw.leaves(stored, const)
        else:  # W reads none of them: placeholders, not a gather
            weights = [jnp.zeros(w.shape, w.dtype)
                       for w in jax.eval_shape(lambda: lw.leaves(stored, const))]
        d_layer = lw.give(split.weight_part((stash, weights), crossed))
        return added(sums, on, (j, row), d_layer), None

    sums, _ = lax.scan(one, sums, (_rows(chunk), chunk, consts, stashed, crossing))
    return sums


def layer_forward_backward(lw: LayerWeights, residuals: Residuals, split: SplitBackward | None,
                           shared: dict, forward: tuple, x: jax.Array, mb: dict,
                           backward: tuple, dy: jax.Array, aux_cotangent: jax.Array) -> tuple:
    """A round's forward and backward slots in one loop: iteration ``k`` runs forward layer ``k``
    and backward layer ``L-1-k`` (``split``: an I). ``forward``: (layers, consts); ``backward``:
    (layers, consts, residuals). Returns ((y, aux), residuals to stash, weight gradients or what
    the W needs ``[layers, ...]``, dx)."""
    def one(carry: tuple, xs: tuple) -> tuple:
        x, dy = carry
        forward_layer, backward_layer = xs
        y, made = _forward_one(lw, residuals, shared, mb, x, *forward_layer)
        if split is None:
            dx, out = _backward_one(lw, residuals, dy, aux_cotangent, *backward_layer)
        else:
            dx, out = _input_one(lw, split, dy, aux_cotangent, *backward_layer)
        return (y, dx), (made, out)

    (y, dx), ((stash, aux), out) = lax.scan(one, (x, dy), (forward, _flipped(backward)))
    return (y, _stacked_aux(lw.stages, aux)), stash, _flipped(out), dx


def layer_split(lw: LayerWeights, residuals: Residuals, chunk: tuple, res_shapes: list,
                dy: jax.ShapeDtypeStruct, aux: jax.ShapeDtypeStruct) -> SplitBackward:
    """One layer's backward cut into I and W, traced on abstract values (residuals without the
    layer dim, weights, output and aux cotangents). ``chunk``: (layers as read, frozen,
    consts)."""
    stored, _, consts = chunk
    weights = [jax.ShapeDtypeStruct(w.shape, w.dtype) for w in jax.eval_shape(
        lambda s, c: lw.leaves(jax.tree.map(lambda a: a[0], s), jax.tree.map(
            lambda a: a[0], c)), stored, consts)]
    stashed = [jax.ShapeDtypeStruct(r.shape[1:], r.dtype) for r in res_shapes]

    def backward(primals, cotangents):
        return residuals.join(*primals)(cotangents)

    return split_backward(backward, (stashed, weights), (dy, aux))
