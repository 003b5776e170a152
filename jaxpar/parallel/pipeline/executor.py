"""The pipeline executor: one SPMD program running any schedule inside shard_map over `pipe`.

The schedules (:mod:`jaxpar.parallel.pipeline.schedules`) say which stage does what at each
*step*; :mod:`jaxpar.parallel.pipeline.program` turns them into integer arrays, and this module
runs them, with the model cut by :mod:`jaxpar.parallel.pipeline.stages`.

One program on every stage. Every device runs the same operations at every step; the arrays
choose only data: which microbatch, which of the device's chunks, which stash slot to read and
write, and masks for slots a stage has no work in. The steps of one kind (forward only, forward
and backward, backward only, ...) form a *stretch*, run as one ``lax.scan`` whose body holds
exactly that kind's slots. No collective sits inside a conditional, so every collective the
compiler inserts inside a stage (tensor all-reduces, context rings, expert all-to-alls, FSDP
gathers) is reached by all its participants, on every backend.

A step, on every stage (``mb``: one microbatch, ``[B/m, S, E]`` activations):

1. *Embed* (steps with a forward slot). The vocabulary is cut into ``p`` pieces, one per
   stage (and each piece split over the axes that split ``vocab``). Each stage gathers the
   rows of the tokens of the microbatch entering chunk 0 that fall in its piece (zeros for the
   others) and a ``psum`` over ``pipe`` adds the pieces: one all-reduce of one activation.
   Stage 0 uses the sum.
2. *Forward slot*. Run the chunk's layers on the input (the embedding, or an activation that
   arrived earlier) under ``jax.vjp``; keep the VJP's residuals in a stash slot. Nothing is
   recomputed later: ``train.remat`` alone decides what the residuals hold (``full``: only
   each layer's input). With ``parallel.pipeline_stash=inputs`` the slot keeps the chunk's
   input instead, and the backward slot runs the chunk again from it
   (:mod:`jaxpar.parallel.pipeline.recompute`).
3. *Head and loss* (steps where a stage's forward is the last chunk). A ``psum`` hands the last
   stage's output to every stage; each computes the logits of its vocabulary piece, the
   log-sum-exp and target logit combine over ``pipe`` (all-reduces of ``[B/m, S]``), and each stage
   derives its piece's logit gradients by hand; the gradient w.r.t. the last chunk's output is a
   ``psum`` of the pieces' contributions. The head's weights and work are split ``p`` ways, not
   repeated.
4. *Backward slot* (``B``, or ``I`` then ``W``). Rebuild the VJP from the stash and the
   chunk's weights and pull the output gradient through it: the input gradient goes to the
   previous stage, the weight gradient is added to the stage's local sum. Chunk 0's input
   gradient is handed to all stages (``psum``) for the embedding pieces' gradients.
5. *Send*: one ``ppermute`` forward (activations) and one backward (input gradients), each
   only in steps that have that slot.

Bytes over ``pipe`` per step: one activation per ``ppermute``, one all-reduced activation with
a forward slot (embedding), two with the head (last output, head gradient), one with a backward
slot (chunk 0's input gradient), and ``[B/m, S]`` scalars for the loss. At the end the stages'
embedding/head gradients are summed over ``pipe`` (those parameters' bytes).

Dense first blocks (DeepSeek-V3's ``model.moe.first_dense``, the ``dense_layers`` stack): a
*pre-phase* before the pipeline, outside its ``shard_map``. It embeds the step's whole batch and
runs the dense blocks on it under ``jax.vjp``, with the batch rows split over ``pipe`` as well
as the batch axes (``pipe`` appended to the ``batch`` and ``residual_batch`` rules for it), so
each device computes the embedding and dense blocks of ``B/(d p)`` rows (``d``: the batch axes'
devices): the work is done once per token, split ``p`` ways, never repeated on every stage. Its
output, cut into the microbatches, is all-gathered over ``pipe`` once per step (each device
receives ``(p-1)/p`` of ``B/d x S/c x E`` in the compute dtype) and enters chunk 0 as ``x0`` in
place of step 1's embedding (whose all-reduce over ``pipe`` goes: one activation less per
forward step). Chunk 0's input gradient, handed to every stage anyway (step 4), is kept per
microbatch and returned as the gradient w.r.t. ``x0`` (no further bytes: each device slices its
own rows); the pre-phase's VJP turns it into the embedding's and the dense blocks' gradients,
which the partitioner sums over the batch axes and ``pipe`` (their bytes, once per step). The
dense blocks' weights are whole over ``pipe`` (their stacked dimension is not split into
stages, :func:`jaxpar.parallel.rules.param_specs`), like the embedding. Memory beside the
stages': the pre-phase's residuals (its ``B/(d p)`` rows of the whole step) live across the
pipeline, and ``x0`` and its gradient (``B/d x S/c x E`` each) on every device.

Gradient accumulation (``train.grad_accum = A``) is folded into the schedule: the step's batch
is cut into ``A m`` microbatches (:func:`split_microbatches`, the rows each micro-step's
microbatches would hold) and the schedule runs once over all of them, so the pipeline fills
and drains once per step: 1F1B's bubble is (p-1)/(A m+p-1), not (p-1)/(m+p-1).

Memory per stage: the stashes (arrived inputs, residuals, output gradients; each slot one
microbatch of one chunk, and one spare slot that masked writes go to), and the gradient sums.
Slots are handed out lowest free first when the program is compiled, so their number is the
schedule's peak in flight: ``A m`` for GPipe (it grows with ``train.grad_accum``), ``2(p-1)+1``
on the first stage for 1F1B (flat in the microbatches).

Parameters. A device's slice of the stacked layers, ``[v * layers_per_chunk, ...]``, holds its
chunks s, s+p, ... in that order (for ``v > 1`` the trainer stores the layers permuted so;
:func:`jaxpar.parallel.pipeline.schedules.stage_layer_order`). Embedding, final norm and head
are stored replicated over ``pipe``; each stage reads its vocabulary piece of them. Once per
step the stage's weights are cast to the compute dtype and FSDP-gathered (:class:`ByHand`), so
the VJPs save those very arrays and the stash leaves them out.

LoRA (``train.lora``): the stacked base weights, the embedding, final norm and head are
constants to the chunks' VJPs (:class:`~jaxpar.parallel.manual.Frozen`): the adapters alone are
differentiated and summed; no embedding backward, no vocabulary-piece gradients.

One reduction per step. Besides ``pipe``, the ``shard_map`` splits ``data``, ``fsdp`` and
``expert`` (the batch rows) and ``context`` (the sequence) by hand: each device sums its own
tokens' weight gradients over every microbatch of every micro-step (``train.grad_accum``), and
one all-reduce over the axes a weight is replicated over and one reduce-scatter over ``fsdp``
per step add them up. The experts are each device's own: never gathered over ``expert``, nor
summed over it. A MoE layer sums its load statistics over these axes itself
(:class:`jaxpar.model.moe.MoE`) and exchanges its tokens over ``expert`` directly
(:func:`jaxpar.parallel.expert.expert_parallel`, ``hand_groups``). The cost: the stage's
weights whole (compute dtype) and its gradient sums whole (float32) on every device for the
step (``parallel.pipeline_fsdp=per_step``). ``per_layer`` keeps the layers in their shards
instead, gathering each as a slot runs it and reduce-scattering its gradient at once
(:mod:`jaxpar.parallel.pipeline.per_layer`): one layer whole at a time, more bytes. With
``context`` manual here, context attention runs on each device's piece of the
sequence directly, with no ``shard_map`` of its own nested in this one (which the TPU compiler
aborts on: :data:`jaxpar.parallel.hooks.NO_SHARD_MAP_IN_STAGES`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec

from jaxpar.config import Config
from jaxpar.model.annotate import constrain
from jaxpar.model.lora import adapter_part, base_part, merged
from jaxpar.model.projection import RESIDUAL, one_hot_weight_grad
from jaxpar.model.remat import Remat
from jaxpar.model.transformer import DTYPES
from jaxpar.parallel.collectives import ppermute_in_order
from jaxpar.parallel.manual import ByHand, Frozen, specs_of, split_by_hand
from jaxpar.parallel.microbatch import split_micro_steps
from jaxpar.parallel.pipeline.backward_split import SplitBackward, split_backward
from jaxpar.parallel.pipeline.dense_first import dense_pre_phase
from jaxpar.parallel.pipeline.per_layer import (
    LayerFsdp,
    added,
    layer_backward,
    layer_backward_input,
    layer_backward_weights,
    layer_forward,
    layer_split,
)
from jaxpar.parallel.pipeline.program import Program, compile_program, describe
from jaxpar.parallel.pipeline.recompute import kept, rebuilt
from jaxpar.parallel.pipeline.schedules import placement_of, schedule_steps, stage_layer_order
from jaxpar.parallel.pipeline.stages import (
    PIPE_AXIS,
    Residuals,
    Stages,
    VocabPiece,
    embed_partial,
    head_and_loss,
    model_stages,
    sum_over_stages,
    vocab_piece,
)
from jaxpar.parallel.rules import logical_rules, resolve_spec

__all__ = ["ByHand", "Program", "compile_program", "describe", "describe_config",
           "pipeline_loss_and_grads", "pipelined_gradients", "split_microbatches"]

# --------------------------------------------------------------------------------------------
# The executor


class _Carry(NamedTuple):
    acts: jax.Array  # [act_slots + 1, *activation]: inputs that arrived for a forward
    res: list  # per residual leaf [res_slots + 1, ...]: what a backward needs
    grads: jax.Array  # [grad_slots + 1, *activation]: output gradients for a backward
    layer_grads: Any  # like the local layers, [v, layers_per_chunk, ...], float32
    shared_grads: Any  # embedding/head (pieces, summed over pipe at the end) and final norm
    # ({} when they are frozen: LoRA)
    loss: jax.Array  # float32: summed token loss (the same on every stage)
    aux: Any  # the chunks' aux sums (layer-stacked keys: [v, layers_per_chunk, ...])
    # With a pre-phase (dense first blocks): [m, *activation], the gradient w.r.t. each
    # microbatch's input to chunk 0 (None without one)
    d_inputs: Any = None
    # Per crossing leaf [wait_slots + 1, ...]: what an I leaves its W (zero bubble's W stash;
    # [] when every backward runs whole)
    waits: list = ()


def _put(buffer: jax.Array, slot: jax.Array, value: jax.Array) -> jax.Array:
    return lax.dynamic_update_index_in_dim(buffer, value.astype(buffer.dtype), slot, 0)


def _masked_add(on: jax.Array, total: Any, new: Any) -> Any:
    return jax.tree.map(lambda a, b: a + jnp.where(on, b, jnp.zeros_like(b)).astype(a.dtype),
                        total, new)


def pipeline_loss_and_grads(program: Program, stages: Stages, by_hand: ByHand, *, p: int,
                            v: int, vocab_size: int, stash_spec: PartitionSpec,
                            layer_grad_specs: Any, shared_grad_specs: Any,
                            frozen: Frozen | None = None, per_layer: bool = False,
                            stash_inputs: bool = False) -> Callable:
    """``(shared, layers, frozen_layers, consts, micro, loss_scale, aux_scale) -> (loss_sum,
    shared_grads, layer_grads, aux)`` running ``program``.

    ``layers``: the stacked layer parameters ``[n_layers, ...]``, sharded over ``pipe`` on their
    first dimension, and ``consts`` the stacked non-trained state beside them; ``shared``: the
    other parameters (replicated over ``pipe``); ``micro``: ``[n, rows, ...]`` arrays of the
    ``n`` microbatches ``program`` runs (``train.grad_accum`` x ``train.microbatches``: the
    schedule runs once per step, over all of them; the gradient sums are reduced once). The
    gradients are those of
    ``loss_scale * sum(token losses) + aux_scale * sum over chunks and microbatches of
    aux_loss``; ``loss_sum`` is the unscaled token-loss sum and ``aux`` the aux sums
    (layer-stacked keys over all layers, in stored order). Call under the mesh.
    ``stash_spec`` lays out the activation stashes ``[slot, batch, seq, embed]``; the grad specs
    lay out the gradient sums (as the parameters, without ``pipe``); all three for the mesh left
    automatic inside (``by_hand``). With ``frozen`` (LoRA, :class:`Frozen`): ``layers`` the
    adapters, ``frozen_layers`` the rest (else ``{}``), and ``shared_grads`` is ``{}``.
    ``per_layer`` (``parallel.pipeline_fsdp``): the layers stay in their stored shards
    (:mod:`jaxpar.parallel.pipeline.per_layer`); ``stash_inputs``: each chunk's input stashed
    (``parallel.pipeline_stash``, :mod:`jaxpar.parallel.pipeline.recompute`)."""
    train_shared = frozen is None
    fsdp = LayerFsdp.of(by_hand, stages) if per_layer else None

    def per_device(shared, layers, frozen_layers, consts, micro, loss_scale, aux_scale):
        with by_hand.hooks():
            shared = by_hand.gather(shared, by_hand.shared_specs, by_hand.auto_shared_specs)
            if fsdp is None:
                layers = by_hand.gather(layers, by_hand.layer_specs, by_hand.auto_layer_specs)
            if frozen is not None:
                frozen_layers = by_hand.gather(frozen_layers, *frozen)
            env = _Env.make(stages, shared, (layers, frozen_layers), consts, micro, loss_scale,
                            aux_scale, p=p, v=v, vocab_size=vocab_size,
                            train_shared=train_shared, fsdp=fsdp,
                            split=program.wait_slots > 0, placement=program.placement,
                            stash_inputs=stash_inputs)
            # One pass of the schedule over all the step's microbatches (train.grad_accum is
            # folded into them: one fill and one drain per step, not per micro-step).
            carry = _initial_carry(env, program, stash_spec, layer_grad_specs,
                                   shared_grad_specs)
            for stretch in program.stretches:
                fields = {k: jnp.asarray(a) for k, a in stretch.fields.items()}

                def steps(c, rows, pattern=stretch.pattern):
                    for i, kinds in enumerate(pattern):
                        c = _run_step(env, kinds, c, {k: a[i] for k, a in rows.items()})
                    return c, None

                carry, _ = lax.scan(steps, carry, fields)
            d_inputs = carry.d_inputs
            loss, shared_grads, layer_grads, aux_sums, aux_layers = _finish(env, carry)
        if train_shared:
            shared_grads = _summed_shared(by_hand, shared_grads)
        return (by_hand.total(loss), shared_grads,
                by_hand.reduce(layer_grads, by_hand.layer_specs, by_hand.auto_layer_specs,
                               scatter=fsdp is None),
                by_hand.total(aux_sums),
                by_hand.total(aux_layers), d_inputs)

    def run_pipeline(shared, layers, frozen_layers, consts, micro, loss_scale, aux_scale):
        stacked_keys = {k: PartitionSpec(PIPE_AXIS) for k in stages.layer_stacked}
        # [accum m, B/(accum m), S]: the batch rows and the sequence split by hand
        rows = by_hand.microbatch_spec
        loss, shared_grads, layer_grads, aux_sums, aux_layers, d_inputs = jax.shard_map(
            per_device,
            in_specs=(by_hand.shared_specs, by_hand.layer_specs,
                      {} if frozen is None else frozen.layer_specs,
                      jax.tree.map(lambda _: PartitionSpec(PIPE_AXIS), consts), rows,
                      PartitionSpec(), PartitionSpec()),
            out_specs=(PartitionSpec(), by_hand.shared_specs if train_shared else {},
                       by_hand.layer_specs, PartitionSpec(), stacked_keys,
                       rows if stages.pre_embedded else None),
            axis_names=frozenset({PIPE_AXIS, *by_hand.axes}), check_vma=False,
        )(shared, layers, frozen_layers, consts, micro, loss_scale, aux_scale)
        return loss, shared_grads, layer_grads, {**aux_sums, **aux_layers}, d_inputs

    return run_pipeline


def _summed_shared(by_hand: ByHand, shared_grads: dict) -> dict:
    """The one reduction of the step over the batch axes split by hand. Then each stage's
    vocabulary piece of the embedding/head gradients (rows of its own, zeros elsewhere) is
    summed over pipe; the final norm's gradient is the same on every stage already."""
    shared_grads = by_hand.reduce(shared_grads, by_hand.shared_specs, by_hand.auto_shared_specs)
    return {k: lax.psum(a, PIPE_AXIS) if k in ("embedding", "lm_head") else a
            for k, a in shared_grads.items()}


