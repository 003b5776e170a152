"""The pipeline executor against the single-device run, and the collectives it compiles to.

Every schedule runs the same model (tiny with 8 layers, so 4 stages x 2 chunks divide it) on
the same batches as the 1-device reference: losses, gradients and parameters after 3 AdamW steps
must agree in fp32. The interleaved schedule stores layers in stage order
(``Trainer.layer_order``); its gradients and parameters are put back in model order to compare.
"""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest
from test_parallel_layouts import max_relative_error, per_step_bytes, run_layout

from jaxpar.parallel.pipeline_schedules import (
    schedule_table,
    stage_layer_order,
)

MODEL = ("model.n_layers=8",)
REFERENCE = ("mesh.data=1", *MODEL)


def pipeline(schedule: str, p: int, m: int, *mesh: str) -> tuple[str, ...]:
    v = ("parallel.virtual_stages=2",) if schedule == "interleaved" else ()
    return (f"mesh.pipe={p}", *(mesh or ("mesh.data=1",)), f"train.microbatches={m}",
            f"parallel.pipeline_schedule={schedule}", *v, *MODEL)


SCHEDULES = ["gpipe", "1f1b", "interleaved", "zero_bubble"]
LAYOUTS = {
    **{f"{s},pipe=2,m=4": pipeline(s, 2, 4) for s in SCHEDULES},
    **{f"{s},pipe=4,m=8": pipeline(s, 4, 8) for s in SCHEDULES},
    **{f"{s},pipe=2,tensor=2,data=2": pipeline(s, 2, 4, "mesh.tensor=2", "mesh.data=2")
       for s in SCHEDULES},
    # Composition: every other axis inside the stages (the demo's layout, remat included), and
    # gradient accumulation on top of microbatches.
    "1f1b,pipe=2,fsdp=2,context=2,dots": pipeline(
        "1f1b", 2, 2, "mesh.data=1", "mesh.fsdp=2", "mesh.context=2",
        "parallel.context_impl=allgather", "train.remat=dots"),
    "gpipe,pipe=2,tensor=2,data=2,sp,full": pipeline(
        "gpipe", 2, 2, "mesh.tensor=2", "mesh.data=2", "parallel.sequence_parallel=true",
        "train.remat=full"),
    "1f1b,pipe=2,data=2,grad_accum=2": pipeline("1f1b", 2, 2, "mesh.data=2",
                                                "train.grad_accum=2"),
}


def in_model_order(result: dict) -> tuple[dict, dict]:
    """Gradients and parameters with the stacked layers in model order."""
    order = result["trainer"].layer_order
    grads, params = result["grads"], result["params"]
    if order is None:
        return grads, params
    back = np.argsort(order)
    def unpermute(tree: dict) -> dict:
        return dict(tree, layers=jax.tree.map(lambda a: a[back], tree["layers"]))
    return unpermute(grads), unpermute(params)


# The default suite runs every schedule once at pipe=2 and the compositions; the other
# acceptance layouts (each a few compiles) run with `pytest -m slow tests/test_pipeline.py`.
DEFAULT = {"gpipe,pipe=2,m=4", "1f1b,pipe=2,m=4", "interleaved,pipe=2,m=4",
           "zero_bubble,pipe=2,m=4", "interleaved,pipe=4,m=8", "zero_bubble,pipe=2,tensor=2,data=2",
           "1f1b,pipe=2,fsdp=2,context=2,dots", "gpipe,pipe=2,tensor=2,data=2,sp,full",
           "1f1b,pipe=2,data=2,grad_accum=2"}


@pytest.mark.parametrize("name", [n if n in DEFAULT else pytest.param(n, marks=pytest.mark.slow)
                                  for n in LAYOUTS])
def test_pipeline_matches_single_device_loss_grads_and_params(name):
    got, ref = run_layout(LAYOUTS[name]), run_layout(REFERENCE)
    assert abs(got["loss"] - ref["loss"]) / ref["loss"] < 1e-5
    grads, params = in_model_order(got)
    grad_errors = max_relative_error(grads, ref["grads"])
    assert max(grad_errors.values()) < 1e-4, grad_errors
    param_errors = max_relative_error(params, ref["params"])
    assert max(param_errors.values()) < 1e-4, param_errors
    assert abs(got["last_loss"] - ref["last_loss"]) / ref["last_loss"] < 1e-5


def test_interleaved_stores_each_devices_chunks_together():
    # 8 layers, 2 stages, 2 chunks per stage: device 0 holds chunks 0 and 2 = layers 0,1 and 4,5.
    assert stage_layer_order(8, 2, 2) == [0, 1, 4, 5, 2, 3, 6, 7]
    assert stage_layer_order(8, 4, 1) == list(range(8))
    assert run_layout(LAYOUTS["interleaved,pipe=2,m=4"])["trainer"].layer_order is not None
    assert run_layout(LAYOUTS["1f1b,pipe=2,m=4"])["trainer"].layer_order is None


