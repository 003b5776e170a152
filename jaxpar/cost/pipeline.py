"""The pipeline's share of the cost model: messages over ``pipe``, memory of a stage, bubble.

It follows the executor and its schedule tables. Inside the stages every formula of
:mod:`~jaxpar.cost.communication` runs on the stage's layers once per executed slot. Time:
compute / (1 - bubble). Part by part: docs/pipelines.md, "What the plan counts".
"""

from __future__ import annotations

from jaxpar.cost.ledger import EXPOSED, HIDDEN, Ledger
from jaxpar.cost.params import PARAM_BYTES, ParamCost, in_compute_dtype, unit_blocks
from jaxpar.cost.shapes import StepSizes


def pipeline_collectives(c: Ledger) -> None:
    """Sends and all-reduces over ``pipe`` per executor round (docs/pipelines.md, "Messages over
    pipe")."""
    st = c.st
    if st.pipeline is None:
        return
    # The rounds of the one schedule a step runs (train.grad_accum folded in: describe()).
    # describe()'s keys and the plan's descriptions below keep the word "steps" (a
    # contract); the code calls them rounds.
    forward, backward = st.pipeline["forward_steps"], st.pipeline["backward_steps"]
    head = st.pipeline["head_steps"]
    # A send a round for each of its slots, each way in DualPipe-V's V (parallel/pipeline/
    # slots.py, _send), less those the compiler drops (program.compiled_sends).
    ways = 2 if st.pipeline.get("placement") == "v" else 1
    sends = st.pipeline["sends"]
    c.add("collective-permute", ("pipe",), sends, sends * st.sent,
          f"pipeline: activations forward ({forward} steps), gradients back ({backward})"
          + (", both ways in the V" if ways == 2 else ""), EXPOSED)
    # (With dense first blocks the embedding's sum is the pre-phase's: cost/communication.py.)
    # (A LoRA run's embedding and head are frozen: no piece gradients, and chunk 0's input
    # gradient is not summed for them: the executor's Frozen.)
    vocab = [p for p in c.other if p.name in ("embedding", "lm_head") and p.trained
             and not (c.dense and p.name == "embedding")]
    into_first = st.pipeline["embed_back_steps"] if vocab_trained(st) else 0
    sums = 1  # the vocabulary pieces' gradients: once per step, after all microbatches
    # DeepSeek's dense first blocks: the pre-phase (embedding and dense blocks, rows split over
    # pipe) replaces the per-round embedding all-reduce; its output is gathered over pipe once
    # per step (docs/pipelines.md, "Dense first blocks"; its weights' gradients:
    # cost/communication.py, data).
    embeds = 0 if c.dense else st.pipeline["embed_steps"]
    if c.dense:
        x0 = st.runs * st.tokens_x_embed(st.a)  # every microbatch of the step
        c.add("all-gather", ("pipe",), 1, x0,
              "pipeline: the dense first blocks' output gathered for the stages", EXPOSED)
    c.add("all-reduce", ("pipe",),
          embeds + 3 * head * st.loss_pieces + into_first + sums * len(vocab),
          ((embeds + head + into_first) * st.sent + head * st.sent * 4 // st.wire
           + 3 * head * st.b * st.sl * 4)
          + sums * sum(p.bytes_per_device for p in vocab),
          "pipeline: embedding (forward steps), last output and head gradient (head steps), "
          "chunk 0's input gradient (backward steps), vocabulary-piece gradients", HIDDEN)


def per_layer_fsdp(st: StepSizes) -> bool:
    """Whether stages gather layers over ``fsdp`` one at a time (``pipeline_fsdp=per_layer``)."""
    return (st.pipeline is not None and st.mesh["fsdp"] > 1
            and st.cfg.parallel.pipeline_fsdp == "per_layer")


def per_layer_fsdp_collectives(c: Ledger, layer: list[ParamCost]) -> None:
    """``pipeline_fsdp=per_layer``: each slot gathers its chunk's layers over ``fsdp``; each slot
    making weight gradients reduce-scatters them (docs/pipelines.md, "FSDP layer by layer").
    ``pipeline_stash=inputs``: a backward slot gathers twice (``F + 2B``)."""
    st = c.st
    if not layer:
        return
    info, v = st.pipeline, st.cfg.parallel.virtual_stages
    units = st.layers // len(unit_blocks(st.cfg.model)) // v  # scanned units of a chunk
    gathers = info["forward_steps"] + info["backward_steps"] + info["weight_steps"]
    if st.stashes_inputs:  # the chunk's forward again, in each backward slot
        gathers += info["backward_steps"]
    scatters = info["backward_steps"] - info["input_steps"] + info["weight_steps"]
    c.add("all-gather", ("fsdp",), gathers * units * len(layer),
          gathers * sum(c.moved(p, p.gathered_bytes) for p in layer) // v,
          "stage weights gathered layer by layer, in every forward and backward slot", HIDDEN)
    trained = [p for p in layer if p.trained]
    c.add("reduce-scatter", ("fsdp",), scatters * units * len(trained),
          scatters * sum(c.grad(p, p.gathered_bytes, by_hand=True) for p in trained) // v,
          "stage weight gradients reduce-scattered layer by layer, in every slot making them",
          HIDDEN)


