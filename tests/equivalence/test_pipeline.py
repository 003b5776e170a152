"""The pipeline executor against the single-device run, and the collectives it compiles to.

Every schedule runs the same model (tiny with 8 layers, so 4 stages x 2 chunks divide it) on
the same batches as the 1-device reference: losses, gradients and parameters after 3 AdamW steps
must agree in fp32. The interleaved schedule stores layers in stage order
(``Trainer.layer_order``); its gradients and parameters are put back in model order to compare.
Also the memory per schedule, compiled against the plan. The schedules' tables and the executor's
program, without a compile: tests/unit/test_pipeline_schedules.py, test_pipeline_program.py.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from helpers import (
    assert_grads_and_params_match,
    collectives_in_conditionals,
    compiled_temp_bytes,
    in_model_order,
    max_relative_error,
    per_step_bytes,
    record_stash,
    run_layout,
)

from jaxpar.config import load_config, validate
from jaxpar.inspect.hlo.flops import dot_flops
from jaxpar.parallel.pipeline.executor import describe
from jaxpar.parallel.pipeline.schedules import stage_layer_order

MODEL = ("model.n_layers=8",)
REFERENCE = ("mesh.data=1", *MODEL)


def pipeline(schedule: str, p: int, m: int, *mesh: str, v: int = 0) -> tuple[str, ...]:
    v = v or (2 if schedule == "interleaved" else 1)
    v = (f"parallel.virtual_stages={v}",) if v > 1 else ()
    return (f"mesh.pipe={p}", *(mesh or ("mesh.data=1",)), f"train.microbatches={m}",
            f"parallel.pipeline_schedule={schedule}", *v, *MODEL)


SCHEDULES = ["gpipe", "1f1b", "interleaved", "zero_bubble", "dualpipe_v"]
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
    # ... folded into the interleaved schedule: 2 chunks a stage over 2 x 2 microbatches.
    "interleaved,pipe=2,grad_accum=2": pipeline("interleaved", 2, 2, "mesh.data=1",
                                                "train.grad_accum=2"),
    # Ring attention (zigzag) inside the stages, beside tensor parallelism.
    "1f1b,pipe=2,context=2,tensor=2,ring": pipeline(
        "1f1b", 2, 2, "mesh.data=1", "mesh.context=2", "mesh.tensor=2",
        "parallel.context_impl=ring"),
    # ... and the head in 4 strided pieces of the sequence (train.loss_pieces), its vocabulary
    # split over pipe and tensor and the sequence over context.
    "zero_bubble,pipe=2,context=2,tensor=2,ring,loss_pieces=4": pipeline(
        "zero_bubble", 2, 2, "mesh.data=1", "mesh.context=2", "mesh.tensor=2",
        "parallel.context_impl=ring", "train.loss_pieces=4"),
    "1f1b,pipe=2,context=2,tensor=2,loss_pieces=4": pipeline(
        "1f1b", 2, 2, "mesh.data=1", "mesh.context=2", "mesh.tensor=2",
        "parallel.context_impl=allgather", "train.loss_pieces=4"),
}


# The default suite runs every schedule once at pipe=2 and the compositions; the other
# acceptance layouts (each a few compiles) run with
# `pytest -m slow tests/equivalence/test_pipeline.py`.
DEFAULT = {"gpipe,pipe=2,m=4", "1f1b,pipe=2,m=4", "interleaved,pipe=2,m=4",
           "zero_bubble,pipe=2,m=4",
           "1f1b,pipe=2,fsdp=2,context=2,dots", "gpipe,pipe=2,tensor=2,data=2,sp,full",
           "1f1b,pipe=2,data=2,grad_accum=2", "1f1b,pipe=2,context=2,tensor=2,ring",
           "zero_bubble,pipe=2,context=2,tensor=2,ring,loss_pieces=4",
           "dualpipe_v,pipe=2,m=4"}


@pytest.mark.parametrize("name", [n if n in DEFAULT else pytest.param(n, marks=pytest.mark.slow)
                                  for n in LAYOUTS])
def test_pipeline_matches_single_device_loss_grads_and_params(name):
    got, ref = run_layout(LAYOUTS[name]), run_layout(REFERENCE)
    assert abs(got["loss"] - ref["loss"]) / ref["loss"] < 1e-5
    grads, params = in_model_order(got)
    assert_grads_and_params_match({"grads": grads, "params": params}, ref)
    assert abs(got["last_loss"] - ref["last_loss"]) / ref["last_loss"] < 1e-5


# Gemma's settings (the pipeline embeds, scales and scores in code of its own).
GEMMA = ("model.post_norms=true", "model.embed_scale=true", "model.final_softcap=2",
         "model.mlp_activation=gelu_tanh", "model.query_scale=8", "model.qk_norm=true",
         "model.tie_embeddings=true")


@pytest.mark.slow  # about 40 s; Gemma's block outside pipelines, and windows in one, by default
def test_a_gemma_pipeline_matches_single_device_loss_grads_and_params():
    """Scaled embeddings (and their gradient) and soft-capped logits in vocabulary pieces over
    pipe and tensor, in pieces of the sequence: the one-device step's loss and gradients
    (within 1e-6, measured). The parameters after the steps get 1e-3: Adam's m / sqrt(v)
    magnifies the round-off of this model's near-zero gradient entries (5.3e-4 on wo)."""
    got = run_layout((*pipeline("1f1b", 2, 4, "mesh.tensor=2", "mesh.data=2"), *GEMMA,
                      "train.loss_pieces=2"))
    ref = run_layout((*REFERENCE, *GEMMA))
    assert abs(got["loss"] - ref["loss"]) / ref["loss"] < 1e-5
    assert abs(got["last_loss"] - ref["last_loss"]) / ref["last_loss"] < 1e-5
    grads, params = in_model_order(got)
    assert max(max_relative_error(grads, ref["grads"]).values()) < 1e-5
    assert max(max_relative_error(params, ref["params"]).values()) < 1e-3


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