@dataclass
class _Env:
    """What every step of one device reads: its stage, weights by chunk, the microbatches, the
    vocabulary piece, the scales, and the residual layout (filled by the first trace)."""

    stages: Stages
    stage: jax.Array
    shared: dict
    # layers as [v, layers_per_chunk, ...], prepared for use (Stages.prepare); with ``fsdp``
    # (pipeline_fsdp=per_layer) their stored shards, each layer gathered as it runs
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
    fsdp: LayerFsdp | None = None
    placement: str = "ring"  # how chunks sit on the devices (schedules.stage_of)
    # The backward cut into I and W (backward_split.py), where the schedule runs them apart
    split: SplitBackward | None = None
    stash_inputs: bool = False  # parallel.pipeline_stash=inputs (recompute.py)

    @staticmethod
    def make(stages, shared, layers, consts, micro, loss_scale, aux_scale, *, p, v,
             vocab_size, train_shared, fsdp=None, split=False, placement="ring",
             stash_inputs=False) -> _Env:
        """``layers``: (trained, frozen) stacked layer weights."""
        def by_chunk(tree):
            return jax.tree.map(lambda a: a.reshape(v, a.shape[0] // v, *a.shape[1:]), tree)

        stage = lax.axis_index(PIPE_AXIS)
        trained, frozen = layers
        chunks = by_chunk(trained) if fsdp else stages.prepare(by_chunk(trained))
        env = _Env(stages, stage, shared, chunks,
                   stages.prepare(by_chunk(frozen)), by_chunk(consts), micro,
                   vocab_piece(vocab_size, stages.vocab_shards, p, stage), loss_scale,
                   aux_scale, Residuals(), None, None, None, train_shared, fsdp,
                   placement, stash_inputs=stash_inputs)
        first = env.microbatch(jnp.int32(0))
        table = env.piece.cut(env.table())
        env.act = jax.eval_shape(lambda: embed_partial(stages, table, env.piece,
                                                        first["inputs"]))
        x = jnp.zeros(env.act.shape, env.act.dtype)
        # Traced with a traced chunk index, as the steps will be, so the residuals match.
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
        if self.fsdp is not None:
            return layer_split(self.fsdp, self.residuals, self.weights(jnp.int32(0)),
                               self.res_shapes, dy, aux)
        weights = [jax.ShapeDtypeStruct(w.shape, w.dtype)
                   for w in jax.tree.leaves(self.weights(jnp.int32(0)))]
        stashed = [jax.ShapeDtypeStruct(r.shape, r.dtype) for r in self.res_shapes]

        def backward(primals, cotangents):
            vjp_fn = self.residuals.join(*primals)
            return vjp_fn(cotangents)

        return split_backward(backward, (stashed, weights), (dy, aux))

    def microbatch(self, i: jax.Array) -> dict:
        return jax.tree.map(lambda a: a[i], self.micro)

    def weights(self, j: jax.Array) -> tuple[Any, Any, Any]:
        """Chunk ``j``'s (trained, frozen, constant) per-layer arrays."""
        return jax.tree.map(lambda a: a[j], (self.chunks, self.frozen_chunks, self.const_chunks))

    def table(self) -> jax.Array:
        return self.shared["embedding"].astype(self.stages.dtype)

    def head(self) -> jax.Array:
        if self.stages.tied_embeddings:
            return self.piece.cut(self.table()).T
        return self.piece.cut(self.shared["lm_head"].astype(self.stages.dtype).T).T

    def forward(self, j: jax.Array, x: jax.Array, mb: dict) -> tuple:
        """Chunk ``j``'s layers on ``x`` under ``jax.vjp``: ((y, aux), stashable residuals)."""
        layers, frozen, consts = self.weights(j)
        stages = self.stages
        if self.fsdp is not None:
            return layer_forward(self.fsdp, self.residuals, self.shared, layers, consts, x, mb)

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
        if self.fsdp is not None:  # each layer's gradient added as its loop makes it
            layers, _, consts = self.weights(j)
            return layer_backward(self.fsdp, self.residuals, layers, consts, stashed, dy,
                                  aux_cotangent, sums, j, aux_on)
        vjp_fn = self.residuals.join(stashed, jax.tree.leaves(self.weights(j)))
        d_layers, dx = vjp_fn((dy, aux_cotangent))
        return added(sums, aux_on, j, self.stages.unprepare(d_layers)), dx

    def backward_input(self, j: jax.Array, stashed: list, dy: jax.Array, aux_on: jax.Array,
                       ) -> tuple[jax.Array, list]:
        """An I: chunk ``j``'s input gradient, and what its W will need (the crossing values,
        :mod:`jaxpar.parallel.pipeline.backward_split`); no weight-gradient matmul runs."""
        aux_cotangent = jnp.where(aux_on, self.aux_scale, 0.0)
        if self.fsdp is not None:
            layers, _, consts = self.weights(j)
            return layer_backward_input(self.fsdp, self.split, layers, consts, stashed, dy,
                                        aux_cotangent)
        weights = jax.tree.leaves(self.weights(j))
        return self.split.input_part((stashed, weights), (dy, aux_cotangent))

    def backward_weights(self, j: jax.Array, stashed: list, crossing: list, sums: Any,
                         on: jax.Array) -> Any:
        """A W: ``sums`` with chunk ``j``'s weight gradients (float32, stored layout) from its
        residuals and what its I left added where ``on``: only the weight-gradient matmuls
        run."""
        if self.fsdp is not None:
            layers, _, consts = self.weights(j)
            return layer_backward_weights(self.fsdp, self.split, layers, consts, stashed,
                                          crossing, sums, j, on)
        weights = jax.tree.leaves(self.weights(j))
        d_layers = self.split.weight_part((stashed, weights), crossing)
        return added(sums, on, j, self.stages.unprepare(d_layers))


def _initial_carry(env: _Env, program: Program, stash_spec: PartitionSpec,
                   layer_grad_specs: Any, shared_grad_specs: Any) -> _Carry:
    def zeros(tree: Any, specs: Any) -> Any:
        return lax.with_sharding_constraint(
            jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), tree), specs)

    # Each stash starts filled with its own value (what a slot holds before its first write
    # is never used): XLA merges equal constant buffers into one and copies it into each
    # carry, which kept one more stash-sized buffer alive (seen: +25% of GPipe's stash).
    wait_shapes = env.split.crossing_shapes if program.wait_slots else ()
    fills = iter(range(2 + len(env.res_shapes) + len(wait_shapes)))

    def stash(slots: int) -> jax.Array:
        return lax.with_sharding_constraint(
            jnp.full((slots + 1, *env.act.shape), next(fills), env.act.dtype), stash_spec)

    v = jax.tree.leaves(env.chunks)[0].shape[0]
    aux0 = {k: jnp.zeros((v, *a.shape) if k in env.stages.layer_stacked else a.shape, a.dtype)
            for k, a in env.aux_shapes.items()}
    res0 = ([stash(program.res_slots)] if env.stash_inputs  # chunk inputs, laid out as such
            else [jnp.full((program.res_slots + 1, *r.shape), next(fills), r.dtype)
                  for r in env.res_shapes])
    d_inputs = (jnp.zeros_like(env.micro["x0"]) if env.stages.pre_embedded else None)
    shared_grads = zeros(env.shared, shared_grad_specs) if env.train_shared else {}
    waits = [jnp.full((program.wait_slots + 1, *w.shape), next(fills), w.dtype)
             for w in wait_shapes]
    return _Carry(stash(program.act_slots), res0, stash(program.grad_slots),
                  zeros(env.chunks, layer_grad_specs), shared_grads,
                  jnp.zeros((), jnp.float32), aux0, d_inputs, waits)