def vocab_trained(st: StepSizes) -> bool:
    """Whether embedding and head train (not under LoRA: frozen, no gradient built or summed)."""
    return st.cfg.train.lora.rank == 0


def pipeline_gradient_sums(st: StepSizes, params: list[ParamCost]) -> int:
    """Bytes of the executor's float32 gradient sums where not the step's gradients
    (docs/pipelines.md, "What each part holds")."""
    if st.pipeline is None or st.mesh["fsdp"] == 1:
        return 0
    if per_layer_fsdp(st):
        return sum(p.stored_bytes_per_device or p.bytes_per_device if p.stacked
                   else p.gathered_bytes for p in params if p.trained)
    return sum(p.gathered_bytes for p in params if p.trained)


def stage_weights(st: StepSizes, params: list[ParamCost]) -> int:
    """Bytes of a stage's weights as read (docs/pipelines.md, "What each part holds")."""
    widened = 4 if st.xla_cpu else st.a  # XLA:CPU runs bf16 dots in float32
    stack = sum(in_compute_dtype(p, p.gathered_bytes, widened) for p in params if p.stacked)
    units = st.layers // len(unit_blocks(st.cfg.model))  # scanned units in a stage
    # per_layer: the one layer gathered, and again as its matmuls read it; no stage copy
    # (but on the TPU compiler the cast of the stage's shards: per_layer_stage_cast)
    layers = (2 if per_layer_fsdp(st) else units + 1) * stack // units
    if per_layer_fsdp(st) and not st.xla_cpu:
        layers = per_layer_stage_cast(st, params) + max(
            in_compute_dtype(p, p.gathered_bytes, st.a) for p in params if p.stacked) // units
    head = embedding = 0
    for p in params:
        if p.name == "embedding":
            embedding = p.gathered_bytes // st.p
            head = head or in_compute_dtype(p, p.gathered_bytes // st.p, st.a)
        elif p.name == "lm_head":
            head = in_compute_dtype(p, p.gathered_bytes // st.p, st.a)
    others = sum(p.gathered_bytes for p in params if not p.stacked
                 and p.name not in ("embedding", "lm_head"))  # the final norm, float32
    return layers + head + embedding + others


def per_layer_stage_cast(st: StepSizes, params: list[ParamCost]) -> int:
    """``pipeline_fsdp=per_layer`` on GPU/TPU compilers: stored layer shards cast to the compute
    dtype once per step, hoisted out of the loops (docs/pipelines.md, "FSDP layer by layer")."""
    if st.a == PARAM_BYTES or st.cfg.train.param_dtype != "float32":
        return 0
    return sum(in_compute_dtype(p, p.stored_bytes_per_device or p.bytes_per_device, st.a)
               for p in params if p.stacked and p.matmul)


def stage_head(st: StepSizes) -> int:
    """Bytes the head's step holds beside its logits (docs/pipelines.md, "What each part
    holds")."""
    piece = st.cfg.model.d_model * st.vocab_rows // (st.p * st.t) * 4
    if not vocab_trained(st):  # frozen (LoRA): only the bf16 head's float32 copy on XLA:CPU
        return piece if st.xla_cpu and st.a < 4 else 0
    pieces = 1 + (st.loss_pieces > 1)
    if st.xla_cpu:
        pieces += 1 + (st.a < 4)
    return pieces * piece


def before_loops(st: StepSizes, params: list[ParamCost]) -> int:
    """Bytes of the phase before the stretch loops, beside stashes and gradient sums
    (docs/pipelines.md, "Memory of a stage")."""
    vocab = {p.name: p for p in params if p.name in ("embedding", "lm_head")}
    gathered = sum(p.gathered_bytes for p in vocab.values()) if st.mesh["fsdp"] > 1 else 0
    head = vocab.get("lm_head", vocab.get("embedding"))  # tied: the embedding is the head
    cast = in_compute_dtype(head, head.gathered_bytes, st.a) if head and st.a < 4 else 0
    return gathered + cast


def weight_stash_per_layer(st: StepSizes, moe: bool = False) -> int:
    """Bytes one layer's I leaves its W per microbatch (docs/pipelines.md, "Zero bubble"), less
    the norm scales' gradients (``E`` floats a layer)."""
    m, b, s, a, t = st.cfg.model, st.b, st.sl, st.a, st.t
    d = m.resolved_head_dim
    full = b * s * m.d_model * a
    q = b * s * (m.n_heads // t) * d * a
    kv = 2 * b * s * (m.n_kv_heads // t) * d * a
    if moe:
        e = m.resolved_d_ff_expert
        shared = b * s * m.moe.num_shared_experts * e // t * a
        ffn = st.expert_rows * (2 * e // t * a + m.d_model * a) + 3 * shared
        inner = st.expert_rows * e // t * a + shared
    else:
        mlp = b * s * (m.d_ff // t) * a
        ffn, inner = 2 * mlp + full, mlp
    remat = st.cfg.train.remat
    recomputed = {"full": q + full + inner, "dots": q + full + inner, "attention": inner}
    return q + kv + full + ffn + recomputed.get(remat, 0)


def pipeline_memory(st: StepSizes, params: list[ParamCost], residuals_per_layer: int,
                    recomputed_layer: int | None) -> tuple[int, int, int]:
    """(stash bytes, weights as read, a backward slot's working set) of a stage
    (docs/pipelines.md, "What each part holds")."""
    blocks = unit_blocks(st.cfg.model)
    waiting_per_layer = sum(weight_stash_per_layer(st, moe) for moe in blocks) // len(blocks)
    layers = st.layers // st.cfg.parallel.virtual_stages
    chunk = layers * residuals_per_layer
    activation = st.act // (st.t if st.sp else 1)
    slots = st.pipeline["activation_slots"] + 1 + 2 * (st.pipeline["gradient_slots"] + 1)
    waits = st.pipeline.get("weight_stash_slots", 0)
    stashed = activation if st.stashes_inputs else chunk
    stash = (slots * activation + (st.pipeline["residual_slots"] + 1) * stashed
             + (waits + 1 if waits else 0) * layers * waiting_per_layer)
    working = chunk if recomputed_layer is None else recomputed_layer
    if st.stashes_inputs:
        # The chunk's residuals made again, beside the backward that reads them; under
        # per_layer that backward runs one layer at a time (remat=none: one layer's set).
        if recomputed_layer is None and per_layer_fsdp(st):
            working = residuals_per_layer
        working += chunk
    if waits:  # an I's crossing values, made for the whole chunk before they are stashed
        working += layers * waiting_per_layer
    return stash, stage_weights(st, params), working + chunk_gradients(st, params)


def chunk_gradients(st: StepSizes, params: list[ParamCost]) -> int:
    """Bytes of the running chunk's weight gradients in a backward slot: the weights as read
    (compute dtype, gathered), before the float32 sums."""
    stack = sum(in_compute_dtype(p, p.gathered_bytes, st.a) for p in params
                if p.stacked and p.trained)  # (LoRA: the adapters')
    v = st.cfg.parallel.virtual_stages
    if per_layer_fsdp(st):
        # One layer's gradient whole (float32 for its reduce-scatter); each scattered one is
        # added into the sums as the layer loop makes it (per_layer.layer_backward). The
        # GPU/TPU compilers scatter each weight's as it is made: one weight's at a time (the
        # largest, as at the peak in docs/pipelines.md, "FSDP layer by layer").
        units = st.layers // len(unit_blocks(st.cfg.model))
        grads = [p.gathered_bytes for p in params if p.stacked and p.trained]
        return (sum(grads) if st.xla_cpu else max(grads, default=0)) // units
    return stack // v


def pipeline_compute(st: StepSizes, compute: float) -> float:
    """Idle ticks: the same work spread over more time."""
    return compute * st.pipeline["executed_work_factor"]


def pipeline_note(st: StepSizes) -> str:
    stash = ("each chunk's input is stashed and the chunk run again in its backward slot "
             "(parallel.pipeline_stash=inputs)" if st.stashes_inputs else
             "nothing is recomputed beyond train.remat (forward residuals are stashed)")
    return (f"pipeline {st.pipeline['schedule']}: executed bubble {st.pipeline['bubble']:.1%} "
            f"(masked slots run too: compute time x {st.pipeline['executed_work_factor']:.2f}); "
            + stash)
