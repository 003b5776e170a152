"""scripts/benchmark.py on tiny layouts: the JSON has every column, and the ratios are sane.

Step times are printed, never asserted (the CPU is shared); the plan ratios are deterministic.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
TINY = ["model.d_model=64", "model.d_ff=128", "train.seq_len=32", "train.batch_size=8"]


def _benchmark():
    """scripts/benchmark.py as a module (scripts/ is not a package; its helpers import by name)."""
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    spec = importlib.util.spec_from_file_location("jaxpar_benchmark", SCRIPTS / "benchmark.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_benchmark_rows_and_ratios(tmp_path, capsys):
    out = tmp_path / "bench.json"
    md = tmp_path / "bench.md"
    code = _benchmark().main(["--layouts", "data,fsdp,5d", "--steps", "1", "--warmup", "1",
                              "--json", str(out), "--markdown", str(md), *TINY])
    assert code == 0
    results = json.loads(out.read_text())
    rows = {row["name"]: row for row in results["rows"]}
    assert list(rows) == ["1-device (dense)", "data", "fsdp", "5d"]
    # 5d needs 16 devices: a row with the reason, and the run went on.
    assert rows["5d"]["status"] == "invalid" and "16" in rows["5d"]["reason"]
    for name in ("1-device (dense)", "data", "fsdp"):
        row = rows[name]
        assert row["status"] == "ok", row.get("reason")
        assert row["compile_s"] > 0 and row["step"]["median_s"] > 0 and row["tokens_per_s"] > 0
        assert row["memory"]["peak_bytes"] > 0
        ratios = row["ratios"]
        assert set(ratios) == {"step_vs_1dev", "work_vs_1dev", "step_vs_1dev_per_work",
                               "flops_vs_plan", "memory_vs_plan", "bytes_vs_plan"}
        assert 0.99 <= ratios["work_vs_1dev"] <= 1.01  # no layout here adds or drops matmuls
        # Data parallelism and FSDP add no matmul work: compiled flops match the plan.
        assert 0.95 <= ratios["flops_vs_plan"] <= 1.05
        assert 0.5 <= ratios["memory_vs_plan"] <= 2.0
    assert rows["1-device (dense)"]["ratios"]["step_vs_1dev"] == 1.0
    assert rows["1-device (dense)"]["collectives"]["bytes"] == 0
    for name in ("data", "fsdp"):  # the plan predicts XLA:CPU's collectives
        assert rows[name]["collectives"]["bytes"] > 0
        assert 0.9 <= rows[name]["ratios"]["bytes_vs_plan"] <= 1.1
    table = capsys.readouterr().out
    assert "| data | data=8 |" in table and "| fsdp | fsdp=8 |" in table
    assert md.read_text().strip() in table


def test_mfu_needs_an_accelerator(capsys):
    assert _benchmark().main(["--mfu"]) == 2
    assert "needs a GPU or TPU" in capsys.readouterr().out
