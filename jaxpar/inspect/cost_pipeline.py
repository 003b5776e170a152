"""The pipeline's share of the cost model: tick messages, FSDP by hand, memory, bubble time.

Kept together because they follow the executor and its schedule tables
(:mod:`jaxpar.parallel.pipeline`, :func:`~jaxpar.parallel.pipeline.describe`) and change with
them. Inside the stages every other parallelism's formula runs on the stage's layers once per
microbatch (:class:`jaxpar.inspect.cost_collectives.Ledger` counts those multiplicities).

``pipe`` (``parallel/pipeline.py``): each executor step with a forward slot sends one activation
on (b/m x S/c x E, /t under sequence parallelism) and all-reduces the embedding pieces over
``pipe``; each step with the head (a stage's forward is the last chunk) all-reduces two more
(the last stage's output, the head's input gradient) plus three [b/m, S/c] float32 loss
statistics (three per piece of the sequence under ``train.loss_chunks``, the same bytes);
each step with a backward slot sends one gradient back and all-reduces chunk 0's
input gradient. The all-reduced activations keep sequence parallelism's tensor split, like the
sends (XLA:CPU's psums are [b/m, S/(c t), E]). The last step's send is never read (XLA drops
it). The vocabulary pieces' gradients (embedding, head) are summed over ``pipe`` once per
micro-step. Inside the stages, every formula of :mod:`~jaxpar.inspect.cost_collectives` runs
on the stage's layers (and its share of the MoE layers) once per executed slot (masked ones
included: ``StepSizes.executed``); the executor sums gradients over ``data``, ``fsdp``,
``expert`` and ``context`` by hand once per step and gathers FSDP weights (the experts' too)
once.

FSDP by hand with ``tensor``: the executor gathers and reduce-scatters each
weight's own ``tensor`` shard over ``fsdp`` (``parallel/pipeline_by_hand.py: ByHand``), so those
collectives move what they would without a pipeline, once per step.

Memory of a stage (the peak, inside the stretch loops):

- the stashes: arrived inputs and output gradients (one activation per slot; the output-gradient
  stash counts twice: XLA copies it where one stretch's loop hands it to the next while the old
  one is still read) and forward residuals (what remat saves for a chunk's layers per slot),
  each stash with one spare slot that masked writes go to. The residuals are jax's VJP residuals
  as they are: a stage's matmuls keep their inputs (the norms' outputs too, which outside a
  pipeline are rebuilt from the norms' inputs);
- the working set of the chunk a slot runs: its residuals, fresh from the forward or read back
  for the backward (one chunk's stash slot), in place of the one-layer working set of a step
  without a pipeline (nothing is recomputed);
- ``WEIGHT_COPIES`` copies of the stage's weights as read (compute dtype, FSDP-gathered, whole
  over tensor as above): XLA:CPU copies the loop-carried weights beside the stashes for every
  schedule (seen in the buffer assignment of gpipe, 1F1B and interleaved steps). FSDP's
  per-layer gathered working set does not exist in a stage: the weights are gathered once.
- with FSDP by hand, the gradient sums: the executor adds every microbatch's
  weight gradients into float32 sums of the weights as gathered (the stage's layers, and the
  embedding, head and final norm whole), kept for the whole step and reduce-scattered to the
  stored shards once at its end, so they are a buffer of their own beside those shards (the
  shards are the step's gradients). Without FSDP the sums are the gradients. (On llama-1b with
  pipe=2 fsdp=4 that is 2.3 GiB per device that the plan missed: the TPU compiler's peak was
  1.23x the plan's, 0.88x with the sums.)

Checked against XLA:CPU on tiny with pipe=2 and tensor=2, data=2, data=4 (interleaved) or pipe=4
fsdp=2, pipe=2 fsdp=2 tensor=2 with SP, a MoE model with pipe=2 expert=2 tensor=2, and the
memory of sequences of 128 tokens (tests/test_cost.py). Time: compute x the executed-work
factor = compute / (1 - bubble).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from jaxpar.inspect.cost_params import ParamCost, in_compute_dtype
from jaxpar.inspect.cost_shapes import StepSizes

if TYPE_CHECKING:
    from jaxpar.inspect.cost_collectives import Ledger

# Copies of the stage's weights (as read: compute dtype, FSDP-gathered) that XLA:CPU keeps
# beside the stashes while the stretch loops run, for every schedule (module docstring).
WEIGHT_COPIES = 2


def pipeline_collectives(c: Ledger) -> None:
    """Sends and all-reduces over ``pipe`` per executor step (module docstring)."""
    st = c.st
    if st.pipeline is None:
        return
    g = st.accum
    forward, backward = st.pipeline["forward_steps"], st.pipeline["backward_steps"]
    head = st.pipeline["head_steps"]
    sends = forward + backward - 1
    c.add("collective-permute", ("pipe",), sends * g, sends * g * st.sent,
          f"pipeline: activations forward ({forward} steps), gradients back ({backward})", False)
    vocab = [p for p in c.other if p.name in ("embedding", "lm_head")]
    sums = 1  # the vocabulary pieces' gradients: once per step, after all micro-steps
    c.add("all-reduce", ("pipe",),
          g * (forward + 3 * head * st.loss_pieces + backward) + sums * len(vocab),
          g * ((forward + 2 * head + backward) * st.sent + 3 * head * st.b * st.sl * 4)
          + sums * sum(p.bytes_per_device for p in vocab),
          "pipeline: embedding (forward steps), last output and head gradient (head steps), "
          "chunk 0's input gradient (backward steps), vocabulary-piece gradients", True)


def pipeline_gradient_sums(st: StepSizes, params: list[ParamCost]) -> int:
    """Bytes of the executor's float32 gradient sums where they are not the step's gradients:
    under FSDP by hand, whole over ``fsdp`` (module docstring, "Memory")."""
    if st.pipeline is None or st.mesh["fsdp"] == 1:
        return 0
    return sum(p.gathered_bytes for p in params)


def pipeline_memory(st: StepSizes, params: list[ParamCost],
                    residuals_per_layer: int) -> tuple[int, int, int]:
    """(stash bytes, weight copies' bytes, one chunk's residuals) of a stage (module
    docstring, "Memory")."""
    chunk = st.layers // st.cfg.parallel.virtual_stages * residuals_per_layer
    slots = st.pipeline["activation_slots"] + 1 + 2 * (st.pipeline["gradient_slots"] + 1)
    stash = slots * st.act // (st.t if st.sp else 1) + (st.pipeline["residual_slots"] + 1) * chunk
    weights = sum(in_compute_dtype(p, p.gathered_bytes, st.a)
                  for p in params)
    return stash, WEIGHT_COPIES * weights, chunk


def pipeline_compute(st: StepSizes, compute: float) -> float:
    """Idle ticks: the same work spread over more time."""
    return compute * st.pipeline["executed_work_factor"]


def pipeline_note(st: StepSizes) -> str:
    return (f"pipeline {st.pipeline['schedule']}: executed bubble {st.pipeline['bubble']:.1%} "
            f"(masked slots run too: compute time x {st.pipeline['executed_work_factor']:.2f}); "
            "nothing is recomputed beyond train.remat (forward residuals are stashed)")
