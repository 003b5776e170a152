"""``jaxpar plan --search --verify K --target TPU``: the best K candidates compiled for a TPU slice.

Each is compiled as ``jaxpar inspect --target`` does, at the fewest layers its layout accepts. The
full-depth peak is the plan's times the compiled ratio; over the chip's HBM fails. Why:
docs/plan.md, "Search and verify".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.table import Table

from jaxpar.config import Config, ConfigError, validate
from jaxpar.cost.estimate import CostReport, estimate
from jaxpar.cost.plan import human_flops
from jaxpar.cost.search import Candidate
from jaxpar.hardware import HardwareProfile
from jaxpar.inspect.compare import FLOOR_BYTES, compare_with_plan
from jaxpar.units import human_bytes


@dataclass(frozen=True)
class Verified:
    """One candidate compiled for the target: predicted and compiled at ``layers`` layers."""

    candidate: Candidate
    layers: int  # the depth compiled (d)
    full_layers: int  # the config's depth
    predicted_peak: int  # the plan's, at d layers
    compiled_peak: int  # the TPU compiler's, at d layers
    predicted_host: int
    compiled_host: int
    predicted_full_peak: int  # the plan's, at the config's depth
    # Collective bytes per device per step by network ("ICI", "DCN"): (compiled, predicted)
    # at d layers, and the plan's at the config's depth.
    collectives: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)
    predicted_full_collectives: dict[str, int] = dataclasses.field(default_factory=dict)
    worst_collective: str = ""  # the (kind, axes) row furthest from the plan, with its ratio
    # Bytes no matmul is scheduled beside (compiled) and the plan's overlap rule leaves exposed
    # (predicted), at d layers (inspect/compare.py: exposure_totals).
    exposed: tuple[int, int] = (0, 0)

    @property
    def ratio(self) -> float:
        return self.compiled_peak / self.predicted_peak

    @property
    def full_peak(self) -> float:
        """The compiled peak at full depth: measured, or the plan's full-depth peak times the ratio.
        """
        if self.layers == self.full_layers:
            return float(self.compiled_peak)
        return self.predicted_full_peak * self.ratio


def compile_depth(cfg: Config, device_count: int) -> int:
    """The fewest layers (at least two, at most the config's) the layout accepts."""
    full = cfg.model.n_layers
    for layers in range(min(2, full), full):
        try:
            validate(_with_layers(cfg, layers), device_count)
        except ConfigError:
            continue
        return layers
    return full


def _with_layers(cfg: Config, layers: int) -> Config:
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, n_layers=layers))


def verify_candidate(candidate: Candidate, devices: Sequence[Any],
                     hw: HardwareProfile) -> Verified:
    """Compile ``candidate`` (estimated by ``plan --search``) for the slice's ``devices``."""
    from jaxpar.inspect.report import build_report  # noqa: PLC0415  (imports jax)
    from jaxpar.mesh import make_mesh  # noqa: PLC0415
    from jaxpar.train.compiled import compiled_step  # noqa: PLC0415

    full = candidate.report.cfg
    layers = compile_depth(full, len(devices))
    cfg = validate(_with_layers(full, layers), len(devices))
    plan = estimate(cfg, hw)
    report = build_report(compiled_step(cfg, make_mesh(cfg, devices=list(devices))))
    memory = report["memory"]
    # The TPU compiler's own peak (its buffer plan), as the TPU memory tests compare; the
    # report's peak_bytes is the larger of it and argument + output - alias + temp, an upper
    # bound whose temp buffer is not all live at once (inspect/report.py: memory_report).
    compiled = memory.get("xla_peak_bytes") or memory["peak_bytes"]
    comparison = compare_with_plan(report, cfg)
    rows, exposure = comparison["collectives"], comparison["exposure"]
    return Verified(candidate, layers, full.model.n_layers, plan.memory.peak, compiled,
                    plan.memory.host, memory.get("host_bytes") or 0,
                    candidate.report.memory.peak, collectives=_by_network(rows),
                    predicted_full_collectives=planned_by_network(candidate.report),
                    worst_collective=_worst(rows),
                    exposed=(exposure["compiled_exposed_bytes"] or 0,
                             exposure["predicted_exposed_bytes"]))


def _network(dcn: Any, axes: Sequence[str]) -> str:
    return "DCN" if dcn.crossing(tuple(axes)) else "ICI"


def planned_by_network(plan: CostReport) -> dict[str, int]:
    """The plan's collective bytes per device per step, summed by network (ICI, DCN)."""
    totals: dict[str, int] = {}
    for row in plan.collective_rows():
        net = _network(plan.cfg.mesh.dcn, row["axes"])
        totals[net] = totals.get(net, 0) + row["bytes"]
    return totals