@pytest.mark.parametrize("name", ["interleaved,pipe=4,m=8", pytest.param(
    "zero_bubble,pipe=2,tensor=2,data=2", marks=pytest.mark.slow)])
def test_pipeline_sends_activations_over_pipe_and_gathers_no_stage_params(name):
    result = run_layout(LAYOUTS[name])
    cfg = result["cfg"]
    m, p, v = cfg.train.microbatches, cfg.mesh.pipe, cfg.parallel.virtual_stages
    info = describe(cfg.parallel.pipeline_schedule, p, m, v)
    permutes = collectives(name, "collective-permute", ("pipe",))
    # One activation forward per round with a forward slot, one gradient back per round with a
    # backward slot, whatever the stage does in it; but in a stretch that runs once XLA drops
    # a send no stage makes for real (program.compiled_sends: the last round's, usually).
    assert info["sends"] <= info["forward_steps"] + info["backward_steps"]
    executed = sum(c.executions for c in permutes)
    assert executed == info["sends"]
    rows = cfg.train.batch_size // m // cfg.mesh.data
    activation = rows * cfg.train.seq_len * cfg.model.d_model * 4
    assert per_step_bytes(permutes) == executed * activation
    # Over pipe otherwise only all-reduces: the embedding pieces (rounds that embed), the last
    # output, the head gradient and loss statistics (rounds with the head), chunk 0's input
    # gradient (rounds where a stage's backward is chunk 0's), and the vocabulary pieces'
    # gradients once.
    pipe_kinds = {c.kind for c in result["collectives"] if "pipe" in c.axes}
    assert pipe_kinds == {"collective-permute", "all-reduce"}, pipe_kinds
    vocab = sum(a.addressable_shards[0].data.nbytes
                for key, a in result["state"].params.items() if key in ("embedding", "lm_head"))
    tokens = rows * cfg.train.seq_len
    head = info["head_steps"]
    expected = ((info["embed_steps"] + 2 * head + info["embed_back_steps"]) * activation
                + 3 * head * tokens * 4 + vocab)
    all_reduce = per_step_bytes(collectives(name, "all-reduce", ("pipe",)))
    # A stretch of one round (p=2's warm-up and cool-down) is a loop XLA unrolls: it sees that
    # round's fields as constants and may drop the sums of a slot masked there (at most two).
    assert expected - 2 * activation <= all_reduce <= expected + 256  # + a few scalars
    # Each device stores only its stage's layers.
    for leaf in jax.tree.leaves(result["state"].params["layers"]):
        assert leaf.addressable_shards[0].data.shape[0] == leaf.shape[0] // p


