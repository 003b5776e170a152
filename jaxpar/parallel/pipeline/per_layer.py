"""FSDP inside pipeline stages layer by layer (``parallel.pipeline_fsdp=per_layer``).

The default (``per_step``) gathers a stage's weights whole over ``fsdp`` once per step and sums
their gradients whole in float32 until the step's one reduce-scatter. Here a slot scans its
chunk one layer at a time (:mod:`jaxpar.parallel.pipeline.layerwise`): a forward gathers each
layer's shard (cast to the compute dtype first) and stashes residuals without the gathered
weights; a backward gathers each again and reduce-scatters its gradient at once into float32
sums in the stored split. A device holds one layer whole and float32 sums of ``1/f`` of the
stage. The price: a gather per layer per executed slot (masked ones too) and a reduce-scatter
per gradient slot, never under a conditional. Costed in docs/pipelines.md, "FSDP layer by
layer".
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
    """Stacked specs ``[layers, ...]`` -> one layer's, the two unit dims of the stages' prepare
    (``[chunk, layer, ...]``) unsplit."""
    return jax.tree.map(lambda s: PartitionSpec(None, None, *tuple(s)[1:]), specs,
                        is_leaf=lambda x: isinstance(x, PartitionSpec))


@dataclass(frozen=True)
class LayerFsdp:
    """One layer's gather over ``fsdp`` and its gradient's reduce-scatter. ``specs``/
    ``auto_specs``: the stacked layers' splits over the manual and automatic axes
    (:class:`ByHand`'s ``layer_specs``/``auto_layer_specs``)."""

    by_hand: ByHand
    stages: Stages
    specs: Any
    auto_specs: Any

    @classmethod
    def of(cls, by_hand: ByHand, stages: Stages) -> LayerFsdp:
        return cls(by_hand, stages, _one_layer(by_hand.layer_specs),
                   _one_layer(by_hand.auto_layer_specs))

    def gathered(self, shard: Any) -> Any:
        """A layer's stored shard -> its weights as a stack ``[1, ...]``, cast to the compute dtype
        before the all-gather (half the bytes in bf16)."""
        prepare = self.stages.prepare
        units = jax.tree.map(lambda a: a[None, None], shard)
        whole = prepare(self.by_hand.gather(prepare(units), self.specs, self.auto_specs))
        return jax.tree.map(lambda a: a[0], whole)

    def scattered(self, grad: Any) -> Any:
        """The gradient w.r.t. :meth:`gathered`'s weights -> float32, reduce-scattered over ``fsdp``
        to the stored shard (other axes not yet summed)."""
        stored = self.stages.unprepare(grad)
        summed = self.by_hand.reduce(jax.tree.map(lambda g: g[None], stored), self.specs,
                                     self.auto_specs, replicas=False)
        return jax.tree.map(lambda g: g[0, 0].astype(jnp.float32), summed)
