"""The pipeline's share of the cost model: tick messages, stash memory, bubble time.

Kept together because they follow the executor and its schedule tables
(:mod:`jaxpar.parallel.pipeline`, :func:`~jaxpar.parallel.pipeline.describe`) and change with
them. Inside the stages every other parallelism's formula runs on the stage's layers once per
microbatch (:class:`jaxpar.inspect.cost_collectives.Ledger` counts those multiplicities).

``pipe`` (``parallel/pipeline.py``): the executor's loop issues two collective-permutes per tick of
the schedule table (activation forward, gradient backward, b/m x S/c x E each, /t under sequence
parallelism, zeros when a stage has nothing to send): 2 T g of them for a T-tick table. The shared
parameters' gradients (embedding, final norm, head: replicated over ``pipe``) are all-reduced over
``pipe`` once per micro-step. Inside the stages, every formula of
:mod:`~jaxpar.inspect.cost_collectives` runs on the stage's L/p layers once per microbatch (b is
then the microbatch), with the forward-side collectives repeated by the executor's recomputation
(x2 with B, x3 with a split I + W), the backward ones once (twice split), and the gradient
reductions over ``data`` / ``fsdp`` after every microbatch's backward (its chunk's layers; the
shared parameters on the first and last stage only, 1/p of the runs on average, since the compiled
counts are averaged over stages by :mod:`jaxpar.inspect.report`). Checked against XLA:CPU on tiny
with pipe=2 and tensor=2, data=2 or fsdp=2: within 2% (tests/test_cost.py). Stash memory: the
table's slots (``describe``) x one message. Time: compute / (1 - bubble).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from jaxpar.inspect.cost_shapes import StepSizes

if TYPE_CHECKING:
    from jaxpar.inspect.cost_collectives import Ledger


def pipeline_collectives(c: Ledger) -> None:
    """Every tick of the table each device sends one activation forward and one gradient
    backward (zeros when its entry sends nothing); the replicated shared parameters' gradients
    are summed over the stages once per micro-step."""
    st = c.st
    if st.pipeline is None:
        return
    g, ticks = st.accum, st.pipeline["ticks"]
    c.add("collective-permute", ("pipe",), 2 * ticks * g, 2 * ticks * g * st.sent,
          f"pipeline: activation forward + gradient backward, each of {ticks} ticks", False)
    c.add("all-reduce", ("pipe",), g, g * sum(p.bytes_per_device for p in c.other),
          "pipeline: embedding, final norm and head gradients summed over stages", True)


def pipeline_memory(st: StepSizes) -> tuple[int, int]:
    """(layers whose activations are saved at once, stash bytes). Between a chunk's F and its
    backward only its input is kept (a stash slot); the backward recomputes one chunk at a
    time, saving what remat lets it for those layers."""
    saved_layers = st.layers // st.cfg.parallel.virtual_stages
    slots = st.pipeline["activation_slots"] + st.pipeline["gradient_slots"]
    return saved_layers, slots * st.act // (st.t if st.sp else 1)


def pipeline_compute(st: StepSizes, compute: float) -> float:
    """Idle ticks: the same work spread over more time."""
    return compute / (1 - st.pipeline["bubble"])


def pipeline_note(st: StepSizes) -> str:
    return (f"pipeline {st.pipeline['schedule']}: bubble {st.pipeline['bubble']:.1%} of the "
            "ticks idle (compute time divided by 1 - bubble); the executor recomputes each "
            f"chunk's forward {st.recomputes}x in the backward")