def _add_aux(env: _Env, total: dict, aux: dict, j: jax.Array, on: jax.Array) -> dict:
    out = {}
    for k, a in aux.items():
        a = jnp.where(on, a, jnp.zeros_like(a))
        out[k] = total[k].at[j].add(a) if k in env.stages.layer_stacked else total[k] + a
    return out


def _forward_slot(env: _Env, c: _Carry, r: dict) -> tuple[_Carry, jax.Array, list]:
    entering = env.microbatch(r["embed_mb"])
    if env.stages.pre_embedded:  # embedded (and through the dense blocks) before the pipeline
        x0 = entering["x0"]
    else:
        table = env.piece.cut(env.table())
        x0 = sum_over_stages(embed_partial(env.stages, table, env.piece, entering["inputs"]),
                             env.stages.handover_dtype)
    x0 = constrain(x0, RESIDUAL)
    x = jnp.where(r["f_first"] == 1, x0.astype(env.act.dtype), c.acts[r["f_in"]])
    on = r["f_on"] == 1
    (y, aux), res = env.forward(r["f_chunk"], x, env.microbatch(r["f_mb"]))
    res = kept(env, x, res)
    c = c._replace(res=[_put(buf, r["f_res"], leaf) for buf, leaf in zip(c.res, res,
                                                                           strict=True)],
                   aux=_add_aux(env, c.aux, aux, r["f_chunk"], on))
    return c, y, res


