"""Pipeline tools around the executor, without compiling anything: the executor's program of
slots (simulated in Python), the pipeline config errors, the plan's stash and bubble per
schedule, and ``train.grad_accum`` folded into one schedule (its rows, bubble, stash, plan).

The executor's equivalence with the single-device run, its collectives and its compiled memory
per schedule: tests/equivalence/test_pipeline.py; the command line (inspect --compare, schedule,
metrics): tests/integration/test_pipeline_cli.py.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from jaxpar.config import ConfigError, load_config, validate
from jaxpar.parallel.microbatch import split_micro_steps
from jaxpar.parallel.pipeline.executor import split_microbatches
from jaxpar.parallel.pipeline.program import compile_program, describe, executed_kinds, round_kind
from jaxpar.parallel.pipeline.schedules import (
    placement_of,
    schedule_rounds,
    stage_of,
    table_of,
)
from jaxpar.parallel.pipeline.timeline import peak_in_flight, peak_weight_stash

SCHEDULES = ["gpipe", "1f1b", "interleaved", "zero_bubble", "dualpipe_v"]


def rows_of(program):
    """Every executed round: (kinds, {field: [stages]})."""
    for stretch in program.stretches:
        for repeat in range(len(stretch.fields["f_on"])):
            for i, kinds in enumerate(stretch.pattern):
                yield kinds, {k: a[repeat, i] for k, a in stretch.fields.items()}


def model_chunk(stage: int, local: int, p: int, placement: str) -> int:
    """Which chunk a device's ``local``-th is (schedules.stage_of, inverted)."""
    if placement == "v":
        return stage if local == 0 else 2 * p - 1 - stage
    return local * p + stage


def simulate(program, p: int) -> None:
    """Run the program's slot bookkeeping in Python: every read must find what its action
    expects (the key a forward stored, an arrived input), never a slot refilled meanwhile, and
    every send must arrive where its receiver looks for it."""
    res = [dict() for _ in range(p)]  # stage -> slot -> (mb, chunk) of the residuals there
    acts = [dict() for _ in range(p)]
    grads = [dict() for _ in range(p)]
    waits = [dict() for _ in range(p)]  # what an I left for its W
    placement = program.placement
    for kinds, f in rows_of(program):
        arrivals = []
        for s in range(p):
            if f["f_on"][s]:
                key = (int(f["f_mb"][s]), model_chunk(s, int(f["f_chunk"][s]), p, placement))
                if not f["f_first"][s]:
                    assert acts[s].pop(int(f["f_in"][s])) == key
                res[s][int(f["f_res"][s])] = key
                if f["head_last"][s]:
                    grads[s][int(f["head_dy"][s])] = key
                else:
                    arrivals.append((acts, stage_of(key[1] + 1, p, placement), "act", s,
                                     (key[0], key[1] + 1)))
            for prefix in ("b", "w"):
                if not f[f"{prefix}_on"][s]:
                    continue
                key = res[s][int(f[f"{prefix}_res"][s])]
                assert key[1] == model_chunk(s, int(f[f"{prefix}_chunk"][s]), p, placement)
                if prefix == "b":
                    assert grads[s].pop(int(f["b_grad"][s])) == key
                    if "I" in kinds:
                        waits[s][int(f["b_wait"][s])] = key
                    if key[1] > 0:
                        arrivals.append((grads, stage_of(key[1] - 1, p, placement), "grad", s,
                                         (key[0], key[1] - 1)))
                else:  # a W reads what its I left, in this round or an earlier one
                    assert waits[s].pop(int(f["w_wait"][s])) == key
        for store, receiver, name, sender, key in arrivals:
            usual = 1 if name == "act" else -1
            if placement == "ring":
                field = f"recv_{name}"
            elif receiver == sender:
                field = f"keep_{name}"
            else:
                field = f"recv_{name}" if receiver - sender == usual else f"recv_{name}_back"
            store[receiver][int(f[field][receiver])] = key


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 16)])
def test_compiled_program_reads_every_slot_it_wrote_and_holds_the_peak_in_flight(schedule, p, m):
    v = 2 if schedule in ("interleaved", "dualpipe_v") else 1
    rounds = schedule_rounds(schedule, p, m, v)
    program = compile_program(rounds, p, v, placement_of(schedule))
    assert program.rounds == len(rounds)
    kinds = [executed_kinds(s) for s in rounds]
    # Stretches repeat patterns of the rounds' kinds; the head runs in exactly the rounds where a
    # stage's forward is the last chunk, once per microbatch.
    assert program.round_kinds() == [round_kind(s, v * p) for s in rounds]
    heads = [row for k, row in rows_of(program) if "H" in k]
    assert sum(int(row["head_last"].sum()) for row in heads) == m
    assert all(row["head_last"].any() for row in heads)
    if schedule == "zero_bubble":  # W's apart from their I's, but only where every stage has one
        assert [k for k in kinds if "W" in k] == [("F", "I", "W")] * (m - p + 1) + [
            ("I", "W")] * (p - 1)
        assert program.wait_slots == max(peak_weight_stash(table_of(rounds))) + 1
    # Every forward and backward placed once; the residual stash is the peak in flight.
    rows = [row for _, row in rows_of(program)]
    assert sum(int(row["f_on"].sum()) for row in rows) == m * v * p
    assert sum(int(row["b_on"].sum()) for row in rows) == m * v * p
    assert program.res_slots == max(peak_in_flight(table_of(rounds)))
    if schedule == "gpipe":
        assert program.res_slots == m
    if schedule in ("1f1b", "zero_bubble"):
        assert program.res_slots == min(2 * p - 1, m)
    elif schedule != "dualpipe_v":
        assert program.wait_slots == 0
    simulate(program, p)


