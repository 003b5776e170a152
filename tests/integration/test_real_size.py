"""Real sizes: the layouts users train, compiled (never run) at real model widths on 64 virtual
devices, move the bytes and hold the memory that the plan says (``scripts/real_size.py``, the
matrix of :mod:`jaxpar.inspect.real_size`); and ``jaxpar inspect --strict`` as a user's check.

Tiny models hide what the partitioner does at scale: before these checks the loss pieces
reduced the head's gradient once per piece (12x the planned reduce-scatter at Llama-3-8B
widths), and sequence parallelism gathered the whole residual stream over fsdp and tensor.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import env_without_device_flags, needs_libtpu, run_jaxpar

from jaxpar.inspect.real_size import CPU_CASES

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "real_size.py"

# Cases whose collectives match the plan but whose compiled peak memory does not yet (the
# reasons are in docs/performance.md, "Real sizes"). Strict: a fix makes these fail, so that
# the entry is removed.
PEAK_OFF_PLAN: dict[str, str] = {}
# Cases whose collectives are still off the plan (docs/performance.md, "Real sizes").
COLLECTIVES_OFF_PLAN: dict[str, str] = {}


@pytest.fixture(scope="module")
def matrix(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("real_size") / "matrix.json"
    run = subprocess.run([sys.executable, str(SCRIPT), "--json", str(out)], capture_output=True,
                         text=True, timeout=1200, env=env_without_device_flags())
    assert out.exists(), run.stdout[-2000:] + run.stderr[-3000:]
    return json.loads(out.read_text())


# The TPU compiler's program for a 64-chip v5p slice: the cases whose every collective row is
# the plan's there (docs/performance.md, "On the TPU compiler", has the others and why). Each
# compile takes about a minute on 2 cores.
# (`data` is in the slow suite: about a minute and a half; `fsdp` shows the TPU compiler's
# lowering of a whole slice's gathers as well.)
TPU_TARGET = "tpu-v5p:4x4x4"
# (The layers' gathers there are collective-permute rings, jaxpar/mesh.py; the comparison folds
# them with the gathers and reduce-scatters over fsdp into one row, inspect/compare.py: RINGS.)
TPU_CASES = ("fsdp", pytest.param("data", marks=pytest.mark.slow))


@pytest.fixture(scope="module")
def tpu_matrix(tmp_path_factory, request) -> dict:
    """The TPU cases the session selected, compiled in one run of the script."""
    needs_libtpu()
    cases = sorted({item.callspec.params["case"] for item in request.session.items
                    if item.originalname == "test_the_tpu_compiler_moves_the_planned_bytes_at_"
                    "real_size"})
    out = tmp_path_factory.mktemp("real_size_tpu") / "matrix.json"
    run = subprocess.run([sys.executable, str(SCRIPT), "--target", TPU_TARGET, "--cases",
                          ",".join(cases), "--json", str(out)], capture_output=True,
                         text=True, timeout=1200, env=env_without_device_flags())
    assert out.exists(), run.stdout[-2000:] + run.stderr[-3000:]
    return json.loads(out.read_text())


def _collective_lines(lines: list[str]) -> list[str]:
    return [line for line in lines if not line.startswith(("peak memory", "train state"))]


def _cases(known_off: dict[str, str]) -> list:
    return [pytest.param(c.name, marks=pytest.mark.xfail(reason=known_off[c.name], strict=True))
            if c.name in known_off else c.name for c in CPU_CASES]


@pytest.mark.parametrize("case", _cases(COLLECTIVES_OFF_PLAN))
def test_every_collective_at_real_size_moves_the_planned_bytes(matrix, case):
    """Each (kind, axes) row within 10% of the plan, and none the plan lacks (1 MiB floor)."""
    assert _collective_lines(matrix[case]["mismatches"]) == [], matrix[case]["collectives"]


@pytest.mark.parametrize("case", _cases(PEAK_OFF_PLAN))
def test_peak_memory_at_real_size_is_the_planned_one(matrix, case):
    memory = matrix[case]["memory"]
    assert abs(memory["peak_ratio"] - 1) <= 0.1, memory
    assert abs(memory["ratio"] - 1) <= 0.1, memory


def test_inspect_strict_exits_1_naming_the_rows_and_0_within_the_tolerance(tmp_path):
    args = ("inspect", "tiny", "--devices", "8", "mesh.data=1", "mesh.fsdp=8", "--strict")
    off = run_jaxpar(*args, "--tolerance", "0", cwd=tmp_path, env=env_without_device_flags(),
                     timeout=300)
    assert off.returncode == 1, off.stderr[-2000:]
    assert "differ from the plan by more than 0%" in off.stderr
    assert "peak memory: compiled" in off.stderr
    loose = run_jaxpar(*args, "--tolerance", "0.99", "--json", "-", cwd=tmp_path,
                       env=env_without_device_flags(), timeout=300)
    assert loose.returncode == 0, loose.stderr[-2000:]
    assert json.loads(loose.stdout)["compare"]["mismatches"] == []
    bad = run_jaxpar(*args, "--tolerance", "2", cwd=tmp_path, env=env_without_device_flags())
    assert bad.returncode == 2 and "--tolerance" in bad.stderr


@pytest.mark.parametrize("case", TPU_CASES)
def test_the_tpu_compiler_moves_the_planned_bytes_at_real_size(tpu_matrix, case):
    """On the TPU target too, every collective (kind, axes) within 10% of the plan: at fsdp=64
    the compiler gathers the weights as all-reduces of zero-padded shards, which the HLO reader
    reports as the all-gathers they are."""
    comparison = tpu_matrix[case]
    assert _collective_lines(comparison["mismatches"]) == [], comparison["collectives"]
    if case == "fsdp":
        lowered = {spelling for row in comparison["compiled_collectives"]
                   if row["kind"] == "all-gather" for spelling in row["lowered_as"]}
        assert "all-reduce+dynamic-update-slice" in lowered, lowered
        # The gradient reduce-scatters over the whole slice are libtpu's all-reduce + slice
        # (test_tpu_target.py's canary says why): the planned bytes, twice a ring's wire bytes.
        scatter, = (row for row in comparison["compiled_collectives"]
                    if row["kind"] == "reduce-scatter")
        assert scatter["lowered_as"] == ["all-reduce+dynamic-slice"], scatter
        assert scatter["wire_bytes"] == pytest.approx(2 * 63 / 64 * scatter["bytes"], rel=1e-3)