def _head_slot(env: _Env, c: _Carry, r: dict, y: jax.Array) -> _Carry:
    on = r["head_on"] == 1
    y_last = sum_over_stages(jnp.where(r["head_last"] == 1, y, jnp.zeros_like(y)),
                             env.stages.handover_dtype)
    norm_params = {k: a for k, a in env.shared.items() if k not in ("embedding", "lm_head")}
    loss, dy, d_head, d_norm = head_and_loss(env.stages, norm_params, env.head(), env.piece,
                                              y_last, env.microbatch(r["head_mb"]),
                                              env.loss_scale)
    if not env.train_shared:  # frozen (LoRA): d_head and d_norm unused (XLA drops them)
        return c._replace(loss=c.loss + jnp.where(on, loss, 0.0),
                          grads=_put(c.grads, r["head_dy"], dy))
    shared_grads = _masked_add(on, c.shared_grads, _fill(c.shared_grads, dict(d_norm)))
    # The head piece's gradient into its rows of the sums (VocabPiece.added: in place)
    key, piece, axis = (("embedding", d_head.T, 0) if env.stages.tied_embeddings
                        else ("lm_head", d_head, 1))
    shared_grads[key] = env.piece.added(shared_grads[key],
                                        jnp.where(on, piece, jnp.zeros_like(piece)), axis)
    return c._replace(loss=c.loss + jnp.where(on, loss, 0.0),
                      grads=_put(c.grads, r["head_dy"], dy),
                      shared_grads=shared_grads)


