"""FSDP inside pipeline stages layer by layer (``parallel.pipeline_fsdp=per_layer``).

The default (``per_step``, :mod:`jaxpar.parallel.pipeline.executor`) gathers a stage's weights
whole over ``fsdp`` once per step and sums its weight gradients whole in float32 until the
step's one reduce-scatter: ``L_s`` layers of weights (compute dtype) and of float32 sums on
every device for the whole step (``L_s``: the stage's layers).

Here a slot runs its chunk's layers as a ``lax.scan`` of its own, one layer per iteration:

- forward slot: all-gather layer ``l``'s stored shard over ``fsdp`` (cast to the compute dtype
  first: ``(f-1)/f`` of the layer's weights in that dtype arrive per device), run the layer
  under ``jax.vjp`` and stash its residuals, less the gathered weights (the very arrays passed
  in, which the stash leaves out as the executor's does);
- backward slot (``B``, or ``I`` then ``W``), layers in reverse: gather layer ``l`` again,
  rebuild its VJP from the stash and the gathered weights, pull the gradient through, and
  reduce-scatter the layer's weight gradient over ``fsdp`` at once (in
  ``parallel.reduce_dtype``: ``(f-1)/f`` of the layer's weights in that dtype leave per
  device) into float32 sums held in the stored split.

So a device holds one layer whole at a time (its weights and their gradient), and float32
sums of ``1/f`` of the stage's weights. The price, per executed slot (masked ones run too: the
one-program rule), over ``fsdp``: one gather of every layer of the chunk per forward slot, one
per backward slot (an ``I`` and its ``W`` run as one ``B`` where the executor fuses them, else
``W`` gathers again), and one reduce-scatter per slot that adds weight gradients (``B``,
``W``). The one all-reduce per step over the other axes split by hand (``data``, ``context``,
``expert``) stays, on the sharded sums. All these collectives sit in the scans' bodies, never
under a conditional.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

from jaxpar.parallel.manual import ByHand
from jaxpar.parallel.pipeline.backward_split import SplitBackward, split_backward
from jaxpar.parallel.pipeline.stages import Residuals, Stages


def _one_layer(specs: Any) -> Any:
    """Stacked specs ``[layers, ...]`` -> one layer's, with the two unit dimensions the stages'
    prepare reads (``[chunk, layer, ...]``, both of size 1) unsplit."""
    return jax.tree.map(lambda s: PartitionSpec(None, None, *tuple(s)[1:]), specs,
                        is_leaf=lambda x: isinstance(x, PartitionSpec))


@dataclass(frozen=True)
class LayerFsdp:
    """One layer's gather over ``fsdp`` and its gradient's reduce-scatter (module docstring).

    ``specs``/``auto_specs``: the stacked layers' splits over the axes split by hand and over
    the automatic ones (:class:`ByHand`'s ``layer_specs``/``auto_layer_specs``)."""

    by_hand: ByHand
    stages: Stages
    specs: Any
    auto_specs: Any

    @classmethod
    def of(cls, by_hand: ByHand, stages: Stages) -> LayerFsdp:
        return cls(by_hand, stages, _one_layer(by_hand.layer_specs),
                   _one_layer(by_hand.auto_layer_specs))

    def gathered(self, shard: Any) -> Any:
        """A layer's stored shard -> its weights as a one-unit stack ``[1, ...]``, cast to the
        compute dtype before the all-gather (half the bytes in bf16), laid out for use."""
        prepare = self.stages.prepare
        units = jax.tree.map(lambda a: a[None, None], shard)
        whole = prepare(self.by_hand.gather(prepare(units), self.specs, self.auto_specs))
        return jax.tree.map(lambda a: a[0], whole)

    def scattered(self, grad: Any) -> Any:
        """The gradient w.r.t. :meth:`gathered`'s weights -> float32, reduce-scattered over
        ``fsdp`` to the stored shard (no all-reduce over the other axes yet)."""
        stored = self.stages.unprepare(grad)
        summed = self.by_hand.reduce(jax.tree.map(lambda g: g[None], stored), self.specs,
                                     self.auto_specs, replicas=False)
        return jax.tree.map(lambda g: g[0, 0].astype(jnp.float32), summed)


def _objective(stages: Stages, shared: dict, consts: Any, mb: dict):
    def run(layer: Any, x: jax.Array) -> tuple:
        y, aux = stages.layers(shared, layer, consts, x, mb)
        return (y, stages.aux_loss(aux)), aux
    return run


def _units(tree: Any) -> Any:
    return jax.tree.map(lambda a: a[None], tree)


def layer_forward(fsdp: LayerFsdp, residuals: Residuals, shared: dict, chunk: Any, consts: Any,
                  x: jax.Array, mb: dict) -> tuple[tuple[jax.Array, dict], list]:
    """A chunk's layers on ``x``, one gathered layer at a time: ((y, aux), stashable
    residuals, each leaf ``[layers of the chunk, ...]``). ``chunk``: the stored shards of the
    chunk's layers ``[layers, ...]``; ``residuals`` splits a VJP into what waits in the stash
    (:class:`Residuals`)."""
    stages = fsdp.stages

    def one(x: jax.Array, xs: tuple) -> tuple:
        shard, const = xs
        layer, const = fsdp.gathered(shard), _units(const)
        (y, _), vjp_fn, aux = jax.vjp(_objective(stages, shared, const, mb), layer, x,
                                      has_aux=True)
        return y, (residuals.split(vjp_fn, jax.tree.leaves((layer, {}, const))), aux)

    y, (stash, aux) = lax.scan(one, x, (chunk, consts))
    # One row per layer for the layer-stacked statistics, the rest summed over the layers.
    aux = {k: a.reshape(-1, *a.shape[2:]) if k in stages.layer_stacked else jnp.sum(a, axis=0)
           for k, a in aux.items()}
    return (y, aux), stash


def added(sums: Any, on: jax.Array, at: tuple, grads: Any) -> Any:
    """``sums`` (float32, ``[chunks, layers, ...]``) with ``grads`` added at index ``at`` (a
    chunk, or a chunk and a layer) where ``on`` (a masked slot adds zeros)."""
    return jax.tree.map(
        lambda acc, g: acc.at[at].add(jnp.where(on, g, jnp.zeros_like(g)).astype(acc.dtype)),
        sums, grads)


def layer_backward(fsdp: LayerFsdp, residuals: Residuals, chunk: Any, consts: Any, stashed: list,
                   dy: jax.Array, aux_cotangent: jax.Array, sums: Any, j: jax.Array,
                   on: jax.Array) -> tuple[Any, jax.Array]:
    """(``sums`` with chunk ``j``'s weight gradients added where ``on``; input gradient) of a
    chunk from :func:`layer_forward`'s stashed residuals, the layers in reverse, each gathered
    again. ``sums``: the stage's float32 sums ``[chunks, layers, ...]`` in the stored shards.

    Each layer's reduce-scattered gradient is added into the sums inside the loop, as it is
    made: a loop that returned the chunk's gradients stacked would hold a second buffer the
    size of the chunk's sums at once (4 GiB per device for Llama-3-70B's 20-layer stages at
    ``fsdp=4 tensor=4``, seen in the TPU compiler's heap at its peak)."""
    def one(carry: tuple, xs: tuple) -> tuple:
        dy, sums = carry
        row, shard, const, stash = xs
        layer = fsdp.gathered(shard)
        vjp_fn = residuals.join(stash, jax.tree.leaves((layer, {}, _units(const))))
        d_layer, dx = vjp_fn((dy, aux_cotangent))
        return (dx, added(sums, on, (j, row), fsdp.scattered(d_layer))), None

    (dx, sums), _ = lax.scan(one, (dy, sums), (_indices(chunk), chunk, consts, stashed),
                             reverse=True)
    return sums, dx


def _indices(chunk: Any) -> jax.Array:
    """0 .. the chunk's layers - 1: which row of the sums a layer loop's iteration adds to."""
    return jnp.arange(jax.tree.leaves(chunk)[0].shape[0])


def layer_split(fsdp: LayerFsdp, residuals: Residuals, chunk: tuple, res_shapes: list,
                dy: jax.ShapeDtypeStruct, aux: jax.ShapeDtypeStruct) -> SplitBackward:
    """One layer's backward cut into I and W (:mod:`~jaxpar.parallel.pipeline.backward_split`),
    traced on abstract values: the stash's residuals of one layer (``res_shapes`` without
    their layer dimension) and the gathered layer's weights for both parts, the output
    gradient and the aux cotangent for I alone. ``chunk``: a chunk's (stored shards,
    frozen, consts)."""
    shards, _, consts = chunk
    layer = jax.eval_shape(lambda s: fsdp.gathered(jax.tree.map(lambda a: a[0], s)), shards)
    weights = [jax.ShapeDtypeStruct(w.shape, w.dtype) for w in jax.tree.leaves(
        (layer, {}, jax.tree.map(lambda a: jax.ShapeDtypeStruct((1, *a.shape[1:]), a.dtype),
                                 consts)))]
    stashed = [jax.ShapeDtypeStruct(r.shape[1:], r.dtype) for r in res_shapes]

    def backward(primals, cotangents):
        return residuals.join(*primals)(cotangents)

    return split_backward(backward, (stashed, weights), (dy, aux))


def _weights_of(fsdp: LayerFsdp, shard: Any, const: Any) -> list:
    return jax.tree.leaves((fsdp.gathered(shard), {}, _units(const)))


def layer_backward_input(fsdp: LayerFsdp, split: SplitBackward, chunk: Any, consts: Any,
                         stashed: list, dy: jax.Array, aux_cotangent: jax.Array,
                         ) -> tuple[jax.Array, list]:
    """An I, layer by layer in reverse: each layer gathered again, the input gradient pulled
    through it; what each layer's W needs comes out stacked ``[layers, ...]``. Nothing is
    reduce-scattered: no weight gradient exists yet."""
    def one(dy: jax.Array, xs: tuple) -> tuple:
        shard, const, stash = xs
        return split.input_part((stash, _weights_of(fsdp, shard, const)),
                                (dy, aux_cotangent))

    return lax.scan(one, dy, (chunk, consts, stashed), reverse=True)


def layer_backward_weights(fsdp: LayerFsdp, split: SplitBackward, chunk: Any, consts: Any,
                           stashed: list, crossing: list, sums: Any, j: jax.Array,
                           on: jax.Array) -> Any:
    """A W, layer by layer: ``sums`` with each layer's weight gradients (from its residuals and
    what its I left) reduce-scattered over ``fsdp`` and added where ``on``, as the loop makes
    them (as :func:`layer_backward`). A layer is gathered again only where its weight
    gradients read its weights (a LoRA adapter's: the other factor)."""
    reads_weights = any(split.primal_reads[len(stashed):])

    def one(sums: Any, xs: tuple) -> tuple:
        row, shard, const, stash, crossed = xs
        if reads_weights:
            weights = _weights_of(fsdp, shard, const)
        else:  # W reads none of them: placeholders, not a gather
            weights = [jnp.zeros(w.shape, w.dtype) for w in jax.eval_shape(
                lambda: _weights_of(fsdp, shard, const))]
        d_layer = split.weight_part((stash, weights), crossed)
        return added(sums, on, (j, row), fsdp.scattered(d_layer)), None

    sums, _ = lax.scan(one, sums, (_indices(chunk), chunk, consts, stashed, crossing))
    return sums
