"""scripts/benchmark.py on tiny layouts: the JSON has every column, and the ratios are sane.

Step times are printed, never asserted (the CPU is shared); the plan ratios are deterministic.
"""

from __future__ import annotations

import json

import pytest
from helpers import benchmark_script as _benchmark

TINY = ["model.d_model=64", "model.d_ff=128", "model.n_layers=4", "train.seq_len=32",
        "train.batch_size=8"]


@pytest.mark.slow  # about 70 s: the script's rows; its step timing is checked in the default suite
def test_benchmark_rows_ratios_and_no_recompiles(tmp_path, capsys):
    """The quick matrix and the 16-device 5d row on the shrunk preset (16 sequences: the
    pipelines' 4 microbatches x 4 data shards)."""
    out = tmp_path / "bench.json"
    md = tmp_path / "bench.md"
    bench = _benchmark()
    code = bench.main(["--layouts", ",".join([*bench.QUICK, "5d"]), "--steps", "2",
                       "--warmup", "1", "--json", str(out), "--markdown", str(md), *TINY,
                       "train.batch_size=16"])
    assert code == 0
    results = json.loads(out.read_text())
    rows = {row["name"]: row for row in results["rows"]}
    assert list(rows) == ["1-device (dense)", "data", "fsdp", "tensor_sp", "1-device (long)",
                          "context_ring", "pipe_1f1b", "1-device (moe)", "expert",
                          "pipe_fsdp_tensor_sp", "5d"]
    # Context parallelism runs the same tokens as one sequence (16 x 32 = 512).
    assert "train.seq_len=512" in rows["context_ring"]["overrides"]
    # 5d needs 16 devices: a row with the reason, and the run went on.
    assert rows["5d"]["status"] == "invalid" and "16" in rows["5d"]["reason"]
    for name, row in rows.items():
        if name == "5d":
            continue
        assert row["status"] == "ok", (name, row.get("reason"))
        assert row["compile_s"] > 0 and row["step"]["median_s"] > 0 and row["tokens_per_s"] > 0
        assert row["memory"]["peak_bytes"] > 0
        # Every later step ran the first step's executable (a listener counts compilations).
        assert row["recompiles"] == 0, name
        assert set(row["ratios"]) == {"step_vs_1dev", "work_vs_1dev", "step_vs_1dev_per_work",
                                      "flops_vs_plan", "memory_vs_plan", "bytes_vs_plan"}
    for name in ("1-device (dense)", "data", "fsdp"):
        ratios = rows[name]["ratios"]
        assert 0.99 <= ratios["work_vs_1dev"] <= 1.01  # no layout here adds or drops matmuls
        # Data parallelism and FSDP add no matmul work: compiled flops match the plan.
        assert 0.95 <= ratios["flops_vs_plan"] <= 1.05
        assert 0.5 <= ratios["memory_vs_plan"] <= 2.0
    assert rows["1-device (dense)"]["ratios"]["step_vs_1dev"] == 1.0
    # A layout's steps alternate with its 1-device baseline's: the ratio's denominator is the
    # median of those, one after each timed step.
    for name in ("data", "context_ring", "expert"):
        alongside = rows[name]["baseline_step"]
        assert alongside["n"] == 2 and alongside["median_s"] > 0
        assert rows[name]["ratios"]["step_vs_1dev"] == round(
            rows[name]["step"]["median_s"] / alongside["median_s"], 3)
    assert "baseline_step" not in rows["1-device (dense)"]
    assert rows["1-device (dense)"]["collectives"]["bytes"] == 0
    for name in ("data", "fsdp"):  # the plan predicts XLA:CPU's collectives
        assert rows[name]["collectives"]["bytes"] > 0
        assert 0.9 <= rows[name]["ratios"]["bytes_vs_plan"] <= 1.1
    table = capsys.readouterr().out
    assert "| data | data=8 | " in table and "| fsdp | fsdp=8 | " in table
    assert md.read_text().strip() in table
