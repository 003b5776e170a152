"""``jaxpar inspect --compare/--strict`` on hand-written reports (nothing compiled): which rows
are off the plan, which are too small to count, and exposed bytes beside the overlap rule's.
The real-size matrix and ``--strict`` on the command line: ``tests/integration/test_real_size.py``.
"""

from __future__ import annotations

from helpers import tiny_8x32
from rich.console import Console

from jaxpar.cost.estimate import estimate
from jaxpar.inspect.compare import (
    RINGS,
    compare_with_plan,
    fold_rings,
    mismatches,
    print_comparison,
    ring_axes,
)


def test_mismatches_name_rows_off_plan_and_skip_small_ones():
    comparison = {
        "collectives": [
            {"kind": "all-gather", "axes": ["fsdp"], "compiled_bytes": 1050 * 2**20,
             "predicted_bytes": 1000 * 2**20, "ratio": 1.05},
            {"kind": "reduce-scatter", "axes": ["fsdp"], "compiled_bytes": 12 * 2**30,
             "predicted_bytes": 2**30, "ratio": 12.0},
            {"kind": "all-reduce", "axes": ["fsdp", "tensor"], "compiled_bytes": 3 * 2**30,
             "predicted_bytes": None, "ratio": None},
            {"kind": "all-reduce", "axes": ["tensor"], "compiled_bytes": 2**19,
             "predicted_bytes": None, "ratio": None},
        ],
        "memory": {"compiled_state_bytes": 100, "predicted_state_bytes": 100, "ratio": 1.0,
                   "compiled_peak_bytes": 130, "predicted_peak_bytes": 100, "peak_ratio": 1.3},
    }
    lines = mismatches(comparison)
    assert lines == ["reduce-scatter over fsdp: compiled 12.00 GiB, planned 1.00 GiB",
                     "all-reduce over fsdp,tensor: compiled 3.00 GiB, planned none",
                     "peak memory: compiled 130 B, planned 100 B"]
    assert mismatches(comparison, tolerance=0.5)[-1].startswith("all-reduce over fsdp,tensor")
    assert len(mismatches(comparison, floor=2**40)) == 1  # only the peak is above any floor


def _report_from_plan(cfg, device_kind: str, exposed_share: float) -> dict:
    """A compiled report whose collectives are the plan's rows, ``exposed_share`` of each row's
    bytes exposed, and whose memory is the plan's."""
    plan = estimate(cfg, "h100")
    rows = [{"kind": r["kind"], "axes": r["axes"], "bytes": r["bytes"],
             "exposed_bytes": round(r["bytes"] * exposed_share),
             "hidden_bytes": r["bytes"] - round(r["bytes"] * exposed_share)}
            for r in plan.collective_rows()]
    memory = {"params_bytes": plan.memory.state, "optimizer_bytes": 0,
              "peak_bytes": plan.memory.peak}
    return {"run": {"device_kind": device_kind}, "collectives": rows, "memory": memory}


def test_compare_puts_the_compiled_exposed_bytes_beside_the_overlap_rules():
    """On an accelerator's schedule each row's exposed bytes sit beside the plan's: the overlap
    rule hides most of FSDP's gradient reduce-scatters and leaves tensor all-reduces exposed."""
    cfg = tiny_8x32("mesh.data=1", "mesh.fsdp=4", "mesh.tensor=2")
    comparison = compare_with_plan(_report_from_plan(cfg, "TPU v5", 0.5), cfg)
    rows = {(r["kind"], tuple(r["axes"])): r for r in comparison["collectives"]}
    fsdp, tensor = rows[("reduce-scatter", ("fsdp",))], rows[("all-reduce", ("tensor",))]
    assert 0 < fsdp["predicted_exposed_bytes"] < fsdp["predicted_bytes"] / 2
    assert tensor["predicted_exposed_bytes"] == tensor["predicted_bytes"] > 0
    assert fsdp["compiled_exposed_bytes"] == round(fsdp["compiled_bytes"] * 0.5)
    exposure = comparison["exposure"]
    assert exposure["compiled_exposed_bytes"] == sum(r["compiled_exposed_bytes"]
                                                     for r in rows.values())
    assert exposure["predicted_exposed_bytes"] == sum(r["predicted_exposed_bytes"]
                                                      for r in rows.values())


def test_compare_says_n_a_for_exposure_on_xla_cpu():
    """XLA:CPU runs every collective synchronously: no exposure to compare, and the table says
    so instead of calling everything exposed."""
    cfg = tiny_8x32("mesh.data=1", "mesh.fsdp=8")
    comparison = compare_with_plan(_report_from_plan(cfg, "cpu", 1.0), cfg)
    assert all(r["compiled_exposed_bytes"] is None for r in comparison["collectives"])
    assert comparison["exposure"]["compiled_exposed_bytes"] is None
    console = Console(record=True, width=200)
    print_comparison(comparison, console)
    assert "n/a" in console.export_text()


def test_collective_matmul_rings_are_compared_with_the_gathers_and_scatters_they_replace():
    """Where the TPU compiler made an axis's gathers and reduce-scatters rings of permutes, the
    plan (which counts all-gathers and reduce-scatters) and the compiled program are compared
    as one row over that axis; permutes the plan has too (ring attention) stay their own row."""
    predicted = {("all-gather", ("fsdp",), ""): {"bytes": 100, "exposed_bytes": 10},
                 ("reduce-scatter", ("fsdp",), ""): {"bytes": 200, "exposed_bytes": 20},
                 ("collective-permute", ("context",), ""): {"bytes": 50, "exposed_bytes": 0}}
    compiled = {("all-gather", ("fsdp",), ""): {"bytes": 20, "exposed_bytes": 20},
                ("collective-permute", ("fsdp",), ""): {"bytes": 270, "exposed_bytes": 15},
                ("reduce-scatter", ("fsdp",), ""): {"bytes": 15, "exposed_bytes": 15},
                ("collective-permute", ("context",), ""): {"bytes": 50, "exposed_bytes": 5}}
    rings = ring_axes(compiled, predicted)
    assert rings == {(("fsdp",), "")}
    assert fold_rings(predicted, rings) == {
        (RINGS, ("fsdp",), ""): {"bytes": 300, "exposed_bytes": 30},
        ("collective-permute", ("context",), ""): {"bytes": 50, "exposed_bytes": 0}}
    assert fold_rings(compiled, rings) == {
        (RINGS, ("fsdp",), ""): {"bytes": 305, "exposed_bytes": 50},
        ("collective-permute", ("context",), ""): {"bytes": 50, "exposed_bytes": 5}}