def test_stretches_repeat_a_pattern_so_alternating_rounds_compile_once():
    # DualPipe-V's steady state runs the head every other round (the first device alternates
    # its two chunks): one stretch whose scan body is the pair, not a stretch per round.
    program = compile_program(schedule_rounds("dualpipe_v", 4, 16, 2), 4, 2, "v")
    assert len(program.stretches) < 12
    assert any(len(s.pattern) == 2 and len(s.fields["f_on"]) >= 8 for s in program.stretches)
    assert sum(len(s.pattern) for s in program.stretches) < 24
    one = compile_program(schedule_rounds("1f1b", 4, 16), 4)
    assert [s.pattern for s in one.stretches] == [(("F",),), (("F", "B", "H"),), (("B",),)]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_grad_accum_is_one_schedule_over_accum_x_microbatches(schedule):
    # train.grad_accum=2 micro-steps of m=8 on 4 stages: one schedule of 16 microbatches, so
    # one fill and drain per step: bubble (p-1)/(v A m + p-1) where each micro-step alone had
    # (p-1)/(v m + p-1).
    p, m, accum = 4, 8, 2
    v = 2 if schedule in ("interleaved", "dualpipe_v") else 1
    folded, alone = describe(schedule, p, m, v, accum=accum), describe(schedule, p, m, v)
    assert folded == {**describe(schedule, p, accum * m, v), "grad_accum": accum}
    assert folded["microbatches"] == accum * m
    # Zero bubble's idle ticks are (p-1)(T_F + T_I), 2(p-1) of 3 v per microbatch; DualPipe-V's
    # twice that on chunks half the size, the same share.
    idle, work = (2 * (p - 1), 3 * (v if schedule == "zero_bubble" else 1)) if schedule in (
        "zero_bubble", "dualpipe_v") else (p - 1, v)
    assert folded["bubble"] == pytest.approx(idle / (work * accum * m + idle))
    assert alone["bubble"] == pytest.approx(idle / (work * m + idle))
    # The stash: GPipe holds every microbatch of the step at its turn, the others what they
    # held with m alone (1F1B: 2p-1 on the first stage).
    grown = folded["residual_slots"] - alone["residual_slots"]
    if schedule == "dualpipe_v":  # at most 2p + 3 chunks, whatever the microbatches
        assert folded["residual_slots"] <= 2 * p + 3
    else:
        assert grown == ((accum - 1) * m if schedule == "gpipe" else 0)


