"""The pipeline's share of the cost model: tick messages, FSDP by hand, memory, bubble time.

Kept together because they follow the executor and its schedule tables
(:mod:`jaxpar.parallel.pipeline.executor`, :func:`~jaxpar.parallel.pipeline.executor.describe`) and
change with them. Inside the stages every other parallelism's formula runs on the stage's layers
once per microbatch (:class:`jaxpar.cost.ledger.Ledger` counts those multiplicities).

``pipe`` (``parallel/pipeline/executor.py``): each executor step with a forward slot sends one
activation on (b/m x S/c x E, /t under sequence parallelism; both ways in DualPipe-V's V), and
each step that embeds (a stage's forward is the first chunk) all-reduces the embedding pieces
over ``pipe``; each step with the head (a stage's forward is the last chunk) all-reduces two more
(the last stage's output, the head's input gradient) plus three [b/m, S/c] float32 loss statistics
(three per piece of the sequence under ``train.loss_chunks``, the same bytes); each step with a
backward slot sends one gradient back, and each step where a stage's backward is the first
chunk's all-reduces chunk 0's input gradient (``describe``'s ``embed_steps``,
``embed_back_steps``). The all-reduced
activations keep sequence parallelism's tensor split, like the sends (XLA:CPU's psums are [b/m,
S/(c t), E]). They travel in the compute dtype (one stage's value, zeros from the others: exact),
except the head's input gradient, whose pieces all contribute: float32
(``parallel/pipeline/stages.py: head_and_loss``). The last step's send is never read (XLA drops
it). The vocabulary pieces' gradients (embedding, head) are summed over ``pipe`` once per
step. ``train.grad_accum`` micro-steps are folded into the schedule: the step counts are
those of one schedule over ``g x m`` microbatches (``describe``). Inside the stages, every
formula of :mod:`~jaxpar.cost.collectives` runs on the stage's layers (and its share of the
MoE layers) once per executed slot (masked ones included: ``StepSizes.executed``); the
executor sums gradients over ``data``, ``fsdp``, ``expert`` and ``context`` by hand once per
step and gathers FSDP weights (the experts' too) once.

DeepSeek's dense first blocks (``model.moe.first_dense``) run before the pipeline with the
embedding, on the batch rows split over ``pipe`` too (executor docstring): no embedding
all-reduce in the forward steps; one all-gather over ``pipe`` of their output per step (``B/d x
S/c x E`` in the compute dtype); and the embedding's and dense blocks' gradients all-reduced
over the batch axes and ``pipe`` together once per step (``cost/collectives.py``,
``data_collectives``); under FSDP their weights are gathered layer by layer, forward and
backward, once per step (``fsdp_collectives``). Measured on tiny (MLA, ``pipe=2 expert=2``,
1F1B): every row of ``jaxpar inspect --compare`` at 1.00, peak memory 0.99. At DeepSeek-V3
widths (``deepseek-v3 --devices 64 model.n_layers=3 model.moe.first_dense=1 mesh.pipe=2
mesh.expert=8 mesh.fsdp=4 train.batch_size=64 train.microbatches=2``, XLA:CPU) every row is at
1.00 except the all-gather over ``pipe`` (2.00: 224 MiB compiled against 112 MiB, not yet
explained) and peak memory (1.17: the pre-phase's residuals are not in the memory model).

FSDP by hand with ``tensor``: the executor gathers and reduce-scatters each
weight's own ``tensor`` shard over ``fsdp`` (``parallel/manual.py: ByHand``), so those
collectives move what they would without a pipeline, once per step.

Memory of a stage: the peak is the larger of two phases (both beside the state, the stashes and
the gradient sums; the gradient shards exist only after the loops, when the sums are
reduce-scattered):

- inside the stretch loops, at a step with a backward slot and the head: the weights as read,
  the working set of the chunk a backward slot runs, and the head's;
- before the loops: the embedding and head gathered whole over ``fsdp`` in float32 and the head
  cast to the compute dtype, from which each stage cuts its vocabulary piece.

What each part holds:

- the stashes: arrived inputs and output gradients (one activation per slot; the output-gradient
  stash counts twice: XLA copies it where one stretch's loop hands it to the next while the old
  one is still read, seen on tiny; the real-width peaks below hold it once) and forward
  residuals (what remat saves for a chunk's layers per slot), each stash with one spare slot
  that masked writes go to. The residuals are jax's VJP residuals as they are: a stage's
  matmuls keep their inputs (the norms' outputs too, which outside a pipeline are rebuilt from
  the norms' inputs) under ``remat=none``; under ``dots`` as under
  ``full`` only each layer's input (the matmuls are a custom VJP, which the dots policy does not
  save: one ``[slots, layers, b/m, S, E]`` leaf, and the same compiled peak for both policies,
  on tiny and at Llama-3-8B widths);
- the working set of a backward slot: under ``remat=none`` its chunk's residuals, fresh from the
  forward or read back (nothing is recomputed); under ``dots``/``full`` one recomputed layer's
  ``remat=none`` set, as outside a pipeline (on XLA:CPU in bf16 its residual stream in float32:
  ``cost/memory.py: _stage_layer``; a MoE layer's dense lowering of the grouped matmul:
  ``_dense_ragged_dot``); and the chunk's weight gradients as the slot builds them
  (``chunk_gradients``: the chunk's weights as read, in the compute dtype), before they are
  added into the float32 sums;
- the head's step (``stage_head``): beside the logits, the embedding gradient of the stage's
  vocabulary piece (float32, built slice by slice into one buffer) and the head gradient's float32
  partial sums over the loss pieces; on XLA:CPU also each loss piece's product before it is added
  and, in bf16 compute, a float32 copy of the head piece for the input gradient's matmul;
- the weights as read (``stage_weights``): the stage's layers (compute dtype, FSDP-gathered,
  whole over tensor as above), loop-carried, and again the running layer's (one scanned unit),
  sliced from them in the layout its matmuls read (XLA:CPU, every schedule; in bf16 both are
  float32, since it runs bf16 dots in float32: at Llama-3-8B widths no bf16 copy of a layer
  weight is alive at the peak; at Mixtral widths with two layers a stage, the one layer's
  experts, not the stage's two); the head's vocabulary piece ``[E, V/(p t)]`` in the compute
  dtype and the embedding's piece in float32 (the lookup gathers its rows before the cast).
  FSDP's per-layer gathered working set does not exist in a stage: the weights are gathered
  once.
- with FSDP by hand, the gradient sums: the executor adds every microbatch's
  weight gradients into float32 sums of the weights as gathered (the stage's layers, and the
  embedding, head and final norm whole), kept for the whole step and reduce-scattered to the
  stored shards once at its end, so they are a buffer of their own beside those shards (the
  shards are the step's gradients). Without FSDP the sums are the gradients. (On llama-1b with
  pipe=2 fsdp=4 that is 2.3 GiB per device that the plan missed: the TPU compiler's peak was
  1.23x the plan's, 0.88x with the sums, before the accounting above.)

Under ``parallel.pipeline_fsdp=per_layer`` (:func:`per_layer_fsdp_collectives` for the bytes)
no stage copy of the weights: one layer gathered and again as its matmuls read it
(``stage_weights``); a backward slot builds one layer's float32 gradient whole and the chunk's
reduce-scattered ones (``chunk_gradients``); the layers' float32 sums are in their shards
(``pipeline_gradient_sums``). Llama-3-70B, ``pipe=4 fsdp=4 tensor=4`` + SP, 1F1B over 16
microbatches on ``tpu-v5p:4x4x4``: the TPU compiler's peak 1.02 of this (per_step: 1.00), temp
48.0 -> 25.0 GiB; on tiny (``pipe=2 fsdp=2 tensor=2`` + SP) the XLA:CPU peak 1.03.

At Llama-3-8B widths (bf16, remat=dots, 4 or 8 layers, pipe=4 fsdp=4 tensor=4 and pipe=4 fsdp=8
tensor=2, 8 microbatches; gpipe, 1F1B, interleaved) the compiled peak is within 5% of this
(``tests/integration/test_real_size.py``); the stash is 0.4-1.8 GiB of 6-8 GiB. 1F1B's and
interleaved's peak is in a step with a forward, a backward and the head; gpipe's in its
backward-only stretch, where XLA:CPU reads the residual stash through a float32 copy of it and
no head runs (what the head's step and the second output-gradient stash count instead). XLA:CPU
also copies the donated Adam moments at the step's start and reuses their buffers for
temporaries: no net bytes, except where they stay idle (gpipe: about 0.45 GiB of its 7.08). The
TPU compiler's peak for tests/integration/test_tpu_target.py's pipe=2 fsdp=4 and data=2 fsdp=2
(bf16, remat=dots) is 1.00 of this plan.

Checked against XLA:CPU on tiny with pipe=2 and tensor=2, data=2, data=4 (interleaved) or pipe=4
fsdp=2, pipe=2 fsdp=2 tensor=2 with SP, a MoE model with pipe=2 expert=2 tensor=2, and the
memory of sequences of 128 tokens (tests/equivalence/test_cost_vs_compiled.py). Time: compute
x the executed-work factor = compute / (1 - bubble).
"""

