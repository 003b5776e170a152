"""The benchmark's Markdown table (benchmark.py): one row per layout, ratios last."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jaxpar.units import human_bytes

COLUMNS = ("layout", "mesh", "compile s", "recompiles", "step s (median)", "spread (min-max)",
           "1-dev step s alongside", "tokens/s",
           "peak mem/dev", "coll. bytes/dev", "step / 1-dev", "work / 1-dev",
           "step / work", "flops / plan", "mem / plan", "bytes / plan")


def _num(value: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if value is None else fmt.format(value)


def _cells(row: Mapping[str, Any]) -> list[str]:
    """The table cells of one measured row."""
    step, ratios = row["step"], row["ratios"]
    return [row["name"], row["mesh"], _num(row["compile_s"], "{:.1f}"), str(row["recompiles"]),
            _num(step["median_s"], "{:.3f}"),
            f"{step['min_s']:.3f}-{step['max_s']:.3f}",
            _num(row.get("baseline_step", {}).get("median_s"), "{:.3f}"),
            _num(row["tokens_per_s"], "{:,.0f}"),
            human_bytes(row["memory"]["peak_bytes"]),
            human_bytes(row["collectives"]["bytes"]) if row["collectives"]["bytes"] else "0",
            _num(ratios["step_vs_1dev"]), _num(ratios["work_vs_1dev"]),
            _num(ratios["step_vs_1dev_per_work"]),
            _num(ratios["flops_vs_plan"]), _num(ratios["memory_vs_plan"]),
            _num(ratios["bytes_vs_plan"])]


def markdown_table(results: Mapping[str, Any]) -> str:
    """The results as a Markdown table; rows that did not run show their status and reason."""
    overrides = "".join(f" {o}" for o in results["overrides"])
    lines = [f"preset `{results['preset']}`{overrides}, {results['devices']} "
             f"{results['backend']} devices ({results['device_kind']}), "
             f"{results['warmup']} warm-up + {results['steps']} timed steps per layout",
             "", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in results["rows"]:
        if row["status"] == "ok":
            cells = _cells(row)
        else:
            reason = row["reason"].replace("|", "/").replace("\n", " ")
            cells = [row["name"], f"{row['status']}: {reason}"] + [""] * (len(COLUMNS) - 2)
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "recompiles: compilations after the first step (0: every later step ran the "
              "first one's executable). 1-dev step s alongside: the median of the 1-device "
              "steps of the same global batch run one after each of the layout's timed steps. "
              "step / 1-dev: the layout's median step over that median. "
              "work / 1-dev: matmul flops all devices execute over the 1-device run's (virtual "
              "devices share the cores, so this is the step ratio with no overhead; a "
              "pipeline's masked slots make it its executed-work factor). step / work: their "
              "quotient, 1.00 = no overhead. flops / plan: compiled matmul flops (loop trips "
              "counted) over the plan's executed flops; mem, bytes: compiled peak memory and "
              "collective bytes per device over the plan's."]
    return "\n".join(lines)