def _stashed(c: _Carry, r: dict, prefix: str, fresh: list | None) -> list:
    """The residuals a backward slot reads; if this step's forward wrote them, as made."""
    stashed = [buf[r[f"{prefix}_res"]] for buf in c.res]
    if fresh is not None:
        same = r[f"{prefix}_res"] == r["f_res"]
        stashed = [jnp.where(same, new, old) for new, old in zip(fresh, stashed, strict=True)]
    return stashed


def _backward_slot(env: _Env, c: _Carry, r: dict, fresh: list | None,
                   ) -> tuple[_Carry, jax.Array]:
    """A B: the whole backward of the slot's chunk, its weight gradients added to the sums."""
    on, j = r["b_on"] == 1, r["b_chunk"]
    stashed = rebuilt(env, j, _stashed(c, r, "b", fresh), r["b_mb"])
    layer_grads, dx = env.backward(j, stashed, c.grads[r["b_grad"]], on, c.layer_grads)
    return c._replace(layer_grads=layer_grads), dx


def _input_slot(env: _Env, c: _Carry, r: dict, fresh: list | None,
                ) -> tuple[_Carry, jax.Array, list]:
    """An I: the input gradient, and what its W needs written to the W stash."""
    on, j = r["b_on"] == 1, r["b_chunk"]
    dx, crossing = env.backward_input(j, _stashed(c, r, "b", fresh), c.grads[r["b_grad"]], on)
    waits = [_put(buf, r["b_wait"], leaf) for buf, leaf in zip(c.waits, crossing, strict=True)]
    return c._replace(waits=waits), dx, crossing


