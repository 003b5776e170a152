"""``jaxpar plan --search --verify K --target TPU``: the best candidate compiled by the TPU
compiler (libtpu, ahead of time, on this CPU), its peak beside the plan's.

Runs in a subprocess for the reasons in ``test_tpu_target.py`` (libtpu's environment and plugin
stay for the life of a process). Without libtpu the tests skip (fail in CI where it installs).
"""

from __future__ import annotations

from helpers import assert_one_line_error, needs_libtpu, run_inspect

TARGET = "tpu-v5e:2x4"
# tiny made 1024 wide (weights dominate the peak, as in llama-1b; on d_model 256 most
# temporaries sit in the chip's VMEM, which libtpu's peak counts: test_tpu_target.py), one
# layer so that the compile is the whole model (no extrapolation) and no pipeline can split
# it, one kv head so that no tensor split makes the shards narrow again (tensor=4 on this
# width reads 1.3-1.5 of the plan: docs/plan.md#search-and-verify). The best layout is then
# data=8 (remat=full: as fast as none here, and smaller), compiled / predicted 1.03.
WIDE = ("model.d_model=1024", "model.d_ff=4096", "model.n_layers=1", "model.n_kv_heads=1",
        "train.batch_size=16")


def _plan(tmp_path, *args: str):
    return run_inspect("tiny", *WIDE, "--devices", "8", "--hardware", "tpu-v5e", *args,
                       cwd=tmp_path, command="plan")


def _verified_row(stdout: str) -> list[str]:
    """The cells of the verification table's first row."""
    table = stdout[stdout.index(f"compiled for {TARGET}"):]
    row = next(line for line in table.splitlines() if line.startswith("│ 1 "))
    return [cell.strip() for cell in row.strip("│").split("│")]


def test_verify_compiles_the_best_candidate_within_10_percent_of_the_plan(tmp_path):
    needs_libtpu()
    result = _plan(tmp_path, "--verify", "1", "--target", TARGET)
    assert result.returncode == 0, (result.stdout[-3000:], result.stderr[-3000:])
    cells = _verified_row(result.stdout)
    layers, ratio, fits = cells[3], float(cells[6]), cells[-1]
    assert layers == "1" and fits == "yes", cells
    assert 0.9 <= ratio <= 1.1, cells
    # The collectives by network: one slice, all ICI, the compiled bytes the plan's.
    table = result.stdout[result.stdout.index("collectives per device and step"):]
    row = next(line for line in table.splitlines() if line.startswith("│ 1 "))
    cells = [cell.strip() for cell in row.strip("│").split("│")]
    assert cells[1] == "ICI" and 0.9 <= float(cells[4]) <= 1.1, cells


def test_verify_refuses_a_target_of_another_device_count(tmp_path):
    needs_libtpu()
    result = run_inspect("tiny", "--devices", "16", "--hardware", "tpu-v5e", "--verify", "1",
                         "--target", TARGET, cwd=tmp_path, command="plan")
    assert_one_line_error(result, f"--target {TARGET} has 8 devices, not the 16 planned")