def _by_network(rows: Sequence[dict]) -> dict[str, tuple[int, int]]:
    """(compiled, predicted) bytes by network from :func:`compare_with_plan`'s rows.

    One slice: every row is ICI. Rows under the floor are left out.
    """
    totals: dict[str, tuple[int, int]] = {}
    for row in rows:
        got, want = row["compiled_bytes"] or 0, row["predicted_bytes"] or 0
        if max(got, want) < FLOOR_BYTES:
            continue
        net = row.get("network") or "ICI"
        have = totals.get(net, (0, 0))
        totals[net] = (have[0] + got, have[1] + want)
    return totals


def _worst(rows: Sequence[dict]) -> str:
    """The row furthest from the plan (a one-sided row is furthest), as text."""
    def distance(row: dict) -> float:
        return abs(row["ratio"] - 1) if row["ratio"] is not None else float("inf")

    big = [r for r in rows if max(r["compiled_bytes"] or 0, r["predicted_bytes"] or 0)
           >= FLOOR_BYTES]
    if not big:
        return "-"
    row = max(big, key=distance)
    ratio = f"{row['ratio']:.2f}" if row["ratio"] is not None else "one side only"
    return f"{row['kind']} {','.join(row['axes'])}: {ratio}"


def _collectives_table(rows: Sequence[Verified]) -> Table:
    """Per candidate: collective bytes by network, compiled / predicted, and the worst row.

    Also the plan's full-depth bytes and executed flops.
    """
    table = Table(title="collectives per device and step (ICI: within a slice; DCN: between "
                  "slices), and the plan's flops", title_justify="left")
    for name in ("#", "network", "compiled", "predicted", "compiled / predicted",
                 "furthest row", "exposed: compiled", "predicted", "compiled / predicted",
                 "plan, full depth", "plan flops, full depth"):
        table.add_column(name, justify="left" if name in ("network", "furthest row")
                         else "right")
    for r in rows:
        for i, net in enumerate(sorted(set(r.collectives) | set(r.predicted_full_collectives))):
            got, want = r.collectives.get(net, (0, 0))
            exposed = _pair(*r.exposed) if i == 0 else ("", "", "")
            table.add_row(str(r.candidate.rank) if i == 0 else "", net, *_pair(got, want),
                          r.worst_collective if i == 0 else "", *exposed,
                          human_bytes(r.predicted_full_collectives.get(net, 0)),
                          human_flops(r.candidate.report.flops.executed) if i == 0 else "")
    return table


def _pair(compiled: int, predicted: int) -> tuple[str, str, str]:
    return (human_bytes(compiled), human_bytes(predicted),
            f"{compiled / predicted:.2f}" if compiled and predicted else "-")


def print_verification(rows: Sequence[Verified], hw: HardwareProfile, target: str,
                       console: Console) -> int:
    """The table; 1 when a candidate's full-depth peak is over the chip's HBM, else 0."""
    table = Table(title=f"compiled for {target} (TPU compiler, ahead of time) vs predicted, "
                  "per device", title_justify="left")
    offload = any(r.candidate.offload for r in rows)
    columns = ["#", "layout", "remat", "layers", "predicted peak", "compiled peak",
               "compiled / predicted",
               *(["predicted host", "compiled host"] if offload else []),
               "full depth", "fits"]
    for name in columns:
        table.add_column(name, justify="left" if name in ("layout", "remat", "fits")
                         else "right")
    failed = 0
    for r in rows:
        c = r.candidate
        fits = r.full_peak <= hw.hbm_bytes
        failed += not fits
        full = human_bytes(r.full_peak) + ("" if r.layers == r.full_layers else
                                           f" ({r.full_layers} layers, extrapolated)")
        table.add_row(str(c.rank), c.layout, c.remat, str(r.layers),
                      human_bytes(r.predicted_peak), human_bytes(r.compiled_peak),
                      f"{r.ratio:.2f}",
                      *([human_bytes(r.predicted_host), human_bytes(r.compiled_host)]
                        if offload else []),
                      full, "yes" if fits else f"[red]no[/red]: over {human_bytes(hw.hbm_bytes)}")
    console.print(table)
    console.print(_collectives_table(rows))
    if failed:
        console.print(f"[red]{failed} verified candidate(s) do not fit in {hw.name}'s "
                      f"{human_bytes(hw.hbm_bytes)} of HBM[/red]")
    return 1 if failed else 0
