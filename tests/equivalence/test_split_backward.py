"""The schedules that cut each backward into I and W (zero bubble, DualPipe-V) and the overlap of
a round's forward and backward, against the single-device run: loss, gradients and parameters
after 3 AdamW steps in fp32, with tensor and sequence parallelism, data, ring attention, every
remat policy and experts. Their compiled programs hold no collective under a conditional.
(Each at pipe=2 m=4 alone, and their matmul flops against 1F1B's: test_pipeline.py, which this
file shares its layouts' shape with; the cut itself on small functions: test_backward_split.py.)
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from helpers import (
    assert_grads_and_params_match,
    collectives_in_conditionals,
    in_model_order,
    run_layout,
)

MODEL = ("model.n_layers=8",)
REFERENCE = ("mesh.data=1", *MODEL)


def pipeline(schedule: str, p: int, m: int, *mesh: str, v: int = 1) -> tuple[str, ...]:
    chunks = (f"parallel.virtual_stages={v}",) if v > 1 else ()
    return (f"mesh.pipe={p}", *(mesh or ("mesh.data=1",)), f"train.microbatches={m}",
            f"parallel.pipeline_schedule={schedule}", *chunks, *MODEL)


LAYOUTS = {
    # The schedules that split B into I and W (zero bubble, DualPipe-V): interleaved zero
    # bubble, and each beside tensor parallelism with sequence parallelism (and data at pipe=2).
    "zero_bubble,v=2,pipe=2,m=4": pipeline("zero_bubble", 2, 4, v=2),
    "zero_bubble,v=2,pipe=4,m=8": pipeline("zero_bubble", 4, 8, v=2),
    **{f"{s},v={v},pipe={p},tensor=2,sp{',data=2' if p == 2 else ''}": pipeline(
        s, p, 2 * p, "mesh.tensor=2", *(("mesh.data=2",) if p == 2 else ("mesh.data=1",)),
        "parallel.sequence_parallel=true", v=v)
       for s, v in (("zero_bubble", 1), ("zero_bubble", 2), ("dualpipe_v", 2)) for p in (2, 4)},
    # Every remat policy under the split: I recomputes what the policy drops, and what W needs
    # of it waits in the W stash (backward_split.py).
    **{f"zero_bubble,pipe=2,m=4,{remat}": pipeline("zero_bubble", 2, 4, "mesh.data=1",
                                                   f"train.remat={remat}")
       for remat in ("full", "dots", "attention")},
    "dualpipe_v,pipe=2,m=4,full": pipeline("dualpipe_v", 2, 4, "mesh.data=1", "train.remat=full",
                                           v=2),
    # One layer loop for a round's forward and backward (parallel.pipeline_overlap).
    **{f"{s},overlap,pipe=2,m=4": pipeline(s, 2, 4, "mesh.data=1",
                                           "parallel.pipeline_overlap=true", v=v)
       for s, v in (("1f1b", 1), ("interleaved", 2), ("zero_bubble", 1), ("dualpipe_v", 2))},
    "zero_bubble,overlap,pipe=2,tensor=2,sp,data=2": pipeline(
        "zero_bubble", 2, 4, "mesh.tensor=2", "mesh.data=2", "parallel.sequence_parallel=true",
        "parallel.pipeline_overlap=true"),
    # Ring attention (zigzag) inside DualPipe-V's stages.
    "dualpipe_v,pipe=2,context=2,tensor=2,ring": pipeline(
        "dualpipe_v", 2, 4, "mesh.data=1", "mesh.context=2", "mesh.tensor=2",
        "parallel.context_impl=ring", v=2),
}

# The default suite runs interleaved zero bubble with tensor, sequence parallelism and data,
# and the overlap once; the rest with `pytest -m slow tests/equivalence/test_split_backward.py`.
DEFAULT = {"zero_bubble,v=2,pipe=2,tensor=2,sp,data=2", "zero_bubble,overlap,pipe=2,m=4"}


@pytest.mark.parametrize("name", [n if n in DEFAULT else pytest.param(n, marks=pytest.mark.slow)
                                  for n in LAYOUTS])
def test_split_backward_pipeline_matches_single_device_loss_grads_and_params(name):
    got, ref = run_layout(LAYOUTS[name]), run_layout(REFERENCE)
    assert abs(got["loss"] - ref["loss"]) / ref["loss"] < 1e-5
    grads, params = in_model_order(got)
    assert_grads_and_params_match({"grads": grads, "params": params}, ref)
    assert abs(got["last_loss"] - ref["last_loss"]) / ref["last_loss"] < 1e-5


@pytest.mark.parametrize("name", [
    *sorted(DEFAULT), pytest.param("dualpipe_v,pipe=2,context=2,tensor=2,ring",
                                   marks=pytest.mark.slow)])
def test_no_collective_runs_under_control_flow_in_a_split_backward_step(name):
    # I and W, the overlap's one loop and the V's sends both ways: every device runs the same
    # program, with the collectives of the stages (tensor, ring) outside any conditional.
    hlo = run_layout(LAYOUTS[name])["trainer"].compile_step().as_text()
    assert collectives_in_conditionals(hlo) == [], name


# Mixture of experts inside the stages, with expert parallelism: the objective's MoE aux losses
# are per microbatch, so the reference is the 1-device run with as many micro-steps.
MOE = ("model.n_layers=4", "model.moe.num_experts=4", "model.moe.top_k=2",
       "model.moe.router=sigmoid_bias")


@pytest.mark.slow  # about 70 s each; MoE in 1F1B stages runs by default (test_pipeline.py)
@pytest.mark.parametrize("schedule,v", [
    ("dualpipe_v", 2), ("zero_bubble", 1), ("zero_bubble", 2)])
def test_moe_pipeline_that_splits_backwards_into_i_and_w_matches_one_device(schedule, v):
    # The experts' weight gradients (W) apart from the all-to-alls that bring their input
    # gradients back (I): each routed expert's dw waits for its W with its rows' gradients.
    ref = run_layout(("mesh.data=1", "train.grad_accum=4", *MOE))
    got = run_layout(("mesh.pipe=2", "mesh.expert=2", "mesh.data=1", "train.microbatches=4",
                      f"parallel.pipeline_schedule={schedule}", f"parallel.virtual_stages={v}",
                      *MOE))
    assert abs(got["loss"] - ref["loss"]) / ref["loss"] < 1e-5
    grads, params = in_model_order(got)
    assert_grads_and_params_match({"grads": grads, "params": params}, ref)
    buffers = got["trainer"].to_model_order(got["state"]).buffers  # the router biases
    jax.tree.map(np.testing.assert_allclose, jax.device_get(buffers),
                 jax.device_get(ref["state"].buffers))