@pytest.mark.parametrize("name", ["1f1b,pipe=2,context=2,tensor=2,ring",
                                  "1f1b,pipe=2,fsdp=2,context=2,dots"])
def test_pipeline_sums_gradients_over_context_once_per_step(name):
    # The executor splits the sequence over context by hand, as it splits the batch: each
    # device sums its gradients over every microbatch and the step all-reduces them over
    # context once (with data where both split), not once per backward slot.
    result = run_layout(LAYOUTS[name])
    info = describe(result["cfg"].parallel.pipeline_schedule, 2, 2, 1)
    stored = sum(a.addressable_shards[0].data.nbytes
                 for a in jax.tree.leaves(result["state"].params))
    sums = [c for c in result["collectives"] if c.kind in ("all-reduce", "reduce-scatter")
            and "context" in c.axes]
    assert info["backward_steps"] > 1 and sums
    # fsdp's reduce-scatter takes the whole gradient in: at most twice what a device stores
    # with fsdp=2, once without.
    assert per_step_bytes(sums) <= 2 * stored, (per_step_bytes(sums), stored)


@pytest.mark.parametrize("name", ["1f1b,pipe=2,context=2,tensor=2,ring",
                                  "zero_bubble,pipe=2,context=2,tensor=2,ring,loss_pieces=4",
                                  "interleaved,pipe=2,m=4", "gpipe,pipe=2,tensor=2,data=2,sp,full",
                                  "dualpipe_v,pipe=2,m=4"])
def test_no_collective_runs_under_control_flow_in_a_pipelined_step(name):
    # Every device runs the same program: a collective inside a conditional's branch would wait
    # for devices that took the other branch (the ring's block switch holds compute only).
    hlo = run_layout(LAYOUTS[name])["trainer"].compile_step().as_text()
    assert collectives_in_conditionals(hlo) == [], name
    assert "conditional(" in hlo or "ring" not in name  # the ring's switch is there, and clean


# Mixture of experts inside the stages, with expert parallelism: the objective's MoE aux losses
# are per microbatch, so the reference is the 1-device run with as many micro-steps.
MOE = ("model.n_layers=4", "model.moe.num_experts=4", "model.moe.top_k=2",
       "model.moe.router=sigmoid_bias")


@pytest.mark.parametrize("microbatches, accum", [(2, 1), (1, 2)])
def test_moe_pipeline_with_expert_parallelism_matches_one_device_with_as_many_micro_steps(
        microbatches, accum):
    # 2 microbatches, or 2 micro-steps of 1 folded into one schedule of 2: the same rows in
    # each, whose aux losses count 1/(accum m) each.
    ref = run_layout(("mesh.data=1", "train.grad_accum=2", *MOE))
    got = run_layout(("mesh.pipe=2", "mesh.expert=2", "mesh.data=1",
                      f"train.microbatches={microbatches}", f"train.grad_accum={accum}",
                      "parallel.pipeline_schedule=1f1b", *MOE))
    assert abs(got["loss"] - ref["loss"]) / ref["loss"] < 1e-5
    assert_grads_and_params_match(got, ref)
    # The router biases move with the measured load: every layer's counts crossed the stages.
    jax.tree.map(np.testing.assert_allclose, jax.device_get(got["state"].buffers),
                 jax.device_get(ref["state"].buffers))
    kinds = {(c.kind, c.axes) for c in got["collectives"]}
    assert ("all-to-all", ("expert",)) in kinds and ("collective-permute", ("pipe",)) in kinds


