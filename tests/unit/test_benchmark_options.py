"""scripts/benchmark.py's options, before anything runs: ``--mfu`` needs a GPU or TPU (the
benchmark itself on tiny layouts: ``tests/integration/test_benchmark.py``)."""

from __future__ import annotations

from helpers import benchmark_script as _benchmark


def test_mfu_needs_an_accelerator(capsys):
    assert _benchmark().main(["--mfu"]) == 2
    assert "needs a GPU or TPU" in capsys.readouterr().out