def _weight_slot(env: _Env, c: _Carry, r: dict, fresh: list | None,
                 fresh_crossing: list | None) -> _Carry:
    """A W: the weight gradients from the residuals and what the I left (as made, if this
    step's I wrote them), added to the sums."""
    on, j = r["w_on"] == 1, r["w_chunk"]
    crossing = [buf[r["w_wait"]] for buf in c.waits]
    if fresh_crossing is not None:
        same = r["w_wait"] == r["b_wait"]
        crossing = [jnp.where(same, new, old)
                    for new, old in zip(fresh_crossing, crossing, strict=True)]
    return c._replace(layer_grads=env.backward_weights(j, _stashed(c, r, "w", fresh), crossing,
                                                       c.layer_grads, on))


def _embedding_backward(env: _Env, c: _Carry, r: dict, dx: jax.Array) -> _Carry:
    into_first = (r["b_on"] == 1) & (r["b_first"] == 1)
    dx0 = sum_over_stages(jnp.where(into_first, dx, jnp.zeros_like(dx)),
                          env.stages.handover_dtype)
    if env.stages.pre_embedded:  # handed back out: the pre-phase's VJP takes it from there
        on = r["eback_on"] == 1
        d_in = lax.dynamic_index_in_dim(c.d_inputs, r["eback_mb"], 0, keepdims=False)
        return c._replace(d_inputs=_put(c.d_inputs, r["eback_mb"],
                                        d_in + jnp.where(on, dx0, jnp.zeros_like(dx0))))
    tokens = env.microbatch(r["eback_mb"])["inputs"]
    # The strided slices keep each tensor block's rows on its device (the piece's rows are
    # [shards, block] and the pieces divide the block).
    if env.stages.embed_scale != 1.0:  # the gradient of the scaled rows
        dx0 = dx0 * jnp.asarray(env.stages.embed_scale, dx0.dtype)
    d_table = one_hot_weight_grad(env.piece.ids, tokens, dx0, env.stages.embedding_grad_pieces,
                                  jnp.float32)
    d_table = jnp.where(r["eback_on"] == 1, d_table, jnp.zeros_like(d_table))
    return c._replace(shared_grads={
        **c.shared_grads, "embedding": env.piece.added(c.shared_grads["embedding"], d_table)})