def test_interleaved_state_in_model_order_is_the_one_device_init():
    # What checkpoints store: the layers in model order, whatever order the run keeps them in.
    trainer = run_layout(LAYOUTS["interleaved,pipe=2,m=4"])["trainer"]
    reference = run_layout(REFERENCE)["trainer"]
    state = trainer.init()
    as_model = jax.device_get(trainer.to_model_order(state))
    jax.tree.map(np.testing.assert_array_equal, as_model.params,
                 jax.device_get(reference.init().params))
    back = jax.device_get(trainer.from_model_order(trainer.to_model_order(state)))
    jax.tree.map(np.testing.assert_array_equal, back, jax.device_get(state))


def collectives(name: str, kind: str, axes: tuple[str, ...]):
    return [c for c in run_layout(LAYOUTS[name])["collectives"]
            if c.kind == kind and c.axes == axes]


@pytest.mark.parametrize("name", ["interleaved,pipe=4,m=8", "zero_bubble,pipe=2,tensor=2,data=2"])
def test_pipeline_sends_activations_over_pipe_and_gathers_no_stage_params(name):
    result = run_layout(LAYOUTS[name])
    cfg = result["cfg"]
    m, p, v = cfg.train.microbatches, cfg.mesh.pipe, cfg.parallel.virtual_stages
    permutes = collectives(name, "collective-permute", ("pipe",))
    # One activation forward and one gradient backward per tick, whatever the stage does.
    ticks = len(schedule_table(cfg.parallel.pipeline_schedule, p, m, v))
    assert sum(c.executions for c in permutes) == 2 * ticks
    rows = cfg.train.batch_size // m // cfg.mesh.data
    activation = rows * cfg.train.seq_len * cfg.model.d_model * 4
    assert per_step_bytes(permutes) == 2 * ticks * activation
    # No parameter crosses pipe except the shared ones' gradients (embedding, final norm, head).
    pipe_kinds = {c.kind for c in result["collectives"] if "pipe" in c.axes}
    assert pipe_kinds == {"collective-permute", "all-reduce"}, pipe_kinds
    shared = sum(a.addressable_shards[0].data.nbytes
                 for key, tree in result["state"].params.items() if key != "layers"
                 for a in jax.tree.leaves(tree))
    all_reduce = per_step_bytes(collectives(name, "all-reduce", ("pipe",)))
    assert shared <= all_reduce <= shared + 256  # + the loss and a few scalars
    # Each device stores only its stage's layers.
    for leaf in jax.tree.leaves(result["state"].params["layers"]):
        assert leaf.addressable_shards[0].data.shape[0] == leaf.shape[0] // p


def test_each_device_runs_its_table_entry_through_one_switch():
    # The tick loop holds one conditional with a branch per (kind, position) plus idle, so an
    # idle or other stage's action costs a device nothing.
    result = run_layout(LAYOUTS["1f1b,pipe=2,m=4"])
    step_hlo = result["trainer"].compile_step().as_text()
    branches = [len(m.group(1).split(",")) for m in
                re.finditer(r"conditional\(.*branch_computations=\{([^}]*)\}", step_hlo)]
    assert 13 in branches, branches


# Mixture of experts inside the stages, with expert parallelism: the objective's MoE aux losses
# are per microbatch, so the reference is the 1-device run with as many micro-steps.
MOE = ("model.n_layers=4", "model.moe.num_experts=4", "model.moe.top_k=2",
       "model.moe.router=sigmoid_bias")


def test_moe_pipeline_with_expert_parallelism_matches_one_device_with_as_many_micro_steps():
    ref = run_layout(("mesh.data=1", "train.grad_accum=2", *MOE))
    got = run_layout(("mesh.pipe=2", "mesh.expert=2", "mesh.data=1", "train.microbatches=2",
                      "parallel.pipeline_schedule=1f1b", *MOE))
    assert abs(got["loss"] - ref["loss"]) / ref["loss"] < 1e-5
    grad_errors = max_relative_error(got["grads"], ref["grads"])
    assert max(grad_errors.values()) < 1e-4, grad_errors
    param_errors = max_relative_error(got["params"], ref["params"])
    assert max(param_errors.values()) < 1e-4, param_errors
    # The router biases move with the measured load: every layer's counts crossed the stages.
    jax.tree.map(np.testing.assert_allclose, jax.device_get(got["state"].buffers),
                 jax.device_get(ref["state"].buffers))
    kinds = {(c.kind, c.axes) for c in got["collectives"]}
    assert ("all-to-all", ("expert",)) in kinds and ("collective-permute", ("pipe",)) in kinds
