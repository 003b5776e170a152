"""``jaxpar inspect --strict``'s verdict on a comparison with the plan (hand-written, nothing
compiled): which rows are off the plan, and which are too small to count. The real-size matrix
and ``--strict`` on the command line: ``tests/integration/test_real_size.py``."""

from __future__ import annotations

from jaxpar.inspect.compare import mismatches


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
