"""``jaxpar inspect --target tpu-v5e:2x4 --slices 2``: a step compiled by the TPU compiler for two
slices joined by the data-center network (libtpu's compile-only multi-slice topology), with
``mesh.dcn.data=2``. The TPU compiler builds one program per slice; the gradient sum over
``data`` leaves the slice as megascale host transfers, which inspect reports as DCN all-reduces
over ``data`` (the plan's bytes), and every FSDP collective stays inside the slice (ICI).
Subprocesses, as in ``test_tpu_target.py``."""

from __future__ import annotations

import json

import pytest
from helpers import assert_one_line_error, needs_libtpu, run_inspect

SLICES = ("--target", "tpu-v5e:2x4", "--slices", "2")
LAYOUT = ("mesh.data=2", "mesh.fsdp=8", "mesh.dcn.data=2", "train.batch_size=16")


@pytest.fixture(scope="module")
def two_slices(tmp_path_factory) -> dict:
    needs_libtpu()
    tmp = tmp_path_factory.mktemp("slices")
    result = run_inspect("tiny", *LAYOUT, *SLICES, "--compare", "--json", "-", cwd=tmp)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "2 slices (mesh.dcn data=2)" in result.stderr
    return json.loads(result.stdout)


def test_compiles_for_sixteen_chips_in_two_slices(two_slices):
    run = two_slices["run"]
    assert (run["slices"], run["chips"], two_slices["devices"]) == (2, 16, 16)


def test_the_gradient_sum_over_slices_is_a_dcn_all_reduce_of_the_planned_bytes(two_slices):
    dcn = [r for r in two_slices["collectives"] if r["network"] == "DCN"]
    assert dcn and {(r["kind"], tuple(r["axes"])) for r in dcn} == {("all-reduce", ("data",))}
    assert all(a.startswith("megascale") for a in dcn[0]["lowered_as"])
    row, = [r for r in two_slices["compare"]["collectives"]
            if (r["kind"], r["axes"], r.get("network")) == ("all-reduce", ["data"], "DCN")]
    assert abs(row["ratio"] - 1) <= 0.1, row


def test_every_other_collective_stays_inside_a_slice(two_slices):
    ici = [r for r in two_slices["collectives"] if r["network"] == "ICI"]
    assert ici and all(r["axes"] == ["fsdp"] for r in ici)
    assert {"all-gather", "reduce-scatter"} <= {r["kind"] for r in ici}


def test_slices_the_mesh_does_not_span_are_one_line(tmp_path):
    needs_libtpu()
    result = run_inspect("tiny", "mesh.data=2", "mesh.fsdp=8", *SLICES, cwd=tmp_path)
    assert_one_line_error(result, "--slices 2", "mesh.dcn")
    result = run_inspect("tiny", *LAYOUT, "--slices", "2", "--devices", "16", cwd=tmp_path)
    assert_one_line_error(result, "--slices goes with --target")
