"""The memory of one train step, per device: state, gradients, saved activations, scratch.

Where XLA:CPU and GPU/TPU hold different things, the plan counts each for its target. Terms:
docs/cost-model.md, "Memory per device" and "XLA:CPU's terms"; a stage's: docs/pipelines.md,
"Memory of a stage".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from jaxpar.config import BATCH_AXES
from jaxpar.cost.optimizer import update_bytes as muon_update_bytes
from jaxpar.cost.params import (
    PARAM_BYTES,
    ParamCost,
    in_compute_dtype,
    model_buffers,
    unit_blocks,
)
from jaxpar.cost.pipeline import (
    before_loops,
    pipeline_gradient_sums,
    pipeline_memory,
    stage_head,
)
from jaxpar.cost.shapes import StepSizes
from jaxpar.model.transformer import dense_units, layer_units
from jaxpar.parallel.optimizer_state import state_counters


@dataclass(frozen=True)
class MemoryCost:
    """Bytes per device. ``state``: what the step takes and returns (donated)."""

    params: int
    optimizer: int  # the optimizer's state (train.optimizer, opt_state_dtype) + counts
    gradients: int  # including the accumulator when grad_accum > 1
    batch: int  # inputs, targets (int32) and mask (float32) rows of this device
    activations: int  # saved for the backward pass, all layers, one micro-batch
    working: int  # one layer's backward, the head's logits, FSDP-gathered weights
    update: int  # the optimizer update's temporaries (after activations are freed)
    stash: int = 0  # pipeline: stage inputs and output gradients held between F and backward
    weight_copies: int = 0  # the weights as read, copied once per step (pipeline stage; cast stack)
    gradient_sums: int = 0  # pipeline with FSDP: float32 sums of the gathered weights' gradients
    before_loops: int = 0  # pipeline: the vocabulary gathered whole before the stretch loops
    buffers: int = 0  # non-trainable model state (MoE router biases)
    # train.offload.optimizer on an accelerator: the optimizer state lives in host memory and
    # is on the device only during the update (XLA:CPU keeps both in one memory: False there).
    offloaded: bool = False
    # train.remat=offload_dots on an accelerator: the saved matmul outputs, in host memory.
    host_activations: int = 0

    @property
    def state(self) -> int:
        """The device's share of the train state (+ TrainState's int32 step)."""
        return self.params + (0 if self.offloaded else self.optimizer) + self.buffers + 4

    @property
    def host(self) -> int:
        """Host memory: offloaded optimizer state and saved activations."""
        return self.host_state + self.host_activations

    @property
    def host_state(self) -> int:
        """The train state in host memory (offloaded optimizer state)."""
        return self.optimizer if self.offloaded else 0

    @property
    def peak(self) -> int:
        # A pipeline's gradient sums stand in for the gradients until they are reduce-scattered
        # into them, after the stretch loops.
        during = self.gradient_sums or self.gradients
        # An offloaded optimizer state is brought to the device for the update, and its new
        # values are made there before they go back: both copies, at most, during the update.
        return (self.state + self.batch
                + max(during + self.activations + self.stash + self.weight_copies + self.working,
                      during + self.stash + self.before_loops,
                      self.gradients + max(self.gradient_sums, self.update) + 2 * self.host_state))


def _moe_activations(st: StepSizes, remat: str) -> int:
    """Bytes a MoE feed-forward saves per micro-batch, in place of the SwiGLU's. ``dots``
    recomputes the routed experts' dots and their all-to-alls."""
    m, moe, a, t = st.cfg.model, st.cfg.model.moe, st.a, st.t
    tokens, e = st.tokens, m.d_model
    shared = tokens * moe.num_shared_experts * m.resolved_d_ff_expert // t * a
    if remat == "dots":
        return tokens * moe.num_experts * 4 + 2 * shared
    rows = st.expert_rows
    return (3 * tokens * moe.num_experts * 4 + 2 * tokens * moe.top_k * e * a
            + 3 * rows * e * a + 3 * rows * m.resolved_d_ff_expert // t * a + 3 * shared)


def _norms(st: StepSizes) -> int:
    """Bytes a layer's RMSNorms keep under ``remat=none`` (docs/cost-model.md, "Saved
    activations per layer")."""
    full = st.b * st.sl * st.cfg.model.d_model * st.a  # A
    residual = full // st.t if st.sp else full
    one = residual + residual * 4 // (st.cfg.model.d_model * st.a)
    return (2 * (one + (full if st.pipeline is not None else 0))
            + (2 * one if st.cfg.model.post_norms else 0))


def _layer_activations(st: StepSizes, remat: str, moe: bool = False) -> int:
    """Bytes one layer saves in device memory, one micro-batch (docs/cost-model.md, "Saved
    activations per layer")."""
    if remat == "offload_dots":
        # XLA:CPU keeps the "offloaded" outputs in place: its program is the dots one.
        if st.xla_cpu:
            return _layer_activations(st, "dots", moe)
        return _layer_activations(st, "full", moe)
    m, b, s, a, t = st.cfg.model, st.b, st.sl, st.a, st.t
    d = m.resolved_head_dim
    full = b * s * m.d_model * a  # A
    residual = full // t if st.sp else full
    if st.pipeline is not None and remat in ("dots", "full"):
        # A stage's matmuls are a custom VJP of their own, which the dots policy does not
        # save: only the block input, as under full (and a MoE router's float32 logits).
        router = st.tokens * m.moe.num_experts * 4 if moe and remat == "dots" else 0
        return residual + router
    # XLA:CPU keeps every saved stack in float32 under the remat policies
    # (docs/cost-model.md, "XLA:CPU's terms").
    if st.xla_cpu and remat != "none":
        residual, a = residual * 4 // a, 4
    q = b * s * (m.n_heads // t) * d * a
    kv = 2 * b * s * (m.n_kv_heads // t) * d * a
    mlp = b * s * (m.d_ff // t) * a
    # Flash attention's custom VJP keeps its float32 output and log-sum-exp whatever the policy.
    flash = b * s * (m.n_heads // t) * (d + 1) * 4 if st.flash else 0
    if remat == "full":
        return residual + flash
    if remat == "attention":
        # q, k, v and the attention output (by name), and the attention branch's output, laid
        # out as the residual stream; the MLP (or the MoE layer) is recomputed.
        return 2 * residual + q + kv + q + flash
    ffn = _moe_activations(st, remat) if moe else (3 if remat == "none" else 2) * mlp
    if remat == "dots":
        # post_norms: the MLP's output, which its post-norm's backward pass reads, saved too
        outputs = (2 if m.post_norms else 1) * full * a // st.a
        return residual + q + kv + outputs + ffn + flash
    # The norms (_norms); rotated q, k and v; the attention output; gate, up and their product;
    # the float32 probabilities, plus a compute-dtype copy for the weighted sum when that dtype
    # is narrower.
    keys = st.s if st.c > 1 else s  # allgather attention: local queries x the whole sequence
    probs = 0 if st.flash else b * (m.n_heads // t) * s * keys * (4 + (a if a < 4 else 0))
    return _norms(st) + q + kv + q + ffn + probs + flash


def _host_activations(st: StepSizes, moe: bool) -> int:
    """Bytes one layer keeps in host memory per micro-batch (``offload_dots`` on GPU/TPU, no
    pipeline)."""
    if st.cfg.train.remat != "offload_dots" or st.xla_cpu or st.pipeline is not None:
        return 0
    return _layer_activations(st, "dots", moe) - _layer_activations(st, "full", moe)


def _unit_activations(st: StepSizes, blocks: list[bool], kept_weights: int = 0) -> int:
    """Bytes one scanned unit saves on the device, averaged over ``train.remat_every``."""
    cfg, k = st.cfg, st.cfg.train.remat_every
    policy = sum(_layer_activations(st, cfg.train.remat, moe) for moe in blocks)
    if cfg.train.remat == "none":
        return policy + kept_weights
    everything = sum(_layer_activations(st, "none", moe) for moe in blocks) + kept_weights
    return (policy + (k - 1) * everything) // k


def _stage_layer(st: StepSizes, moe: bool) -> int:
    """A stage's backward slot under ``remat=dots``/``full``: one recomputed layer's
    ``remat=none`` set and norm output (XLA:CPU's in bf16 differs)."""
    layer = _layer_activations(st, "none", moe) + st.act
    if not st.xla_cpu or st.a == 4 or moe or st.sp:
        return layer
    m, tokens = st.cfg.model, st.b * st.sl
    transposed = tokens * (2 * m.d_model + (m.d_ff + m.n_heads * m.resolved_head_dim) // st.t)
    return layer - _norms(st) - st.act + (10 * m.d_model * tokens + transposed) * 4


def _dense_ragged_dot(st: StepSizes) -> int:
    """XLA:CPU's working set for dropless ``ragged_dot``, run dense over every local expert."""
    m = st.cfg.model
    if not (st.xla_cpu and m.moe.enabled and m.moe.dispatch == "dropless"):
        return 0
    local, f, e = m.moe.num_experts // st.mesh["expert"], m.resolved_d_ff_expert // st.t, m.d_model
    if st.pipeline is None or st.cfg.train.remat == "none":
        masked = (4 * 4 + st.a) * e if st.a < 4 else 0
        return st.expert_rows * local * max((4 * f + e) * 4, masked)
    return (st.expert_rows * local * (6 * f + 2 * e) + 4 * local * f * e) * 4


def _head_backward(st: StepSizes, vocab: int) -> int:
    """What the loss's backward holds beside the logits, outside a pipeline."""
    if st.pipeline is not None:
        return 0
    head_f32 = st.cfg.model.d_model * vocab * 4
    partial_sums = head_f32 * (1 + st.xla_cpu) if st.loss_pieces > 1 else 0
    return partial_sums + (head_f32 if st.xla_cpu and st.a < 4 else 0)


def _float32_norm_temporaries(st: StepSizes) -> int:
    """XLA:CPU's float32 copies of the residual stream while recomputing norms in bf16."""
    if not st.xla_cpu or st.a == 4 or st.sp or st.pipeline is not None:
        return 0
    copies = 5 + (3 if st.cfg.model.post_norms else 0)
    return copies * st.b * st.sl * st.cfg.model.d_model * 4


def _cast_stack(st: StepSizes, params: list[ParamCost]) -> int:
    """The layer stack as its matmuls read it, cast once per step by GPU/TPU compilers."""
    if (st.pipeline is not None or st.xla_cpu or st.a == PARAM_BYTES
            or st.cfg.train.param_dtype != "float32"):
        return 0
    return sum(in_compute_dtype(p, p.stored_bytes_per_device or p.bytes_per_device, st.a)
               for p in params if p.stacked and p.matmul)


def _fsdp_gathered(st: StepSizes, params: list[ParamCost], layer_weights: int) -> int:
    """ZeRO-3 outside a pipeline: the larger layer's weights as read and their gradient, and the
    embedding, lm_head and final norm, gathered for the whole step."""
    if (st.cfg.parallel.zero != 3 or st.pipeline is not None
            or not any(p.gather_axes for p in params)):
        return 0
    dense = sum(in_compute_dtype(p, p.gathered_bytes, st.a)
                for p in params if p.dense_stack) // max(dense_units(st.cfg.model), 1)
    return 2 * max(layer_weights, dense) + sum(in_compute_dtype(p, p.gathered_bytes, st.a)
                                               for p in params
                                               if not (p.stacked or p.dense_stack))


def memory(st: StepSizes, params: list[ParamCost]) -> MemoryCost:
    """Bytes per device of one step (docs/cost-model.md, "Memory per device")."""
    cfg, m = st.cfg, st.cfg.model
    param_bytes = sum(p.stored_bytes_per_device for p in params)
    # Micro-steps add up their gradients in a float32 sum beside the stored-dtype gradient (not
    # LoRA's frozen base weights'; a pipeline folds its micro-steps into one schedule).
    accumulator = (sum(p.bytes_per_device for p in params if p.trained)
                   if st.accum > 1 and st.pipeline is None else 0)
    # bf16 parameters under float32 compute: the step reads float32 copies of them (the cast),
    # and its float32 weight gradients live until they are rounded to the stored dtype.
    widened = (sum(p.bytes_per_device for p in params if p.matmul)
               if cfg.train.param_dtype == "bfloat16" and st.a == 4 else 0)
    moments = sum(p.moment_bytes_per_device for p in params if p.trained)
    # ZeRO-1 outside a pipeline lays the gradients out like the moments (train/step.py), from
    # whole ones the GPU/TPU compilers keep until after the layer loop (docs/cost-model.md).
    zero1 = cfg.parallel.zero == 1 and st.pipeline is None
    whole_before_scatter = param_bytes if zero1 and not st.xla_cpu else 0
    gradient_bytes = moments if zero1 else sum(p.stored_bytes_per_device for p in params
                                               if p.trained)
    # The loss's float32 logits and their gradient, one loss piece at a time, and the
    # embedding's one-hot input, built for its gradient one slice of the vocabulary at a time.
    # (A pipeline's head and embedding are split over pipe as well: each stage its piece.)
    vocab = st.vocab_rows // st.t // (st.p if st.pipeline is not None else 1)
    one_hot = st.b * st.sl * vocab * st.a // st.embedding_grad_pieces
    logits = st.b * st.sl * vocab * (4 + 4) // st.loss_pieces
    head = logits + one_hot + 2 * st.act
    # The loss's backward pass, a phase of its own (before any layer's): the logits, the head
    # as read, and what its gradient needs (_head_backward).
    loss_phase = logits + 2 * st.act + m.d_model * vocab * st.a + _head_backward(st, vocab)
    # One layer's weights as its matmuls read them: cast to the compute dtype, gathered over
    # fsdp. remat=none keeps in every layer those it does not reshard after the forward pass
    # (all of them in a pipeline stage, which prepares its weights once per step).
    # (With MoE every=k > 1, a "layer" here is one scanned group of k blocks.)
    blocks = unit_blocks(m)
    units = layer_units(m)  # of the `layers` stack (DeepSeek's dense first blocks aside)
    layer_weights = sum(in_compute_dtype(p, p.gathered_bytes, st.a)
                        for p in params if p.stacked) // units
    # What a remat=none layer keeps of its weights: the stored shard of what it reshards (a
    # stacked residual), the rest as read. (A pipeline stage's weights, read once per step,
    # are its weight copies.)
    kept_weights = sum(p.stored_bytes_per_device or p.bytes_per_device if p.resharded
                       else in_compute_dtype(p, p.gathered_bytes, st.a)
                       for p in params if p.stacked) // units
    gathered = _fsdp_gathered(st, params, layer_weights)
    if st.flash:  # one block's float32 scores, probabilities and gradients, per head attended
        head += 4 * st.b * (m.n_heads // st.t // st.ulysses_group) * st.block * st.block * 4
    rows = cfg.train.batch_size // math.prod(st.mesh[a] for a in BATCH_AXES)
    per_layer = _unit_activations(st, blocks) // len(blocks)
    # The backward pass's working set: one layer's remat=none set (recomputed, or its
    # gradients) and the norm output its matmuls rebuild (A); in a pipeline stage, the
    # residuals of the chunk a slot is running (remat=none) or the layer it recomputes, and
    # what the head's step adds (cost/pipeline.py, "Memory of a stage").
    layer_set = (max(_layer_activations(st, "none", moe) for moe in blocks) + st.act
                 + _float32_norm_temporaries(st))
    saved_layers, stash, copies, before = units, 0, _cast_stack(st, params), 0
    if st.pipeline is not None:
        saved_layers, before = 0, before_loops(st, params)
        recomputed = (None if cfg.train.remat == "none"
                      else max(_stage_layer(st, moe) for moe in blocks))
        stash, copies, layer_set = pipeline_memory(st, params, per_layer, recomputed)
        head += stage_head(st)
    return MemoryCost(
        params=param_bytes,
        optimizer=sum(p.state_bytes_per_device for p in params)
        + state_counters(cfg.train.optimizer, cfg.train.weight_decay),
        gradients=gradient_bytes + accumulator + whole_before_scatter,
        batch=rows * st.sl * 12,
        activations=saved_layers * _unit_activations(st, blocks, kept_weights)
        + (dense_units(m) * _unit_activations(st, [False]) if st.pipeline is None else 0),
        host_activations=(units * sum(_host_activations(st, moe) for moe in blocks)
                          + dense_units(m) * _host_activations(st, False))
        // st.cfg.train.remat_every,
        working=max(layer_set + head + gathered + widened + _dense_ragged_dot(st), loss_phase),
        update=moments + muon_update_bytes(cfg, params),
        stash=stash,
        weight_copies=copies,
        gradient_sums=pipeline_gradient_sums(st, params),
        before_loops=before,
        buffers=sum(math.prod(b.shape) * PARAM_BYTES for b in model_buffers(m)),
        offloaded=cfg.train.offload.optimizer and not st.xla_cpu)
