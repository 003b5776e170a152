"""What every round of the pipeline executor reads on one device (:class:`StageEnv`): its
stage, its chunks' weights, the microbatches, its vocabulary piece, and how a chunk runs
forward and backward (whole under one ``jax.vjp``, or layer by layer:
:mod:`jaxpar.parallel.pipeline.layerwise`; its backward cut into I and W:
:mod:`jaxpar.parallel.pipeline.backward_split`). The rounds themselves:
:mod:`jaxpar.parallel.pipeline.slots`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxpar.model.lora import merged
from jaxpar.parallel.pipeline.backward_split import SplitBackward, split_backward
from jaxpar.parallel.pipeline.layerwise import (
    LayerWeights,
    added,
    layer_backward,
    layer_backward_input,
    layer_backward_weights,
    layer_forward,
    layer_forward_backward,
    layer_split,
)
from jaxpar.parallel.pipeline.stages import (
    PIPE_AXIS,
    Residuals,
    Stages,
    VocabPiece,
    embed_partial,
    vocab_piece,
)


@dataclass
class StageEnv:
    """What every round of one device reads: its stage, weights by chunk, the microbatches, the
    vocabulary piece, the scales, and the residual layout (filled by the first trace)."""

    stages: Stages
    stage: jax.Array
    shared: dict
    # layers as [v, layers_per_chunk, ...], prepared for use (Stages.prepare); with FSDP by
    # layer (pipeline_fsdp=per_layer) their stored shards, each layer gathered as it runs
    chunks: Any
    frozen_chunks: Any  # the frozen base weights so (LoRA; else {})
    const_chunks: Any
    micro: Any
    piece: VocabPiece
    loss_scale: jax.Array
    aux_scale: jax.Array
    residuals: Residuals
    act: jax.ShapeDtypeStruct  # one microbatch's activation
    aux_shapes: Any
    res_shapes: list
    train_shared: bool = True  # False under LoRA: embedding, final norm and head are frozen
    # How a slot that runs its chunk one layer at a time reads a layer (layerwise.py); None:
    # the chunk runs whole under one jax.vjp
    layerwise: LayerWeights | None = None
    placement: str = "ring"  # how chunks sit on the devices (schedules.stage_of)
    overlap: bool = False  # a round's forward and backward in one layer loop
    # The backward cut into I and W (backward_split.py), where the schedule runs them apart
    split: SplitBackward | None = None
    stash_inputs: bool = False  # parallel.pipeline_stash=inputs (recompute.py)

    @staticmethod
    def make(stages, shared, layers, consts, micro, loss_scale, aux_scale, *, p, v,
             vocab_rows, train_shared, layerwise=None, split=False, placement="ring",
             overlap=False, stash_inputs=False) -> StageEnv:
        """``layers``: (trained, frozen) stacked layer weights."""
        def by_chunk(tree):
            return jax.tree.map(lambda a: a.reshape(v, a.shape[0] // v, *a.shape[1:]), tree)

        stage = lax.axis_index(PIPE_AXIS)
        trained, frozen = layers
        by_layer_fsdp = layerwise is not None and layerwise.fsdp is not None
        chunks = by_chunk(trained) if by_layer_fsdp else stages.prepare(by_chunk(trained))
        env = StageEnv(stages, stage, shared, chunks,
                       stages.prepare(by_chunk(frozen)), by_chunk(consts), micro,
                       vocab_piece(vocab_rows, stages.vocab_shards, p, stage), loss_scale,
                       aux_scale, Residuals(), None, None, None, train_shared, layerwise,
                       placement, overlap, stash_inputs=stash_inputs)
        first = env.microbatch(jnp.int32(0))
        table = env.piece.cut(env.table())
        env.act = jax.eval_shape(lambda: embed_partial(stages, table, env.piece,
                                                        first["inputs"]))
        x = jnp.zeros(env.act.shape, env.act.dtype)
        # Traced with a traced chunk index, as the rounds will be, so the residuals match.
        (_, aux), res = jax.eval_shape(lambda j: env.forward(j, x, first), jnp.int32(0))
        env.aux_shapes, env.res_shapes = aux, [env.act] if stash_inputs else res
        if split:
            env.split = env.split_backward()
        return env

    def split_backward(self) -> SplitBackward:
        """The chunk's backward (per layer with ``fsdp``) cut into I and W, traced on abstract
        values: the stash's residuals and the weights for both, the output gradient and the
        aux cotangent for I alone."""
        dy = jax.ShapeDtypeStruct(self.act.shape, self.act.dtype)
        aux = jax.ShapeDtypeStruct((), jnp.float32)
        if self.layerwise is not None:
            return layer_split(self.layerwise, self.residuals, self.weights(jnp.int32(0)),
                               self.res_shapes, dy, aux)
        weights = [jax.ShapeDtypeStruct(w.shape, w.dtype)
                   for w in jax.tree.leaves(self.weights(jnp.int32(0)))]
        stashed = [jax.ShapeDtypeStruct(r.shape, r.dtype) for r in self.res_shapes]

        def backward(primals, cotangents):
            vjp_fn = self.residuals.join(*primals)
            return vjp_fn(cotangents)

        return split_backward(backward, (stashed, weights), (dy, aux))

    def wait_shapes(self) -> list[jax.ShapeDtypeStruct]:
        """What an I leaves its W, one chunk (a layer-by-layer split's, stacked per layer)."""
        shapes = self.split.crossing_shapes
        if self.layerwise is None:
            return list(shapes)
        layers = jax.tree.leaves(self.chunks)[0].shape[1]
        return [jax.ShapeDtypeStruct((layers, *w.shape), w.dtype) for w in shapes]

    def microbatch(self, i: jax.Array) -> dict:
        return jax.tree.map(lambda a: a[i], self.micro)

    def weights(self, j: jax.Array) -> tuple[Any, Any, Any]:
        """Chunk ``j``'s (trained, frozen, constant) per-layer arrays."""
        return jax.tree.map(lambda a: a[j], (self.chunks, self.frozen_chunks, self.const_chunks))

    def table(self) -> jax.Array:
        return self.shared["embedding"].astype(self.stages.dtype)

    def head(self) -> jax.Array:
        """This stage's piece of the output head [d_model, V/p], in the compute dtype."""
        table = self.stages.edges.head_table(self.shared)
        return self.piece.cut(table.astype(self.stages.dtype)).T

    def forward(self, j: jax.Array, x: jax.Array, mb: dict) -> tuple:
        """Chunk ``j``'s layers on ``x`` under ``jax.vjp``: ((y, aux), stashable residuals)."""
        layers, frozen, consts = self.weights(j)
        stages = self.stages
        if self.layerwise is not None:
            return layer_forward(self.layerwise, self.residuals, self.shared, layers, consts, x,
                                 mb)

        def objective_parts(layers, x):
            # The frozen weights (LoRA) are closed over: constants, not differentiated.
            y, aux = stages.layers(self.shared, merged(layers, frozen), consts, x, mb)
            return (y, stages.aux_loss(aux)), aux

        (y, _), vjp_fn, aux = jax.vjp(objective_parts, layers, x, has_aux=True)
        weights = jax.tree.leaves((layers, frozen, consts))
        return (y, aux), self.residuals.split(vjp_fn, weights)

    def backward(self, j: jax.Array, stashed: list, dy: jax.Array, aux_on: jax.Array,
                 sums: Any) -> tuple[Any, jax.Array]:
        """(``sums`` with chunk ``j``'s weight gradients added where ``aux_on``, float32 in the
        stored layout; input gradient) from its stashed residuals: a whole backward (B)."""
        aux_cotangent = jnp.where(aux_on, self.aux_scale, 0.0)
        if self.layerwise is not None:  # each layer's gradient added as its loop makes it
            layers, _, consts = self.weights(j)
            return layer_backward(self.layerwise, self.residuals, layers, consts, stashed, dy,
                                  aux_cotangent, sums, j, aux_on)
        vjp_fn = self.residuals.join(stashed, jax.tree.leaves(self.weights(j)))
        d_layers, dx = vjp_fn((dy, aux_cotangent))
        return added(sums, aux_on, j, self.stages.unprepare(d_layers)), dx

    def backward_input(self, j: jax.Array, stashed: list, dy: jax.Array, aux_on: jax.Array,
                       ) -> tuple[jax.Array, list]:
        """An I: chunk ``j``'s input gradient, and what its W will need (the crossing values,
        :mod:`jaxpar.parallel.pipeline.backward_split`); no weight-gradient matmul runs."""
        aux_cotangent = jnp.where(aux_on, self.aux_scale, 0.0)
        if self.layerwise is not None:
            layers, _, consts = self.weights(j)
            return layer_backward_input(self.layerwise, self.split, layers, consts, stashed, dy,
                                        aux_cotangent)
        weights = jax.tree.leaves(self.weights(j))
        return self.split.input_part((stashed, weights), (dy, aux_cotangent))

    def backward_weights(self, j: jax.Array, stashed: list, crossing: list, sums: Any,
                         on: jax.Array) -> Any:
        """A W: ``sums`` with chunk ``j``'s weight gradients (float32, stored layout) from its
        residuals and what its I left added where ``on``: only the weight-gradient matmuls
        run."""
        if self.layerwise is not None:
            layers, _, consts = self.weights(j)
            return layer_backward_weights(self.layerwise, self.split, layers, consts, stashed,
                                          crossing, sums, j, on)
        weights = jax.tree.leaves(self.weights(j))
        d_layers = self.split.weight_part((stashed, weights), crossing)
        return added(sums, on, j, self.stages.unprepare(d_layers))

    def forward_backward(self, jf: jax.Array, x: jax.Array, mb: dict, jb: jax.Array,
                         stashed: list, dy: jax.Array, aux_on: jax.Array, input_only: bool,
                         ) -> tuple:
        """A round's forward (chunk ``jf`` on ``x``) and backward (chunk ``jb`` from its stash, a
        B, or an I with ``input_only``) in one layer loop (``parallel.pipeline_overlap``:
        :func:`~jaxpar.parallel.pipeline.layerwise.layer_forward_backward`)."""
        f_layers, _, f_consts = self.weights(jf)
        b_layers, _, b_consts = self.weights(jb)
        return layer_forward_backward(self.layerwise, self.residuals,
                                      self.split if input_only else None, self.shared,
                                      (f_layers, f_consts), x, mb,
                                      (b_layers, b_consts, stashed), dy,
                                      jnp.where(aux_on, self.aux_scale, 0.0))