def test_grad_accum_microbatches_hold_the_rows_of_the_micro_step_by_micro_step_split():
    # 16 rows, grad_accum=2 micro-steps of m=4: microbatch j m + k of the one schedule is
    # micro-step j's microbatch k, and the 8 row sets are those of one device's
    # train.grad_accum=8 micro-steps (the MoE aux losses, per microbatch, average the same).
    rows = np.arange(16)
    got = np.asarray(split_microbatches({"x": rows}, 2, 4)["x"])
    assert got.shape == (8, 2)
    steps = np.asarray(split_micro_steps({"x": rows}, 2)["x"])
    for j in range(2):
        for k in range(4):
            assert (got[j * 4 + k] == np.asarray(split_micro_steps({"x": steps[j]}, 4)["x"])[k]
                    ).all()
    one_device = np.asarray(split_micro_steps({"x": rows}, 8)["x"])
    assert sorted(map(tuple, got)) == sorted(map(tuple, one_device))


@pytest.mark.parametrize("overrides,message", [
    (["mesh.pipe=2", "mesh.data=1", "model.n_layers=3"], "model.n_layers=3 is not divisible"),
    (["mesh.pipe=2", "mesh.data=1", "parallel.virtual_stages=2"], "needs parallel.pipeline_sch"),
    (["mesh.data=2", "train.microbatches=2"], "train.microbatches=2 needs mesh.pipe > 1"),
    (["mesh.pipe=2", "mesh.data=1", "train.microbatches=3", "parallel.pipeline_schedule="
      "interleaved", "parallel.virtual_stages=1", "train.batch_size=6"], "not divisible by "
     "mesh.pipe=2"),
    (["mesh.data=2", "parallel.pipeline_overlap=true"],
     "parallel.pipeline_overlap=true needs mesh.pipe > 1"),
    (["mesh.pipe=2", "mesh.data=1", "parallel.pipeline_overlap=true"],
     "parallel.pipeline_overlap=true: gpipe never runs a forward and a backward in one round; "
     "use 1f1b, interleaved, zero_bubble or dualpipe_v"),
    (["mesh.pipe=2", "mesh.data=1", "parallel.pipeline_overlap=true",
      "parallel.pipeline_schedule=1f1b", "train.lora.rank=4"],
     "parallel.pipeline_overlap=true: not with train.lora"),
    (["mesh.pipe=2", "mesh.data=1", "parallel.pipeline_overlap=true",
      "parallel.pipeline_schedule=1f1b", "parallel.pipeline_stash=inputs"],
     "parallel.pipeline_stash=inputs: not with parallel.pipeline_overlap=true"),
    (["mesh.pipe=2", "mesh.data=1", "parallel.pipeline_schedule=dualpipe_v",
      "train.microbatches=2", "train.batch_size=8", "model.n_layers=4"],
     "train.microbatches=2: dualpipe_v needs at least 2 x mesh.pipe = 4"),
    (["mesh.pipe=2", "mesh.data=1", "parallel.pipeline_schedule=dualpipe_v",
      "parallel.virtual_stages=3", "model.n_layers=12"],
     "parallel.virtual_stages=3: dualpipe_v runs two chunks per stage (its V); leave it at 1 "
     "or set 2"),
    (["mesh.pipe=2", "mesh.data=1", "parallel.pipeline_schedule=dualpipe_v",
      "model.n_layers=6", "train.microbatches=4"],
     "model.n_layers=6 is not divisible by mesh.pipe x parallel.virtual_stages = 2 x 2"),
])
def test_pipeline_config_errors_name_the_field_and_what_it_allows(overrides, message):
    cfg = load_config("tiny", overrides)
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate(cfg, 4 if "mesh.tensor=2" in overrides else 2)


# --------------------------------------------------------------------------------------------
# The plan


