"""FSDP inside pipeline stages layer by layer (``parallel.pipeline_fsdp=per_layer``).

The default (``per_step``, :mod:`jaxpar.parallel.pipeline.executor`) gathers a stage's weights
whole over ``fsdp`` once per step and sums its weight gradients whole in float32 until the
step's one reduce-scatter: all the stage's layers, whole, on every device for the whole step.

Here a slot runs its chunk's layers as a ``lax.scan`` of its own, one layer per iteration
(:mod:`jaxpar.parallel.pipeline.layerwise`, with :class:`LayerFsdp` for each layer's weights).
A forward slot gathers each layer's stored shard over ``fsdp`` (cast to the compute dtype
first), runs it under ``jax.vjp`` and stashes its residuals without the gathered weights. A
backward slot runs the layers in reverse, gathers each again, rebuilds its VJP, and
reduce-scatters the layer's weight gradient over ``fsdp`` at once into float32 sums held in
the stored split.

So a device holds one layer whole at a time, and float32 sums of ``1/f`` of the stage's
weights. The price is a gather of every layer per executed slot (masked ones too) and a
reduce-scatter per slot that adds weight gradients, all in the scans' bodies, never under a
conditional. Costed in docs/pipelines.md, "FSDP layer by layer".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxpar.parallel.manual import ByHand
from jaxpar.parallel.pipeline.stages import Stages


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