def _run_step(env: _Env, kinds: tuple[str, ...], c: _Carry, row: dict) -> _Carry:
    """One step of a stretch of ``kinds`` (the scan body): the slots in order, the head after
    the forward (in steps where a stage's forward is the last chunk), then the sends. ``row``
    holds every field for every stage; each device reads its own column."""
    r = {k: a[env.stage] for k, a in row.items()}
    send_fwd = send_bwd = fresh = None
    if "F" in kinds:
        c, y, fresh = _forward_slot(env, c, r)
        if "H" in kinds:
            c = _head_slot(env, c, r, y)
        send_fwd = y
    crossing = None
    if "B" in kinds:
        c, send_bwd = _backward_slot(env, c, r, fresh)
    elif "I" in kinds:
        c, send_bwd, crossing = _input_slot(env, c, r, fresh)
    if send_bwd is not None and (env.train_shared or env.stages.pre_embedded):
        c = _embedding_backward(env, c, r, send_bwd)
    if "W" in kinds:
        c = _weight_slot(env, c, r, fresh, crossing)
    return _send(env, c, r, send_fwd, send_bwd)


def _send(env: _Env, c: _Carry, r: dict, y: jax.Array | None, dx: jax.Array | None,
          ) -> _Carry:
    """The step's sends over ``pipe``, and where what arrives is kept. On the ring, activations
    go on to the next device and input gradients back to the previous one (two ``ppermute``s).
    In the V (``dualpipe_v``) the first half of the chunks goes down the devices and the second
    back up, so each goes both ways, masked by where it is kept (four ``ppermute``s: twice the
    ring's bytes), and the device at the bottom hands its own output to itself. In one order
    on every device, since independent ppermutes can cross on XLA:CPU
    (parallel/collectives.py)."""
    p = env.piece.p
    ring = env.placement == "ring"

    def pairs(step: int) -> list[tuple[int, int]]:
        return [(s, (s + step) % p) for s in range(p) if ring or 0 <= s + step < p]

    routes = [(y, 1, "acts", "recv_act"), (dx, -1, "grads", "recv_grad")]
    if not ring:
        routes += [(y, -1, "acts", "recv_act_back"), (dx, 1, "grads", "recv_grad_back")]
    routes = [route for route in routes if route[0] is not None]
    arrived = ppermute_in_order([x for x, *_ in routes], PIPE_AXIS,
                                [pairs(step) for _, step, *_ in routes])
    for (_, _, stash, field), x in zip(routes, arrived, strict=True):
        c = c._replace(**{stash: _put(getattr(c, stash), r[field], x)})
    if not ring:  # the bottom of the V keeps its own (a spare slot everywhere else)
        if y is not None:
            c = c._replace(acts=_put(c.acts, r["keep_act"], y))
        if dx is not None:
            c = c._replace(grads=_put(c.grads, r["keep_grad"], dx))
    return c


def _fill(like: dict, some: dict) -> dict:
    """``some`` completed with zeros for the keys of ``like`` it lacks."""
    return {k: some[k] if k in some else jax.tree.map(jnp.zeros_like, a)
            for k, a in like.items()}


def _finish(env: _Env, c: _Carry) -> tuple:
    def stacked(a: jax.Array) -> jax.Array:
        return a.reshape(-1, *a.shape[2:])

    stages = env.stages
    layer_grads = jax.tree.map(stacked, c.layer_grads)
    shared_grads = c.shared_grads
    aux_sums = {k: lax.psum(a, PIPE_AXIS) for k, a in c.aux.items()
                if k not in stages.layer_stacked}
    aux_layers = {k: stacked(a) for k, a in c.aux.items() if k in stages.layer_stacked}
    return c.loss, shared_grads, layer_grads, aux_sums, aux_layers



def split_microbatches(batch: Any, accum: int, m: int) -> Any:
    """``[B, ...] -> [accum m, B/(accum m), ...]``: the schedule's microbatches of one step.

    Microbatch ``j m + k`` is micro-step ``j``'s microbatch ``k``: ``train.grad_accum`` cuts
    the rows into micro-steps and each is cut into ``m`` (both interleaved, so each device's
    rows stay on it), exactly the rows a micro-step-by-micro-step run gives each microbatch.
    The gradient is a sum over them whatever their order, and the MoE aux losses (one per
    microbatch) average over the same row sets.
    """
    steps = jax.vmap(lambda b: split_micro_steps(b, m))(split_micro_steps(batch, accum))
    return jax.tree.map(lambda a: a.reshape(accum * m, *a.shape[2:]), steps)


def describe_config(cfg: Config) -> dict[str, Any]:
    """:func:`describe` of ``cfg``'s pipeline (``mesh.pipe > 1``) as the executor runs it: one
    schedule over ``train.grad_accum x train.microbatches`` microbatches."""
    return describe(cfg.parallel.pipeline_schedule, cfg.mesh.pipe, cfg.train.microbatches,
                    cfg.parallel.virtual_stages, accum=cfg.train.grad_accum)


