"""Throughput, MFU, the metrics file, and the lines that describe a run.

MFU is achieved model flops per device over the dense bf16 peak
(:func:`jaxpar.hardware.peak_flops`, by ``jax.Device.device_kind``); n/a on CPUs, which have
no meaningful peak.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any


class MetricsFile:
    """``run_dir/metrics.jsonl``: one JSON object per logged step."""

    def __init__(self, path: Path, *, append: bool = False):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        if not append:
            path.write_text("")

    def keep_through(self, step: int) -> None:
        """Drop rows after ``step``: a resumed run logs them again (the killed run may have logged
        past its last checkpoint)."""
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


def scalars(row: Mapping[str, Any]) -> dict[str, float]:
    """A row as the named scalars trackers log at its step: a list (MoE tokens per expert) as
    ``name/i`` per element; nulls (non-finite loss) left out."""
    out = {}
    for key, value in row.items():
        if key == "step" or value is None:
            continue
        if isinstance(value, list):
            out.update({f"{key}/{i}": float(v) for i, v in enumerate(value)})
        else:
            out[key] = float(value)
    return out


def mesh_text(mesh: Mapping[str, int]) -> str:
    """``{"data": 2, "tensor": 4, ...}`` -> ``'data=2 tensor=4'``: the axes that split anything."""
    return " ".join(f"{a}={s}" for a, s in mesh.items() if s > 1) or "1 device"


def pipeline_line(info: Mapping[str, Any]) -> str:
    """One line on the pipeline schedule (``describe``'s dict)."""
    chunks = (f", {info['virtual_stages']} chunks per stage" if info["virtual_stages"] > 1
              else "")
    accum = info.get("grad_accum", 1)
    folded = f" (train.grad_accum={accum} folded in)" if accum > 1 else ""
    # The output keeps the word 'steps' (a contract); the code calls them rounds.
    return (f"pipeline: {info['schedule']} over {info['stages']} stages{chunks}, "
            f"{info['microbatches']} microbatches{folded}, {info['steps']} steps = {info['ticks']} "
            f"ticks, executed bubble {info['bubble']:.1%} (work factor "
            f"{info['executed_work_factor']:.2f}); stash of {info['activation_slots']} inputs, "
            f"{info['residual_slots']} residual sets, {info['gradient_slots']} gradients per "
            f"device (`jaxpar schedule` draws the table)")


def fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"


def val_text(row: Mapping[str, Any]) -> str:
    """`` | val_loss 2.3456`` (one part per validation set) or '' for a row without eval."""
    return "".join(f" | {key} {fmt(value)}" for key, value in row.items()
                   if key.startswith("val_loss"))


def log_line(row: dict, total_steps: int) -> str:
    """The console line of one metrics.jsonl row (val_loss when the row has one)."""
    mfu = f"{row['mfu']:.1%}" if row["mfu"] is not None else "n/a"
    grad_norm = "n/a" if row["grad_norm"] is None else f"{row['grad_norm']:.3f}"
    skipped = f" | skipped {row['skipped_steps']}" if row["skipped_steps"] else ""
    moe = ""
    if "moe_aux_loss" in row:
        moe = (f" | moe aux {row['moe_aux_loss']:.3f} z {row['moe_z_loss']:.2f} | load min/max "
               f"{row['expert_load_min_max']:.2f} | dropped {row['dropped_fraction']:.1%}")
    return (f"step {row['step']:>{len(str(total_steps))}}/{total_steps} | loss "
            f"{fmt(row['loss'])}{val_text(row)} | grad_norm {grad_norm} | lr {row['lr']:.2e}"
            f"{skipped} | "
            f"{row['tokens_per_s']:,.0f} tok/s | {row['tflops_per_device']:.4f} TFLOP/s/device | "
            f"MFU {mfu}{moe}")

