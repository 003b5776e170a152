"""``train.eval_every`` from the command line: the held-out loss in metrics.jsonl and on the log
line at the eval steps only, and its settings' errors as one line, exit 2, before any compile."""

from __future__ import annotations

import math

from helpers import assert_one_line_error, metrics
from test_cli import METRIC_KEYS, run_cli

RUN = ["train.steps=7", "train.eval_every=3", "train.eval_batches=2", "logging.every=2",
       "checkpoint.enabled=false", "data.val_fraction=0.05", "data.max_bytes=400000",
       "mesh.data=2", "host_devices=2"]


def test_val_loss_is_logged_at_every_eval_step_and_at_the_end(tmp_path):
    run_dir = tmp_path / "run"
    result = run_cli("train", "tiny", *RUN, f"run_dir={run_dir}", cwd=tmp_path, timeout=300,
                     log_compiles=False)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {row["step"]: row for row in metrics(run_dir)}
    # Log steps 1, 2, 4, 6, 7 and the eval steps 3, 6, 7 (each eval step also logs).
    assert sorted(rows) == [1, 2, 3, 4, 6, 7]
    assert sorted(s for s, row in rows.items() if "val_loss" in row) == [3, 6, 7]
    for row in rows.values():
        assert METRIC_KEYS <= set(row)
    for step in (3, 6, 7):
        row = rows[step]
        assert math.isfinite(row["val_loss"]) and row["val_tokens"] == 2 * 8 * 32
        assert row["val_ppl"] == math.exp(row["val_loss"])
    assert rows[7]["val_loss"] < rows[3]["val_loss"]  # it learns the corpus's bytes
    assert "validation every 3 steps and at the end: the first 2 batch(es)" in result.stdout
    assert "compiled the train and eval steps" in result.stdout
    val_lines = [line for line in result.stdout.splitlines() if "| val_loss " in line]
    assert [line.split("/")[0].split()[-1] for line in val_lines] == ["3", "6", "7"]


def test_negative_eval_every_is_a_one_line_error(tmp_path):
    run_dir = tmp_path / "run"
    result = run_cli("train", "tiny", "train.eval_every=-1", f"run_dir={run_dir}", cwd=tmp_path)
    assert_one_line_error(result, "train.eval_every=-1", ">= 0", empty_stdout=True)
    assert not run_dir.exists()


def test_an_empty_validation_split_is_a_one_line_error_before_any_trace(tmp_path):
    run_dir = tmp_path / "run"
    result = run_cli("train", "tiny", "train.eval_every=5", "data.val_fraction=0.0",
                     f"run_dir={run_dir}", cwd=tmp_path, timeout=120)
    assert_one_line_error(result, "train.eval_every=5", "validation split is empty",
                          "data.val_fraction", empty_stdout=True)
    assert not run_dir.exists()