from __future__ import annotations

from jaxpar.cost.ledger import EXPOSED, HIDDEN, Ledger
from jaxpar.cost.params import PARAM_BYTES, ParamCost, in_compute_dtype, unit_blocks
from jaxpar.cost.shapes import StepSizes


def pipeline_collectives(c: Ledger) -> None:
    """Sends and all-reduces over ``pipe`` per executor step (module docstring)."""
    st = c.st
    if st.pipeline is None:
        return
    # The steps of the one schedule a step runs (train.grad_accum folded in: describe()).
    forward, backward = st.pipeline["forward_steps"], st.pipeline["backward_steps"]
    head = st.pipeline["head_steps"]
    # A send a step for each of its slots, each way in DualPipe-V's V (parallel/pipeline/
    # slots.py, _send), less those the compiler drops (program.compiled_sends).
    ways = 2 if st.pipeline.get("placement") == "v" else 1
    sends = st.pipeline["sends"]
    c.add("collective-permute", ("pipe",), sends, sends * st.sent,
          f"pipeline: activations forward ({forward} steps), gradients back ({backward})"
          + (", both ways in the V" if ways == 2 else ""), EXPOSED)
    # (With dense first blocks the embedding's sum is the pre-phase's: cost/collectives.py.)
    # (A LoRA run's embedding and head are frozen: no piece gradients, and chunk 0's input
    # gradient is not summed for them: the executor's Frozen.)
    vocab = [p for p in c.other if p.name in ("embedding", "lm_head") and p.trained
             and not (c.dense and p.name == "embedding")]
    into_first = st.pipeline["embed_back_steps"] if vocab_trained(st) else 0
    sums = 1  # the vocabulary pieces' gradients: once per step, after all microbatches
    # DeepSeek's dense first blocks: the pre-phase (embedding and dense blocks, rows split over
    # pipe) replaces the per-step embedding all-reduce; its output is gathered over pipe once
    # per step (executor docstring; its weights' gradients: cost/collectives.py, data).
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
    """Whether the stages gather their layers over ``fsdp`` one at a time
    (``parallel.pipeline_fsdp=per_layer``, :mod:`jaxpar.parallel.pipeline.per_layer`)."""
    return (st.pipeline is not None and st.mesh["fsdp"] > 1
            and st.cfg.parallel.pipeline_fsdp == "per_layer")


