"""Throughput, MFU and the metrics file.

MFU compares achieved model flops per device with the device's dense bf16 peak from the table
below (matched against ``jax.Device.device_kind``). CPUs have no meaningful peak here, so MFU is
reported as n/a for them rather than as a made-up number.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# Dense bf16 peak FLOP/s per chip, from the vendors' data sheets.
PEAK_FLOPS: dict[str, float] = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "TPU v6 lite": 918e12,  # v6e
    "TPU v5p": 459e12,
    "TPU v5 lite": 197e12,  # v5e
    "TPU v5": 459e12,
    "TPU v4": 275e12,
}


def peak_flops(device_kind: str) -> float | None:
    """Peak FLOP/s of one device of this kind, or None if the table does not know it."""
    for name, flops in PEAK_FLOPS.items():  # most specific names come first
        if name.lower() in device_kind.lower():
            return flops
    return None


class MetricsFile:
    """``run_dir/metrics.jsonl``: one JSON object per logged step."""

    def __init__(self, path: Path, *, append: bool = False):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        if not append:
            path.write_text("")

    def keep_through(self, step: int) -> None:
        """Drop rows after ``step``: a resumed run logs them again (the killed run may have logged
        steps past its last checkpoint)."""
        if not self.path.exists():
            return
        kept = []
        for line in self.path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # a line cut short by a kill
                continue
            if isinstance(row, dict) and row.get("step", 0) <= step:
                kept.append(line + "\n")
        self.path.write_text("".join(kept))

    def write(self, row: dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