@pytest.mark.slow  # about 45 s; grad_accum folded into a MoE pipeline runs by default above
def test_moe_pipeline_with_grad_accum_averages_aux_losses_over_every_microbatch():
    # grad_accum=2 micro-steps of 2 microbatches run as one schedule of 4: each microbatch
    # holds the rows it held micro-step by micro-step, and its aux losses (weighted up so that
    # a wrong scale shows in the gradients) count 1/(accum m), as on one device with 4
    # micro-steps.
    weights = ("model.moe.aux_loss_weight=1.0", "model.moe.z_loss_weight=0.1")
    ref = run_layout(("mesh.data=1", "train.grad_accum=4", *MOE, *weights))
    got = run_layout(("mesh.pipe=2", "mesh.expert=2", "mesh.data=1", "train.microbatches=2",
                      "train.grad_accum=2", "parallel.pipeline_schedule=1f1b", *MOE, *weights))
    assert describe("1f1b", 2, 2, 1, accum=2)["microbatches"] == 4
    assert abs(got["loss"] - ref["loss"]) / ref["loss"] < 1e-5
    assert_grads_and_params_match(got, ref)
    jax.tree.map(np.testing.assert_allclose, jax.device_get(got["state"].buffers),
                 jax.device_get(ref["state"].buffers))


@pytest.mark.slow  # about 40 s; MoE in stages with expert parallelism runs in the default suite
def test_moe_load_statistics_add_up_over_the_devices_a_stage_splits_by_hand():
    # pipe x fsdp x context: each device of a stage holds its own rows and sequence piece; its
    # MoE layers sum the expert load over the others and add their share of the balance and
    # z-losses (weighted up so that a wrong share shows in the gradients), and the experts'
    # weights are gathered and their gradients summed once per step.
    weights = ("model.moe.aux_loss_weight=1.0", "model.moe.z_loss_weight=0.1")
    ref = run_layout(("mesh.data=1", "train.grad_accum=2", *MOE, *weights))
    got = run_layout(("mesh.pipe=2", "mesh.fsdp=2", "mesh.context=2", "mesh.data=1",
                      "train.microbatches=2", "parallel.pipeline_schedule=1f1b", *MOE, *weights))
    assert abs(got["loss"] - ref["loss"]) / ref["loss"] < 1e-5
    assert_grads_and_params_match(got, ref)
    jax.tree.map(np.testing.assert_allclose, jax.device_get(got["state"].buffers),
                 jax.device_get(ref["state"].buffers))
    gathers = [c for c in got["collectives"] if c.kind == "all-gather" and c.axes == ("fsdp",)]
    assert gathers and all(c.executions == 1 for c in gathers)


@pytest.mark.slow  # about 60 s; MoE in stages with expert parallelism runs by default
@pytest.mark.parametrize("dispatch", ["dropless", "dropping"])
def test_moe_pipeline_with_experts_split_over_tensor_and_sequence_parallel_matches(dispatch):
    # The experts' hidden units split over tensor inside a stage: the dispatch's shard_map over
    # tensor nests in the executor's (expert split by hand), and under sequence parallelism the
    # tokens' gradient must be summed over tensor exactly once.
    ref = run_layout(("mesh.data=1", "train.grad_accum=2", *MOE,
                      f"model.moe.dispatch={dispatch}", "model.moe.capacity_factor=8"))
    got = run_layout(("mesh.pipe=2", "mesh.expert=2", "mesh.tensor=2", "mesh.data=1",
                      "parallel.sequence_parallel=true", "train.microbatches=2",
                      "parallel.pipeline_schedule=1f1b", *MOE, f"model.moe.dispatch={dispatch}",
                      "model.moe.capacity_factor=8"))
    assert abs(got["loss"] - ref["loss"]) / ref["loss"] < 1e-5
    assert_grads_and_params_match(got, ref)


@pytest.mark.parametrize("overrides", [("mesh.fsdp=4", "train.remat=none"),
                                       ("mesh.data=4", "train.dtype=bfloat16")],
                         ids=["fsdp-gathered", "bf16-cast"])
