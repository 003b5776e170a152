"""Compiled vs planned (``jaxpar inspect --compare [--strict --tolerance T]``).

Rows are matched by collective (kind, mesh axes); a row only one side has is what to look at.
``--strict`` is a check for a user's CI: every row and the peak within ``tolerance``, rows under
:data:`FLOOR_BYTES` aside. Collective matmuls' rows are compared as one (:data:`RINGS`). Details:
docs/inspect.md, "``--compare`` and ``--strict``".
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rich.console import Console
from rich.table import Table

from jaxpar.config import Config
from jaxpar.units import human_bytes

FLOOR_BYTES = 2**20
"""Collective rows under this many bytes per device per step are not checked: scalars (the
loss, token counts) and norm gradients, which the compilers combine in ways not worth modelling."""

TOLERANCE = 0.1


def compare_with_plan(report: Mapping[str, Any], cfg: Config) -> dict[str, Any]:
    """The plan's numbers beside the compiled ones, row by row, with their ratio.

    The plan predicts XLA:CPU's program on CPU devices, else the accelerator's; for a TPU target,
    its chip's.
    """
    from jaxpar.cost.estimate import estimate  # noqa: PLC0415
    from jaxpar.hardware import PROFILES  # noqa: PLC0415

    run = report.get("run", {})
    kind = str(run.get("device_kind", "cpu")).lower()
    chip = str(run.get("target") or "").split(":")[0]
    plan = estimate(cfg, None if kind == "cpu" else chip if chip in PROFILES else "h100")
    # Over several slices a row is also keyed by its network: the plan's collective over an
    # axis that spans slices is its DCN row (the compiler's in-slice part of it, if any, is a
    # row the plan does not have).
    dcn = cfg.mesh.dcn

    def network(axes: tuple[str, ...]) -> str:
        return "" if dcn.slices == 1 else "DCN" if dcn.crossing(axes) else "ICI"

    predicted = {(r["kind"], tuple(r["axes"]), network(tuple(r["axes"]))): r
                 for r in plan.collective_rows()}
    compiled = {(r["kind"], tuple(r["axes"]), r.get("network", "")): r
                for r in report["collectives"]}
    rings = ring_axes(compiled, predicted)
    predicted, compiled = fold_rings(predicted, rings), fold_rings(compiled, rings)
    # XLA:CPU runs every collective synchronously: what its schedule hides says nothing of an
    # accelerator's, so exposure is compared only on a scheduled accelerator program.
    scheduled = kind != "cpu"
    rows = []
    for key in sorted(set(predicted) | set(compiled)):
        got, want = compiled.get(key, {}), predicted.get(key, {})
        rows.append({"kind": key[0], "axes": list(key[1]), **({"network": key[2]} if key[2]
                                                              else {}),
                     "compiled_bytes": got.get("bytes"), "predicted_bytes": want.get("bytes"),
                     "ratio": _ratio(got.get("bytes"), want.get("bytes")),
                     "compiled_exposed_bytes": got.get("exposed_bytes") if scheduled else None,
                     "predicted_exposed_bytes": want.get("exposed_bytes")})
    # The train state wherever it lives (an offloaded optimizer state in host memory too).
    state = report["memory"]["params_bytes"] + report["memory"]["optimizer_bytes"]
    planned_state = plan.memory.state + plan.memory.host_state
    memory = {"compiled_state_bytes": state, "predicted_state_bytes": planned_state,
              "ratio": _ratio(state, planned_state),
              "compiled_host_bytes": report["memory"].get("host_bytes") or 0,
              "predicted_host_bytes": plan.memory.host,
              "compiled_peak_bytes": report["memory"]["peak_bytes"],
              "predicted_peak_bytes": plan.memory.peak,
              "peak_ratio": _ratio(report["memory"]["peak_bytes"], plan.memory.peak)}
    return {"collectives": rows, "memory": memory, "exposure": exposure_totals(rows, scheduled)}


RINGS = "all-gather+reduce-scatter (rings)"
"""A row's kind where the TPU compiler made an axis's gathers and reduce-scatters collective
matmuls (rings of collective-permutes beside slices of their matmuls, jaxpar/mesh.py): the
permutes carry the bytes the plan counts as all-gathers and reduce-scatters, so the three kinds
over that axis are compared as one row."""
_RING_PARTS = ("all-gather", "reduce-scatter", "collective-permute")


def ring_axes(compiled: dict[tuple, dict], predicted: dict[tuple, dict]) -> set[tuple]:
    """(axes, network) where the compiled program has permutes the plan lacks: collective matmuls.

    Never where the plan has permutes of its own (ring attention, pipelines).
    """
    return {(axes, network) for kind, axes, network in compiled
            if kind == "collective-permute" and (kind, axes, network) not in predicted}


def fold_rings(rows: dict[tuple, dict], rings: set[tuple]) -> dict[tuple, dict]:
    """``rows`` with each ring's gathers, reduce-scatters and permutes summed into one :data:`RINGS`
    row.
    """
    out: dict[tuple, dict] = {}
    for (kind, axes, network), row in rows.items():
        if kind not in _RING_PARTS or (axes, network) not in rings:
            out[(kind, axes, network)] = row
            continue
        merged = out.setdefault((RINGS, axes, network), {"bytes": 0, "exposed_bytes": 0})
        merged["bytes"] += row["bytes"]
        merged["exposed_bytes"] += row.get("exposed_bytes", row["bytes"])
    return out


def exposure_totals(rows: list[dict[str, Any]], scheduled: bool) -> dict[str, Any]:
    """Exposed collective bytes per device and step, compiled and planned.

    Compiled is None where the program has no accelerator schedule.
    """
    compiled = sum(r["compiled_exposed_bytes"] or 0 for r in rows) if scheduled else None
    predicted = sum(r["predicted_exposed_bytes"] or 0 for r in rows)
    return {"compiled_exposed_bytes": compiled, "predicted_exposed_bytes": predicted,
            "ratio": _ratio(compiled, predicted)}


def _ratio(compiled: float | None, predicted: float | None) -> float | None:
    return round(compiled / predicted, 4) if compiled and predicted else None


def _within(ratio: float | None, tolerance: float) -> bool:
    return ratio is not None and abs(ratio - 1) <= tolerance


def mismatches(comparison: Mapping[str, Any], tolerance: float = TOLERANCE,
               floor: int = FLOOR_BYTES) -> list[str]:
    """One line per row of ``comparison`` off the plan by more than ``tolerance`` (relative).

    Collectives at or above ``floor`` bytes, the train state, the peak memory. Empty when as
    planned.
    """
    out = []
    for row in comparison["collectives"]:
        got, want = row["compiled_bytes"] or 0, row["predicted_bytes"] or 0
        if max(got, want) < floor or _within(row["ratio"], tolerance):
            continue
        name = f"{row['kind']} over {','.join(row['axes']) or '-'}" + (
            f" ({row['network']})" if "network" in row else "")
        out.append(f"{name}: compiled {human_bytes(got) if got else 'none'}, planned "
                   f"{human_bytes(want) if want else 'none'}")
    memory = comparison["memory"]
    for what, key, ratio in (("train state", "state", memory["ratio"]),
                             ("peak memory", "peak", memory["peak_ratio"])):
        if not _within(ratio, tolerance):
            out.append(f"{what}: compiled {human_bytes(memory[f'compiled_{key}_bytes'])}, "
                       f"planned {human_bytes(memory[f'predicted_{key}_bytes'])}")
    return out


def print_comparison(comparison: Mapping[str, Any], console: Console,
                     tolerance: float = TOLERANCE) -> None:
    table = Table(title="compiled vs predicted by `jaxpar plan` (per device, one step)",
                  title_justify="left")
    for name, justify in (("what", "left"), ("axes", "left"), ("compiled", "right"),
                          ("predicted", "right"), ("compiled / predicted", "right"),
                          ("exposed: compiled", "right"), ("predicted", "right")):
        table.add_column(name, justify=justify)
    memory = comparison["memory"]
    table.add_row("train state (params + optimizer)", "-",
                  human_bytes(memory["compiled_state_bytes"]),
                  human_bytes(memory["predicted_state_bytes"]),
                  _ratio_text(memory["ratio"], tolerance))
    table.add_row("peak memory", "-", human_bytes(memory["compiled_peak_bytes"]),
                  human_bytes(memory["predicted_peak_bytes"]),
                  _ratio_text(memory["peak_ratio"], tolerance))
    host, planned_host = memory.get("compiled_host_bytes"), memory.get("predicted_host_bytes")
    if host or planned_host:  # train.offload on an accelerator
        table.add_row("host memory (offloaded state, activations)", "-", human_bytes(host),
                      human_bytes(planned_host), _ratio_text(_ratio(host, planned_host),
                                                             tolerance))
    for row in comparison["collectives"]:
        axes = ",".join(row["axes"]) or "-"
        table.add_row(row["kind"], f"{axes} ({row['network']})" if "network" in row else axes,
                      _bytes_text(row["compiled_bytes"]), _bytes_text(row["predicted_bytes"]),
                      _ratio_text(row["ratio"], tolerance),
                      _exposed_text(row["compiled_exposed_bytes"], row["compiled_bytes"]),
                      _exposed_text(row["predicted_exposed_bytes"], row["predicted_bytes"]))
    exposure = comparison["exposure"]
    table.add_row("exposed, all collectives", "-", "", "", "",
                  _exposed_text(exposure["compiled_exposed_bytes"], 1),
                  human_bytes(exposure["predicted_exposed_bytes"]), style="bold")
    console.print(table)
    console.print("Far from 1, or 'none' on one side: XLA did something the plan does not model "
                  "(an extra collective, a different lowering, a memory blow-up). Rows under "
                  f"{human_bytes(FLOOR_BYTES)} (scalars, norm gradients) are often combined "
                  "differently; --strict does not check them. Exposed: bytes with no matmul "
                  "scheduled between start and done, against the plan's overlap rule; n/a on "
                  "XLA:CPU, whose collectives are all synchronous.")


def _bytes_text(nbytes: int | None) -> str:
    return human_bytes(nbytes) if nbytes else "none"


def _exposed_text(exposed: int | None, nbytes: int | None) -> str:
    """Exposed bytes of a row; n/a without an accelerator schedule."""
    if not nbytes:
        return "-"
    return "n/a" if exposed is None else human_bytes(exposed)


def _ratio_text(ratio: float | None, tolerance: float) -> str:
    if ratio is None:
        return "-"
    return f"{ratio:.2f}" + ("" if _within(ratio, tolerance) else "  <-")
