"""The Quick start demo as a user runs it (slow: about a minute; run with `pytest -m slow`)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_demo_preset_trains_and_loss_falls(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "jaxpar.cli", "train", "demo-5d", f"run_dir={tmp_path}",
         "logging.progress=false"],
        capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 200
    assert rows[-1]["loss"] < 0.5 * rows[0]["loss"]
    assert result.stdout.strip().splitlines()[-1].startswith("done")
