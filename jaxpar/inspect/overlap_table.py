"""``jaxpar inspect``'s table of collectives hidden behind matmuls and exposed, with totals."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

from jaxpar.cost.plan import human_flops
from jaxpar.inspect.hlo.overlap import overlap_totals
from jaxpar.units import human_bytes


def print_overlap(rows: Sequence[Mapping[str, Any]], console: Console, network: bool) -> None:
    """One row per collective row: bytes hidden and exposed, executions hidden, window flops.

    Then the totals.
    """
    table = Table(title="collectives hidden behind matmuls (a matmul scheduled between start "
                  "and done) and exposed, per device, one step", title_justify="left")
    for name in ("kind", "axes", "network", "bytes", "hidden", "exposed", "hidden %",
                 "hidden count", "window matmuls"):
        if name != "network" or network:
            table.add_column(name, justify="left" if name in ("kind", "axes", "network")
                             else "right", no_wrap=True)

    def percent(part: float, whole: float) -> str:
        return f"{part / whole:.1%}" if whole else "-"

    for row in rows:
        net = [row.get("network", "-")] if network else []
        table.add_row(row["kind"], ",".join(row["axes"]) or "-", *net, human_bytes(row["bytes"]),
                      human_bytes(row["hidden_bytes"]), human_bytes(row["exposed_bytes"]),
                      percent(row["hidden_bytes"], row["bytes"]),
                      f"{row['hidden_count']} of {row['count']}",
                      human_flops(row["window_matmul_flops"]))
    totals = overlap_totals(rows)
    table.add_section()
    table.add_row("total", "", *([""] if network else []), human_bytes(totals["bytes"]),
                  human_bytes(totals["hidden_bytes"]), human_bytes(totals["exposed_bytes"]),
                  percent(totals["hidden_bytes"], totals["bytes"]), "", "", style="bold")
    console.print(table)
    console.print(overlap_line(totals))


def overlap_line(totals: Mapping[str, Any]) -> str:
    """``42.04 GiB of collectives, 71.2% hidden, 12.10 GiB exposed`` and what that means."""
    fraction = totals["hidden_fraction"]
    share = f"{fraction:.1%} hidden" if fraction is not None else "none hidden"
    return (f"collectives: {human_bytes(totals['bytes'])}, {share}, "
            f"{human_bytes(totals['exposed_bytes'])} exposed. Hidden: a matmul is scheduled "
            "between the collective's start and done (synchronous collectives are exposed); "
            "window matmuls: the flops of the matmuls in a row's hidden windows, each once "
            "(docs/inspect.md).")