def per_layer_fsdp_collectives(c: Ledger, layer: list[ParamCost]) -> None:
    """``parallel.pipeline_fsdp=per_layer``: a stage's layers over ``fsdp``, per step.

    With ``W_c`` a chunk's layer weights gathered (``gathered_bytes / v`` of the stacked
    parameters: the stage's ``L_s/v`` layers) and ``F``, ``B``, ``I``, ``W`` the executed steps
    of the step's one schedule (``train.grad_accum`` folded in) with a forward slot, a backward
    slot (B or I), an I slot and a W slot (masked ones run too):

    - all-gather: ``(F + B + W) L_s/v`` times per weight, ``(F + B + W) W_c`` bytes in the
      compute dtype (every slot gathers each layer of its chunk as it runs it; with
      ``pipeline_stash=inputs`` a backward slot runs its chunk's forward first: ``F + 2B``);
    - reduce-scatter: ``(B - I + W) L_s/v`` times, ``(B - I + W) W_c`` bytes in
      ``parallel.reduce_dtype`` (every slot that makes weight gradients scatters each layer's).

    Against ``per_step``'s one gather and one reduce-scatter of ``L_s`` layers per step, the
    gathers move ``(F + B + W) / v`` times the bytes (2 (g m + p - 1) for 1F1B at v = 1 with
    ``g`` micro-steps)."""
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
    """Whether the embedding and head train (not under LoRA, whose executor holds them frozen:
    no gradient of theirs is built, held or summed)."""
    return st.cfg.train.lora.rank == 0


def pipeline_gradient_sums(st: StepSizes, params: list[ParamCost]) -> int:
    """Bytes of the executor's float32 gradient sums where they are not the step's gradients:
    under FSDP by hand, whole over ``fsdp`` (module docstring, "Memory of a stage"); under
    ``pipeline_fsdp=per_layer`` the layers' sums are in their stored split (as the
    gradients), the embedding's, head's and final norm's whole."""
    if st.pipeline is None or st.mesh["fsdp"] == 1:
        return 0
    if per_layer_fsdp(st):
        return sum(p.stored_bytes_per_device or p.bytes_per_device if p.stacked
                   else p.gathered_bytes for p in params if p.trained)
    return sum(p.gathered_bytes for p in params if p.trained)


