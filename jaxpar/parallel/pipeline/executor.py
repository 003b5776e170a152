"""The pipeline executor: one SPMD program running any schedule inside shard_map over `pipe`.

Every device runs the same operations in every round; integer arrays
(:mod:`jaxpar.parallel.pipeline.program`) choose only data (microbatch, chunk, stash slot,
masks). So no collective sits inside a conditional, and every collective inside a stage is
reached by all its participants. The walk-through: docs/pipelines.md, "One program on every
stage"; the rest of that page for accumulation, the one reduction per step, dense first
blocks and LoRA.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec

from jaxpar.config import Config
from jaxpar.model.lora import adapter_part, base_part, riding_apart
from jaxpar.model.projection import RESIDUAL
from jaxpar.model.remat import Remat
from jaxpar.model.transformer import DTYPES
from jaxpar.parallel.manual import ByHand, Frozen, specs_of, split_by_hand
from jaxpar.parallel.microbatch import split_micro_steps
from jaxpar.parallel.pipeline.dense_first import dense_pre_phase
from jaxpar.parallel.pipeline.layerwise import (
    LayerWeights,
)
from jaxpar.parallel.pipeline.per_layer import LayerFsdp
from jaxpar.parallel.pipeline.program import Program, compile_program, describe
from jaxpar.parallel.pipeline.schedules import placement_of, schedule_rounds, stage_layer_order
from jaxpar.parallel.pipeline.slots import finish, initial_carry, run_program
from jaxpar.parallel.pipeline.stage_env import StageEnv
from jaxpar.parallel.pipeline.stages import (
    PIPE_AXIS,
    Stages,
    model_stages,
)
from jaxpar.parallel.rules import logical_rules, resolve_spec

__all__ = ["ByHand", "Program", "compile_program", "describe", "describe_config",
           "pipeline_loss_and_grads", "pipelined_gradients", "split_microbatches"]


def pipeline_loss_and_grads(program: Program, stages: Stages, by_hand: ByHand, *, p: int,
                            v: int, vocab_rows: int, stash_spec: PartitionSpec,
                            layer_grad_specs: Any, shared_grad_specs: Any,
                            frozen: Frozen | None = None, per_layer: bool = False,
                            overlap: bool = False, stash_inputs: bool = False) -> Callable:
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
    (:mod:`jaxpar.parallel.pipeline.per_layer`). ``overlap`` (``parallel.pipeline_overlap``):
    a round's forward and backward slots run in one layer loop
    (:mod:`jaxpar.parallel.pipeline.layerwise`). ``stash_inputs``: each chunk's input stashed
    (``parallel.pipeline_stash``, :mod:`jaxpar.parallel.pipeline.recompute`).
    """
    train_shared = frozen is None
    fsdp = LayerFsdp.of(by_hand, stages) if per_layer else None
    layerwise = LayerWeights(stages, fsdp) if per_layer or overlap else None

    def per_device(shared, layers, frozen_layers, consts, micro, loss_scale, aux_scale):
        with by_hand.hooks():
            shared = by_hand.gather(shared, by_hand.shared_specs, by_hand.auto_shared_specs)
            if fsdp is None:
                layers = by_hand.gather(layers, by_hand.layer_specs, by_hand.auto_layer_specs)
            if frozen is not None:
                frozen_layers = by_hand.gather(frozen_layers, *frozen)
            env = StageEnv.make(stages, shared, (layers, frozen_layers), consts, micro,
                                loss_scale, aux_scale, p=p, v=v, vocab_rows=vocab_rows,
                                train_shared=train_shared, layerwise=layerwise,
                                split=program.wait_slots > 0, placement=program.placement,
                                overlap=overlap, stash_inputs=stash_inputs)
            # One pass of the schedule over all the step's microbatches (train.grad_accum is
            # folded into them: one fill and one drain per step, not per micro-step).
            carry = run_program(env, program, initial_carry(
                env, program, stash_spec, layer_grad_specs, shared_grad_specs))
            d_inputs = carry.d_inputs
            loss, shared_grads, layer_grads, aux_sums, aux_layers = finish(env, carry)
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


def split_microbatches(batch: Any, accum: int, m: int) -> Any:
    """``[B, ...] -> [accum m, B/(accum m), ...]``: the schedule's microbatches of one step.

    Microbatch ``j m + k`` is micro-step ``j``'s microbatch ``k``: ``train.grad_accum`` cuts
    the rows into micro-steps and each is cut into ``m`` (both interleaved, so each device's
    rows stay on it), exactly the rows a micro-step-by-micro-step run gives each microbatch.
    The gradient is a sum over them whatever their order, and the MoE aux losses (one per
    microbatch) average over the same row sets.
    """
    split = jax.vmap(lambda b: split_micro_steps(b, m))(split_micro_steps(batch, accum))
    return jax.tree.map(lambda a: a.reshape(accum * m, *a.shape[2:]), split)


def describe_config(cfg: Config) -> dict[str, Any]:
    """:func:`describe` of ``cfg``'s pipeline (``mesh.pipe > 1``) as the executor runs it: one
    schedule over ``train.grad_accum x train.microbatches`` microbatches."""
    return describe(cfg.parallel.pipeline_schedule, cfg.mesh.pipe, cfg.train.microbatches,
                    cfg.parallel.virtual_stages, accum=cfg.train.grad_accum,
                    overlap=cfg.parallel.pipeline_overlap)


def config_program(cfg: Config) -> Program:
    """``cfg``'s pipeline compiled for the executor: one schedule over ``train.grad_accum x
    train.microbatches`` microbatches."""
    schedule, p, v = cfg.parallel.pipeline_schedule, cfg.mesh.pipe, cfg.parallel.virtual_stages
    rounds = schedule_rounds(schedule, p, cfg.train.grad_accum * cfg.train.microbatches, v,
                             cfg.parallel.pipeline_overlap)
    return compile_program(rounds, p, v, placement_of(schedule))


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
    program = config_program(cfg)
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
                                  p=p, v=v, vocab_rows=cfg.vocab_rows(),
                                  stash_spec=stash_spec, layer_grad_specs=layer_grad_specs,
                                  shared_grad_specs=shared_grad_specs, frozen=frozen,
                                  per_layer=cfg.parallel.pipeline_fsdp == "per_layer",
                                  overlap=cfg.parallel.pipeline_overlap,
                                  stash_inputs=cfg.parallel.pipeline_stash == "inputs")

    pre_phase = dense_pre_phase(cfg, graphdef, mesh_shape, platform, dtype=dtype, remat=remat,
                                 split=lambda batch: split_microbatches(batch, accum, m))

    def grad_fn(params: dict, buffers: Any, batch: dict, valid: jax.Array) -> tuple:
        buffers, base = riding_apart(buffers, lora)  # the model's LoRA split (for_gradients)
        frozen_layers = base.get("layers", {})
        params = {**base, **params}
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

