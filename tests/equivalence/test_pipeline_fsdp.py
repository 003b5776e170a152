"""FSDP inside pipeline stages layer by layer (``parallel.pipeline_fsdp=per_layer``) against
the single-device run, and the collectives it compiles to.

tiny with 8 layers on pipe=2 fsdp=2 tensor=2 (1F1B, and interleaved with 2 chunks a stage):
loss, gradients and parameters after 3 AdamW steps agree with one device in fp32; each layer's
weights are all-gathered over ``fsdp`` inside the executor's loops (forward and backward slots)
and its gradient reduce-scattered there, with no collective under a conditional. The memory
and bytes against the plan: tests/equivalence/test_cost_vs_compiled.py.
"""

from __future__ import annotations

import pytest
from helpers import (
    assert_grads_and_params_match,
    collectives_in_conditionals,
    in_model_order,
    per_step_bytes,
    record_stash,
    run_layout,
)

from jaxpar.config import load_config, validate
from jaxpar.parallel.pipeline.executor import describe

MODEL = ("model.n_layers=8",)
REFERENCE = ("mesh.data=1", *MODEL)


def layout(schedule: str, fsdp: str = "per_layer") -> tuple[str, ...]:
    # (interleaved: under remat=dots too, each layer's VJP recomputing inside its own gather)
    v = (("parallel.virtual_stages=2", "train.remat=dots") if schedule == "interleaved"
         else ("parallel.virtual_stages=2",) if schedule == "dualpipe_v" else ())
    return ("mesh.pipe=2", "mesh.data=1", "mesh.fsdp=2", "mesh.tensor=2",
            "train.microbatches=4", f"parallel.pipeline_schedule={schedule}", *v,
            f"parallel.pipeline_fsdp={fsdp}", *MODEL)


# The interleaved layout and per_step's bytes (a compile each) run in the slow suite:
# `pytest -m slow tests/equivalence/test_pipeline_fsdp.py`.
SCHEDULES = ["1f1b", pytest.param("interleaved", marks=pytest.mark.slow),
             # I and W apart, each layer's I and W cut from its own VJP (layerwise.layer_split)
             pytest.param("zero_bubble", marks=pytest.mark.slow),
             pytest.param("dualpipe_v", marks=pytest.mark.slow)]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_per_layer_fsdp_matches_single_device_loss_grads_and_params(schedule):
    got, ref = run_layout(layout(schedule)), run_layout(REFERENCE)
    assert abs(got["loss"] - ref["loss"]) / ref["loss"] < 1e-5
    assert abs(got["last_loss"] - ref["last_loss"]) / ref["last_loss"] < 1e-5
    grads, params = in_model_order(got)
    assert_grads_and_params_match({"grads": grads, "params": params}, ref)


# MoE, dropless routing: the objective's aux losses are per microbatch, so the reference runs
# as many micro-steps as the pipeline has microbatches (as tests/integration/test_pipeline_5d.py).
MOE = ("model.n_layers=4", "model.moe.num_experts=4", "model.moe.top_k=2",
       "model.moe.dispatch=dropless")


@pytest.mark.slow
def test_per_layer_fsdp_of_a_moe_model_matches_single_device():
    """The MoE layers' aux losses and statistics layer by layer, their experts split over
    expert (each device's own: never gathered over it)."""
    got = run_layout(("mesh.pipe=2", "mesh.data=1", "mesh.fsdp=2", "mesh.expert=2",
                      "train.microbatches=2", "parallel.pipeline_schedule=1f1b",
                      "parallel.pipeline_fsdp=per_layer", *MOE))
    ref = run_layout(("mesh.data=1", "train.grad_accum=2", *MOE))
    assert abs(got["loss"] - ref["loss"]) / ref["loss"] < 1e-5
    assert abs(got["last_loss"] - ref["last_loss"]) / ref["last_loss"] < 1e-5
    assert_grads_and_params_match(got, ref)


def over_fsdp(result: dict, kind: str) -> list:
    return [c for c in result["collectives"] if c.kind == kind and c.axes == ("fsdp",)]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_per_layer_gathers_and_scatters_each_layer_in_the_loops(schedule):
    result = run_layout(layout(schedule))
    cfg = result["cfg"]
    info = describe(schedule, 2, 4, cfg.parallel.virtual_stages)
    layers = cfg.model.n_layers // (2 * cfg.parallel.virtual_stages)  # a chunk's
    # The layers' gathers and reduce-scatters run in the slots' layer loops: once per layer of
    # a chunk per slot. (Those that run once: the embedding, head and final norm, gathered
    # and summed once per step as under per_step.)
    gathers = [c for c in over_fsdp(result, "all-gather") if c.executions > 1]
    scatters = [c for c in over_fsdp(result, "reduce-scatter") if c.executions > 1]
    assert gathers and scatters
    assert min(c.executions for c in gathers + scatters) >= layers
    runs = sum(c.executions for c in gathers)
    slots = info["forward_steps"] + info["backward_steps"]
    assert runs >= slots * layers, (runs, slots, layers)
    assert collectives_in_conditionals(result["hlo"]) == []


@pytest.mark.slow
def test_per_layer_moves_more_bytes_over_fsdp_than_per_step():
    per_layer = run_layout(layout("1f1b"))
    per_step = run_layout(layout("1f1b", "per_step"))
    assert max(c.executions for c in over_fsdp(per_step, "all-gather")) == 1
    assert (per_step_bytes(over_fsdp(per_layer, "all-gather"))
            > 4 * per_step_bytes(over_fsdp(per_step, "all-gather")))


def test_a_stashed_layer_holds_activations_but_not_its_gathered_weights(monkeypatch):
    # Each layer's VJP saves the weights gathered for it; the stash leaves them out (the
    # backward slot gathers them again), so a stashed microbatch costs activations only.
    from jaxpar.mesh import make_mesh
    from jaxpar.train.step import build_trainer

    seen = record_stash(monkeypatch)
    cfg = validate(load_config("tiny", ["mesh.pipe=2", "mesh.data=1", "mesh.fsdp=4",
                                        "train.microbatches=2", "train.remat=none",
                                        "parallel.pipeline_schedule=1f1b",
                                        "parallel.pipeline_fsdp=per_layer"]), 8)
    build_trainer(cfg, make_mesh(cfg)).compile_step()
    weights = [w for w in seen["weights"] if len(w[0]) > 2]  # one layer's matrices, [1, ...]
    assert seen["reused"] >= len(weights) > 0
    # gathered whole over fsdp=4: d_model 64 in full
    assert all(64 in shape for shape, _ in weights), weights
    assert not set(weights) & set(seen["stashed"]), seen["stashed"]