def pipelined_gradients(cfg: Config, graphdef: Any, specs: dict, logical_axes: dict, *,
                        dtype: Any, remat: Remat, platform: str,
                        ) -> tuple[Callable, np.ndarray | None, Program]:
    """The pipelined ``(params, buffers, batch, valid) -> (grads, (loss_sum, aux))`` (what
    ``jax.grad(objective, has_aux=True)`` returns without a pipeline), the stored layer order
    (None when it is the model's) and the compiled program.

    The objective is the plain one: summed token loss / ``valid``, plus each microbatch's MoE
    aux losses averaged over every microbatch of every micro-step (as ``grad_accum`` =
    accum x microbatches would). The ``train.grad_accum`` micro-steps are folded into the
    schedule: it runs once over their ``accum x m`` microbatches (:func:`split_microbatches`),
    so the pipeline fills and drains once per step.
    """
    p, v, m = cfg.mesh.pipe, cfg.parallel.virtual_stages, cfg.train.microbatches
    accum = cfg.train.grad_accum
    schedule = cfg.parallel.pipeline_schedule
    program = compile_program(schedule_steps(schedule, p, accum * m, v), p, v,
                              placement_of(schedule))
    rules, mesh_shape = logical_rules(cfg), cfg.mesh_shape
    hand, inner, hooks = split_by_hand(cfg, platform)
    micro_rows = cfg.train.batch_size // (accum * m)
    stash_spec = resolve_spec("pipeline stash", (None, *RESIDUAL),
                              (None, micro_rows, cfg.train.seq_len, cfg.model.d_model), rules,
                              inner)

    auto = set(mesh_shape) - {PIPE_AXIS, *hand}
    split_auto = {a for a in auto if mesh_shape[a] > 1}
    dense = "dense_layers" in specs  # DeepSeek's dense first blocks: run before the pipeline
    shared = {k: s for k, s in specs.items() if k not in ("layers", "dense_layers")}
    lora = cfg.train.lora.rank > 0
    # Under LoRA the adapters train and the base weights ride along as constants (Frozen).
    trained = adapter_part(specs["layers"]) if lora else specs["layers"]
    by_hand = ByHand(hand, specs_of(shared, set(hand)), specs_of(trained, {PIPE_AXIS, *hand}),
                     specs_of(shared, split_auto), specs_of(trained, split_auto),
                     hooks=hooks,
                     reduce_dtype=DTYPES[cfg.parallel.reduce_dtype],
                     owned=tuple(a for a in hand if a == "expert"))
    frozen = (Frozen(specs_of(base_part(specs["layers"]), {PIPE_AXIS, *hand}),
                     specs_of(base_part(specs["layers"]), split_auto)) if lora else None)
    layer_grad_specs = specs_of(trained, auto, lead=(None,))
    shared_grad_specs = specs_of(shared, auto)
    stand_in = (jax.tree.map(lambda _: np.zeros((), np.float32), specs["dense_layers"],
                             is_leaf=lambda x: isinstance(x, PartitionSpec)) if dense else None)
    stages = model_stages(graphdef, cfg, logical_axes["layers"], dtype=dtype, remat=remat,
                          platform=platform, dense_stand_in=stand_in)
    run = pipeline_loss_and_grads(program, stages, by_hand,
                                  p=p, v=v, vocab_size=cfg.model.vocab_size,
                                  stash_spec=stash_spec, layer_grad_specs=layer_grad_specs,
                                  shared_grad_specs=shared_grad_specs, frozen=frozen,
                                  per_layer=cfg.parallel.pipeline_fsdp == "per_layer",
                                  stash_inputs=cfg.parallel.pipeline_stash == "inputs")

    pre_phase = dense_pre_phase(cfg, graphdef, mesh_shape, platform, dtype=dtype, remat=remat,
                                 split=lambda batch: split_microbatches(batch, accum, m))

    def grad_fn(params: dict, buffers: Any, batch: dict, valid: jax.Array) -> tuple:
        frozen_layers = {}
        if lora:  # as train.step.for_gradients splits them: the adapters, (buffers, the rest)
            buffers, base = buffers
            frozen_layers, params = base["layers"], {**base, **params}
        shared = {k: a for k, a in params.items() if k not in ("layers", "dense_layers")}
        aux_scale = jnp.asarray(1.0 / (accum * m), jnp.float32)
        micro = split_microbatches(batch, accum, m)  # one schedule over all of them
        if dense:
            x0, pre_backward = pre_phase(params, buffers, batch)
            micro = {**micro, "x0": x0}
        loss_sum, shared_grads, layer_grads, aux, d_x0 = run(
            shared, params["layers"], frozen_layers, buffers.get("layers", {}), micro,
            1.0 / valid, aux_scale)
        grads = {**shared_grads, "layers": layer_grads}
        if dense:
            d_pre = pre_backward(d_x0.astype(x0.dtype))
            grads["embedding"] = grads["embedding"] + d_pre["embedding"].astype(jnp.float32)
            grads["dense_layers"] = jax.tree.map(lambda g: g.astype(jnp.float32),
                                                 d_pre["dense_layers"])
        return grads, (loss_sum, aux)

    order = stage_layer_order(cfg.model.n_layers - (cfg.model.moe.first_dense if dense else 0),
                              p, v, program.placement)
    return grad_fn, (None if order == sorted(order) else np.asarray(order)), program