def test_a_stashed_microbatch_holds_activations_but_no_copy_of_the_weights(monkeypatch, overrides):
    # The stage's weights are cast and gathered once per step; the forward's VJP saves those
    # very arrays, which the stash leaves out and the backward takes from the weights again.
    from jaxpar.mesh import make_mesh
    from jaxpar.train.step import build_trainer

    seen = record_stash(monkeypatch)
    cfg = validate(load_config("tiny", ["mesh.pipe=2", "mesh.data=1", "train.microbatches=2",
                                        "parallel.pipeline_schedule=1f1b", *overrides]), 8)
    build_trainer(cfg, make_mesh(cfg)).compile_step()
    weights = [w for w in seen["weights"] if len(w[0]) > 2]  # matrices, not norm scales
    assert seen["reused"] >= len(weights) > 0
    assert not set(weights) & set(seen["stashed"]), seen["stashed"]


def test_grad_accum_runs_one_schedule_over_all_its_microbatches():
    """train.grad_accum=2 micro-steps of m=2 microbatches at pipe=2: the step runs one 1F1B
    schedule over 4 microbatches (one fill and drain, work factor (4+1)/4), not the m=2
    schedule twice ((2+1)/2): the compiled matmul flops, all stages together, say which."""
    got, ref = run_layout(LAYOUTS["1f1b,pipe=2,data=2,grad_accum=2"]), run_layout(REFERENCE)
    cfg = got["cfg"]
    folded = describe("1f1b", 2, 2, 1, accum=2)
    assert folded["microbatches"] == 4 and folded["executed_work_factor"] == pytest.approx(1.25)
    per_micro_step = describe("1f1b", 2, 2, 1)["executed_work_factor"]  # 1.5
    # The pipe devices together, over the 1-device step (data=2 halves each device's rows).
    ratio = (dot_flops(got["hlo"]) * cfg.mesh.pipe * cfg.mesh.data / dot_flops(ref["hlo"]))
    assert 0.95 * folded["executed_work_factor"] <= ratio <= 1.05 * folded["executed_work_factor"]
    assert ratio < 0.9 * per_micro_step, (ratio, per_micro_step)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero_bubble", "interleaved"])
def test_compiled_matmul_flops_are_the_executed_work_factor_times_the_one_device_step(schedule):
    # remat=none: a pipelined step must do the 1-device step's matmuls times the factor of
    # slots it executes (masked ones included) and nothing more: no forward is recomputed.
    # Counted per loop iteration (jaxpar.inspect.hlo.flops), all stages together.
    name = f"{schedule},pipe=2,m=4"
    got, ref = run_layout(LAYOUTS[name]), run_layout(REFERENCE)
    cfg = got["cfg"]
    factor = describe(schedule, 2, 4, cfg.parallel.virtual_stages)["executed_work_factor"]
    ratio = (dot_flops(got["trainer"].compile_step().as_text()) * cfg.mesh.pipe
             / dot_flops(ref["trainer"].compile_step().as_text()))
    assert 0.95 * factor <= ratio <= 1.05 * factor, (ratio, factor)


@pytest.mark.parametrize("name", ["zero_bubble,pipe=2,m=4", "dualpipe_v,pipe=2,m=4"])
def test_a_split_backward_recomputes_nothing_its_matmul_flops_are_at_most_1f1bs(name):
    # W runs only the weight-gradient matmuls (backward_split.py): every matmul of a backward
    # runs in exactly one of I and W, so the step's compiled matmul flops are at most 1F1B's
    # (+2%), and fewer, since fewer ticks run masked.
    split = dot_flops(run_layout(LAYOUTS[name])["trainer"].compile_step().as_text())
    one = dot_flops(run_layout(LAYOUTS["1f1b,pipe=2,m=4"])["trainer"].compile_step().as_text())
    assert split <= 1.02 * one, (split, one)


def reduction_rows(m: int, accum: int = 1) -> dict:
    """Per-step bytes of the collectives over data or fsdp of a pipe=2 data=2 fsdp=2 step."""
    result = run_layout(("mesh.pipe=2", "mesh.data=2", "mesh.fsdp=2", "model.n_layers=4",
                         f"train.microbatches={m}", f"train.batch_size={32 * accum}",
                         f"train.grad_accum={accum}", "parallel.pipeline_schedule=1f1b"))
    rows = {}
    for c in result["collectives"]:
        if c.axes in (("data",), ("fsdp",)):
            rows[(c.kind, c.axes)] = rows.get((c.kind, c.axes), 0) + per_step_bytes([c])
    return {"rows": rows, "state": result["state"]}


