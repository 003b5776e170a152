"""Context parallelism through the command line: ``jaxpar inspect --compare`` against the plan,
and training a long sequence split over 8 devices in its own process."""

from __future__ import annotations

import pytest
from helpers import assert_one_line_error, run_jaxpar


@pytest.mark.parametrize("impl,kinds", [
    ("ring", {"collective-permute"}), ("allgather", {"all-gather", "reduce-scatter"}),
    ("ulysses", {"all-to-all"}), ("hybrid", {"all-to-all", "collective-permute"})])
def test_plan_predicts_the_context_traffic_that_inspect_compiles(impl, kinds):
    """`jaxpar inspect --compare`: the K/V traffic over `context` agrees with `jaxpar plan`
    (the hybrid: Ulysses in pairs, the ring over the two pairs)."""
    import json
    import subprocess
    import sys

    inner = ["parallel.ulysses_size=2"] if impl == "hybrid" else []
    result = subprocess.run(
        [sys.executable, "-m", "jaxpar.cli", "inspect", "tiny", "mesh.data=2", "mesh.context=4",
         f"parallel.context_impl={impl}", *inner, "--compare", "--json", "-"],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = {row["kind"]: row for row in json.loads(result.stdout)["compare"]["collectives"]
            if row["axes"] == ["context"] and row["kind"] in kinds}
    assert set(rows) == kinds
    assert all(0.9 <= row["ratio"] <= 1.1 for row in rows.values()), rows


@pytest.mark.parametrize("overrides,needles", [
    (["parallel.context_impl=hybrid", "parallel.ulysses_size=3"],
     ["parallel.ulysses_size=3", "allowed: 2, 4"]),
    (["parallel.context_impl=ulysses", "model.n_heads=4", "model.n_kv_heads=4"],
     ["model.n_heads=4", "(1 x 8)"]),
], ids=["inner-size", "heads"])
def test_bad_ulysses_settings_exit_2_with_one_line(overrides, needles):
    result = run_jaxpar("plan", "tiny", "mesh.data=1", "mesh.context=8", *overrides)
    assert_one_line_error(result, *needles)


@pytest.mark.parametrize("impl", ["ring", pytest.param("allgather", marks=pytest.mark.slow),
                                  pytest.param("ulysses", marks=pytest.mark.slow)])
def test_eight_devices_train_a_2048_token_sequence_split_over_context(tmp_path, impl):
    """The benchmark's context rows (scripts/benchmark.py, bench-cpu as one 2048-token sequence
    over context=8), trained for two steps in their own process: XLA:CPU aborts a step whose
    devices reach their collectives in different orders (docs/jax-notes.md, "Collectives under
    control flow"), which an embedding change once caused for exactly this layout."""
    result = run_jaxpar("train", "bench-cpu", "mesh.data=1", "mesh.context=8",
                        f"parallel.context_impl={impl}", "train.batch_size=1",
                        "train.seq_len=2048", "model.attention_block=128", "train.steps=2",
                        "model.n_layers=4",
                        f"run_dir={tmp_path / 'run'}", "logging.every=1", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Termination timeout" not in result.stderr
