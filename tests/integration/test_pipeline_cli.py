"""Pipelines as the user sees them, through the command line: ``inspect --compare``, the
``schedule`` command and its picture, and the bubble in a training run's metrics (with
``train.grad_accum`` folded into the schedule)."""

from __future__ import annotations

import json

import pytest
from helpers import run_jaxpar

from jaxpar.parallel.pipeline.schedules import schedule_table

PIPE_TINY = ["mesh.pipe=2", "mesh.data=2", "mesh.tensor=2", "train.microbatches=4",
             "parallel.pipeline_schedule=1f1b"]


def test_inspect_compare_agrees_with_the_plan_on_a_pipeline_and_reports_the_bubble():
    result = run_jaxpar("inspect", "tiny", *PIPE_TINY, "--compare", "--json", "-")
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout)
    assert report["pipeline"]["schedule"] == "1f1b"
    assert report["pipeline"]["bubble"] == pytest.approx(1 / 5)  # (p-1)/(m+p-1)
    rows = {(row["kind"], tuple(row["axes"])): row for row in report["compare"]["collectives"]}
    for key in [("collective-permute", ("pipe",)), ("all-reduce", ("pipe",)),
                ("all-reduce", ("tensor",)), ("all-reduce", ("data",))]:
        assert rows[key]["ratio"] is not None and 0.9 <= rows[key]["ratio"] <= 1.1, rows[key]
    assert report["compare"]["memory"]["ratio"] == pytest.approx(1.0, abs=0.05)


def test_schedule_command_prints_the_table_and_draws_it(tmp_path):
    pytest.importorskip("matplotlib")
    from jaxpar.pictures.figures import schedule_figure

    png = tmp_path / "schedule.png"
    result = run_jaxpar("schedule", "tiny", "mesh.pipe=4", "mesh.data=2", "model.n_layers=4",
                        "train.microbatches=8", "train.batch_size=16",
                        "parallel.pipeline_schedule=zero_bubble", "--png", str(png))
    assert result.returncode == 0, result.stderr
    assert "bubble 20.0%" in result.stdout  # (p-1)(T_F+T_I): 2(p-1)/(3m+2(p-1))
    assert "stage 3: .  .  .  F0 I0 F1 I1 F2 I2 F3 I3 W0" in result.stdout
    assert ("executed: 14 steps (F, then F+I+head, then F+I+W+head, then I+W)"
            in result.stdout)
    assert png.stat().st_size > 10_000
    table = schedule_table("zero_bubble", 4, 8)
    fig = schedule_figure(table, "zb")
    boxes = [a for ax in fig.axes for a in ax.patches if (a.get_gid() or "").startswith("action")]
    assert len(boxes) == sum(cell is not None for tick in table for cell in tick)


def test_schedule_command_without_a_pipeline_is_a_usage_error():
    result = run_jaxpar("schedule", "tiny")
    assert result.returncode == 2
    assert "mesh.pipe=1: no pipeline to schedule" in result.stderr


def test_schedule_command_folds_grad_accum_into_one_schedule():
    result = run_jaxpar("schedule", "tiny", "host_devices=4", "mesh.pipe=4", "mesh.data=1",
                        "model.n_layers=8", "train.microbatches=8", "train.batch_size=16",
                        "train.grad_accum=2",
                        "parallel.pipeline_schedule=1f1b")
    assert result.returncode == 0, result.stderr
    # One fill and drain over 2 x 8 microbatches: (p-1)/(2m+p-1) = 3/19, 3 x 19 ticks.
    assert ("1f1b: 4 stages, 16 microbatches (2 micro-steps x 8: train.grad_accum folded in), "
            "57 ticks, bubble 15.8%") in result.stdout
    assert "F15" in result.stdout and "executed: 22 steps" in result.stdout


def test_training_with_a_pipeline_and_grad_accum_logs_the_one_schedules_bubble(tmp_path):
    result = run_jaxpar("train", "tiny", *PIPE_TINY, "train.grad_accum=2",
                        "train.batch_size=16", "train.steps=3", f"run_dir={tmp_path}")
    assert result.returncode == 0, result.stderr[-2000:]
    assert ("pipeline: 1f1b over 2 stages, 8 microbatches (train.grad_accum=2 folded in)"
            in result.stdout)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    # (p-1)/(2m+p-1) over the 2 x 4 microbatches, where each micro-step alone had 1/5
    assert rows and all(row["pipeline_bubble"] == pytest.approx(1 / 9) for row in rows)