def test_gradients_are_reduced_over_data_and_fsdp_once_per_step_whatever_the_microbatches():
    # 4 microbatches in one micro-step against 8 in each of 2 (16 in all): the same bytes.
    four, accumulated = reduction_rows(4), reduction_rows(8, accum=2)
    assert four["rows"] == accumulated["rows"], (four["rows"], accumulated["rows"])
    # The bytes of the gradients once: all-reduced over data at their stored (1/fsdp) size,
    # reduce-scattered over fsdp from their whole size, and the weights gathered once.
    leaves = jax.tree.leaves(four["state"].params)
    shard = sum(a.addressable_shards[0].data.nbytes for a in leaves)
    split = sum(a.addressable_shards[0].data.nbytes for a in leaves if "fsdp" in str(a.sharding))
    assert four["rows"][("all-reduce", ("data",))] == shard
    assert four["rows"][("reduce-scatter", ("fsdp",))] == 2 * split
    assert four["rows"][("all-gather", ("fsdp",))] == 2 * split
    assert four["rows"].get(("all-reduce", ("fsdp",)), 0) < 1024  # the loss and a few scalars


def test_the_pipeline_head_in_pieces_holds_one_pieces_logits_at_a_time():
    """The head's float32 logits of a microbatch, [1, 256, 8192/2] per stage = 4 MiB, and their
    gradient: in 8 pieces only one piece's are alive."""
    def temp(chunks: int) -> int:
        cfg = validate(load_config("tiny", [
            "mesh.pipe=2", "mesh.data=1", "train.microbatches=2", "model.vocab_size=8192",
            "train.seq_len=256", "train.batch_size=2", f"train.loss_pieces={chunks}"]), 2)
        return compiled_temp_bytes(cfg, 2)

    logits = 256 * 8192 // 2 * 4
    whole, pieces = temp(1), temp(8)
    assert whole - pieces > logits, (whole, pieces, logits)


# --------------------------------------------------------------------------------------------
# Memory per schedule, compiled against the plan


def temp_and_planned_stash(schedule: str, m: int) -> tuple[int, int]:
    """(compiled temp bytes, plan's stash bytes) of a pipe=2 step with ``m`` microbatches."""
    from jaxpar.cost.estimate import estimate

    cfg = validate(load_config("tiny", [
        "mesh.data=1", "mesh.pipe=2", "model.n_layers=2", "model.d_model=128",
        f"train.microbatches={m}", f"train.batch_size={2 * m}", "train.seq_len=128",
        "train.remat=none", f"parallel.pipeline_schedule={schedule}"]), 2)
    return compiled_temp_bytes(cfg, 2), estimate(cfg, "h100").memory.stash


@pytest.mark.slow  # about 45 s; the stages' peaks against the plan: test_cost_vs_compiled.py
def test_1f1b_memory_stays_flat_in_microbatches_while_gpipe_grows_as_the_plan_predicts():
    activation = 2 * 128 * 128 * 4  # one microbatch's stage input: 2 rows x 128 x d_model fp32
    (gpipe4, plan4), (gpipe16, plan16) = (temp_and_planned_stash("gpipe", m) for m in (4, 16))
    gpipe = gpipe16 - gpipe4
    one_f_one_b = temp_and_planned_stash("1f1b", 16)[0] - temp_and_planned_stash("1f1b", 4)[0]
    # GPipe stashes every microbatch's forward residuals (with remat=none: the layer's inputs,
    # norms, q/k/v, scores, MLP hiddens: many activations) until the backward wave, so 12 more
    # microbatches hold 12 more residual sets. 1F1B holds at most 2p-1 = 3 whatever m is.
    per_microbatch = gpipe / 12
    assert per_microbatch >= 4 * activation, (gpipe, activation)
    assert one_f_one_b < per_microbatch, (one_f_one_b, per_microbatch)
    # The plan's stash follows the compiled growth (12 more residual sets, output gradients).
    assert 0.9 <= (plan16 - plan4) / gpipe <= 1.1, (plan16 - plan4, gpipe)