def stage_weights(st: StepSizes, params: list[ParamCost]) -> int:
    """Bytes of a stage's weights as read: its layers and the running layer's again, its
    vocabulary piece of the head (compute dtype) and of the embedding (float32) (module
    docstring)."""
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
    """Under ``pipeline_fsdp=per_layer`` on the GPU/TPU compilers: the stage's stored layer
    shards cast to the compute dtype once per step. A slot casts each layer's shard before its
    gather (half the bytes in bf16), inside the layer loops; the compiler hoists that cast of
    loop-invariant weights out of the loops, for the whole stage (as it does outside a
    pipeline: ``cost/memory.py: _cast_stack``). Seen in libtpu 0.0.52's heap at its peak for
    Llama-3-70B at ``pipe=4 fsdp=4 tensor=4``: 2.0 GiB of bf16 ``[1, 20, ...]`` shards. Its one
    layer whole at a time is then one weight at a time (the largest, gathered as read)."""
    if st.a == PARAM_BYTES or st.cfg.train.param_dtype != "float32":
        return 0
    return sum(in_compute_dtype(p, p.stored_bytes_per_device or p.bytes_per_device, st.a)
               for p in params if p.stacked and p.matmul)


def stage_head(st: StepSizes) -> int:
    """Bytes the head's step holds beside its logits (module docstring): float32 pieces
    ``[E, V/(p t)]``: the embedding gradient of the stage's piece, the head gradient's partial
    sums over the loss pieces, and on XLA:CPU each piece's product and (bf16) a float32 head."""
    piece = st.cfg.model.d_model * st.cfg.model.vocab_size // (st.p * st.t) * 4
    if not vocab_trained(st):  # frozen (LoRA): only the bf16 head's float32 copy on XLA:CPU
        return piece if st.xla_cpu and st.a < 4 else 0
    pieces = 1 + (st.loss_pieces > 1)
    if st.xla_cpu:
        pieces += 1 + (st.a < 4)
    return pieces * piece


def before_loops(st: StepSizes, params: list[ParamCost]) -> int:
    """Bytes of the phase before the stretch loops beside the stashes and the gradient sums: the
    embedding and head gathered whole over ``fsdp`` (float32; without FSDP they are the
    parameters) and the head cast to the compute dtype (module docstring)."""
    vocab = {p.name: p for p in params if p.name in ("embedding", "lm_head")}
    gathered = sum(p.gathered_bytes for p in vocab.values()) if st.mesh["fsdp"] > 1 else 0
    head = vocab.get("lm_head", vocab.get("embedding"))  # tied: the embedding is the head
    cast = in_compute_dtype(head, head.gathered_bytes, st.a) if head and st.a < 4 else 0
    return gathered + cast


def weight_stash_per_layer(st: StepSizes, moe: bool = False) -> int:
    """Bytes one layer's I leaves its W, one microbatch (zero bubble's W stash:
    :mod:`jaxpar.parallel.pipeline.backward_split`): the output gradient of every weight
    matmul, in the compute dtype, laid out as the matmul reads it (the column-parallel
    outputs' split over ``tensor``, the row-parallel outputs' gradients whole, as their weight
    gradient contracts them): q, k and v, the attention output projection's (A), gate and up,
    down's (A); a MoE layer's routed experts' per expert row instead of gate, up and down.
    Under ``remat`` policies that recompute them in I, the matmul inputs W cannot rebuild
    cheaply from the residuals wait too: ``full`` (and ``dots``, which in a stage keeps what
    ``full`` keeps) the attention output, the MLP's input (A) and down's input; ``attention``
    down's input. (The norms' scales' gradients cross as well, ``E`` floats a layer: left
    out.)"""
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
    """(stash bytes, weights as read, a backward slot's working set) of a stage (module
    docstring, "What each part holds"): the chunk's residuals under ``remat=none``, else
    ``recomputed_layer``, one layer's working set as its backward recomputes it; with I and W
    apart (zero bubble, DualPipe-V), each slot of the W stash
    (:func:`weight_stash_per_layer`, per layer). With ``pipeline_stash=inputs`` a residual
    slot holds the chunk's input (one activation), and a backward slot makes the chunk's
    residuals again for its microbatch beside the working set."""
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
    """Bytes of the running chunk's weight gradients as a backward slot builds them: the
    weights as read (compute dtype, gathered), before they are added into the float32 sums."""
    stack = sum(in_compute_dtype(p, p.gathered_bytes, st.a) for p in params
                if p.stacked and p.trained)  # (LoRA: the adapters')
    v = st.cfg.parallel.virtual_stages
    if per_layer_fsdp(st):
        # One layer's gradient whole (float32 for its reduce-scatter); each scattered one is
        # added into the sums as the layer loop makes it (per_layer.layer_backward). The
        # GPU/TPU compilers scatter each weight's as it is made: one weight's at a time (the
        # largest; libtpu 0.0.52, Llama-3-70B: w_down's, 224 MiB, at the peak).
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