def test_plan_predicts_the_stash_and_the_bubble_of_each_schedule():
    from jaxpar.cost.estimate import estimate

    for schedule, bubble in [("gpipe", 3 / 11), ("1f1b", 3 / 11), ("zero_bubble", 6 / 30)]:
        cfg = validate(load_config("tiny", [
            "mesh.pipe=4", "mesh.data=2", "model.n_layers=4", "train.microbatches=8",
            "train.batch_size=16", f"parallel.pipeline_schedule={schedule}"]), 8)
        report = estimate(cfg, "h100")
        assert report.pipeline["bubble"] == pytest.approx(bubble)
        # One message: microbatch rows on this device x seq x d_model, float32 on CPU.
        message = 1 * cfg.train.seq_len * cfg.model.d_model * 4
        slots = report.pipeline["activation_slots"] + report.pipeline["gradient_slots"] + 2
        residual_sets = report.pipeline["residual_slots"] + 1
        assert report.memory.stash > slots * message + residual_sets * message
        assert report.pipeline["residual_slots"] == (8 if schedule == "gpipe" else 7)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_plan_runs_grad_accum_as_one_schedule_with_its_bubble_stash_and_sends(schedule):
    from jaxpar.cost.estimate import estimate

    def plan(accum: int):
        return estimate(validate(load_config("tiny", [
            "mesh.pipe=4", "mesh.data=2", "model.n_layers=4", "train.microbatches=8",
            f"train.grad_accum={accum}", f"train.batch_size={16 * accum}",
            f"parallel.pipeline_schedule={schedule}"]), 8), "h100")

    alone, folded = plan(1), plan(2)  # the same microbatch rows; twice the rows per step
    assert alone.pipeline["bubble"] == pytest.approx(3 / 11)  # (p-1)/(m+p-1)
    assert folded.pipeline["bubble"] == pytest.approx(3 / 19)  # (p-1)/(2m+p-1)

    # Compute time is the executed flops under the folded schedule's work factor: 19/16, not
    # the per-micro-step schedule's 11/8.
    def factor(report) -> float:
        return report.time.compute / report.flops.executed

    assert factor(folded) / factor(alone) == pytest.approx((19 / 16) / (11 / 8))
    # GPipe's stash holds all 16 microbatches' residuals; 1F1B's is flat in them (2p-1). The
    # executor's gradient sums are the gradients: no accumulator beside them.
    assert folded.pipeline["residual_slots"] == (16 if schedule == "gpipe" else 7)
    if schedule == "gpipe":
        assert folded.memory.stash > alone.memory.stash
    else:
        assert folded.memory.stash == alone.memory.stash
    assert folded.memory.gradients == alone.memory.gradients
    # One activation per round with a forward or backward slot, 2 (16+3), but the last round's
    # where its stretch runs once (GPipe's; not 1F1B's cool-down of 3 rounds here).
    sends = [r for r in folded.collective_rows() if r["kind"] == "collective-permute"]
    want = 2 * (16 + 3) - (1 if schedule == "gpipe" else 0)
    assert [r["count"] for r in sends] == [want] == [folded.pipeline["sends"]]


def test_overlap_asks_libtpu_for_asynchronous_all_to_alls_and_keeps_the_users_flags(monkeypatch):
    import os

    from jaxpar.mesh import use_compiler_flags

    on = load_config("tiny", ["mesh.pipe=2", "parallel.pipeline_overlap=true"])
    monkeypatch.delenv("LIBTPU_INIT_ARGS", raising=False)
    use_compiler_flags(load_config("tiny", ["mesh.pipe=2"]))
    assert "LIBTPU_INIT_ARGS" not in os.environ
    use_compiler_flags(on)
    use_compiler_flags(on)  # once only
    assert os.environ["LIBTPU_INIT_ARGS"] == "--xla_tpu_enable_async_all_to_all=true"
    monkeypatch.setenv("LIBTPU_INIT_ARGS", "--foo=1 --xla_tpu_enable_async_all_to_all=false")
    use_compiler_flags(on)  # the user's choice stands
    assert os.environ["LIBTPU_INIT_ARGS"] == (
        "--foo=1 --xla_tpu_enable_async_all_to_all=false")
