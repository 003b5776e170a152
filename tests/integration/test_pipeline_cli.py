"""Pipelines as the user sees them, through the command line: ``inspect --compare``, the
``schedule`` command and its picture, and the bubble in a training run's metrics."""

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
    assert "bubble 27.3%" in result.stdout
    assert "stage 3: .  .  .  F0 I0 W0" in result.stdout
    assert "executed: 14 steps (F, then F+B+head, then B)" in result.stdout
    assert png.stat().st_size > 10_000
    table = schedule_table("zero_bubble", 4, 8)
    fig = schedule_figure(table, "zb")
    boxes = [a for ax in fig.axes for a in ax.patches if (a.get_gid() or "").startswith("action")]
    assert len(boxes) == sum(cell is not None for tick in table for cell in tick)


def test_schedule_command_without_a_pipeline_is_a_usage_error():
    result = run_jaxpar("schedule", "tiny")
    assert result.returncode == 2
    assert "mesh.pipe=1: no pipeline to schedule" in result.stderr


def test_training_with_a_pipeline_logs_the_bubble_in_metrics(tmp_path):
    result = run_jaxpar("train", "tiny", *PIPE_TINY, "train.steps=3", f"run_dir={tmp_path}")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "pipeline: 1f1b over 2 stages" in result.stdout
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows and all(row["pipeline_bubble"] == pytest.approx(0.2) for row in rows)
