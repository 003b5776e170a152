"""A picture of a ``jaxpar inspect`` report: the mesh, how parameters are split, where bytes go.

:func:`draw_report` turns the report's JSON into one PNG with three panels under a title: the device
mesh, the parameters' splits and the collectives' bytes, each mesh axis in one colour throughout
(:data:`AXIS_COLORS`). matplotlib (the ``plot`` extra) is imported only when a picture is drawn,
with no pyplot and no global figure state. This module lays the figure out; the shared helpers are
in :mod:`~jaxpar.pictures.style`, the panels in :mod:`~jaxpar.pictures.mesh_panel` and
:mod:`~jaxpar.pictures.tables`, the pipeline schedule's picture in
:mod:`~jaxpar.pictures.schedule_table`.
What each panel shows: docs/inspect.md, "The picture".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jaxpar.pictures.mesh_panel import MIN_SCALE, draw_mesh, mesh_layout
from jaxpar.pictures.schedule_table import draw_schedule, schedule_figure
from jaxpar.pictures.style import (
    AXIS_COLORS,
    MUTED,
    TEXT,
    attach_canvas,
    axis_color,
    mesh_axes_text,
    require_matplotlib,
    save_figure,
    short_bytes,
    split_axes,
    width_in,
)
from jaxpar.pictures.tables import (
    collective_bars,
    draw_collectives,
    draw_params,
    param_rows,
)

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["AXIS_COLORS", "axis_color", "draw_report", "draw_schedule", "report_figure",
           "save_figure", "schedule_figure"]

_WIDTH_IN = 18.0      # figure width, unless the content needs more; heights follow the content
_MAX_WIDTH_IN = 24.0


# --------------------------------------------------------------------------------------------
# Public API


def draw_report(report: Mapping[str, Any], path: str | Path) -> None:
    """Write a PNG picture of an inspect ``report`` (see the module docstring) to ``path``."""
    save_figure(report_figure(report), path)


def report_figure(report: Mapping[str, Any]) -> Figure:
    """The figure :func:`draw_report` saves; tests and notebooks can look into it first.

    Device boxes carry the gid ``device:<n>`` and each mesh axis of size > 1 one label with the
    gid ``axis-label:<axis>``.
    """
    fig_cls = require_matplotlib()
    axes = split_axes(report["mesh"])
    rows = param_rows(report.get("params", []), report["mesh"])
    bars = collective_bars(report.get("collectives", []))
    fig = fig_cls(figsize=(_WIDTH_IN, 10.0), dpi=100)
    attach_canvas(fig)  # text can be measured from here on

    # Lay the panels out in inches from their content, so that fonts keep one size whatever the
    # report holds. Widths: the parameter table as wide as its columns (measured by drawing it
    # once on a scratch panel), the mesh panel the rest, the figure wider if the title needs it.
    scratch = fig.add_axes([0, 0, 1, 1])
    table_w = draw_params(scratch, rows, axes)
    fig.delaxes(scratch)
    left, gutter, right = 0.45, 0.5, 0.3
    title_w = _draw_title(fig, report, axes)
    # A big mesh may widen the figure (up to _MAX_WIDTH_IN) so its boxes stay legible.
    mesh_min_w = min(_MAX_WIDTH_IN - left - gutter - table_w - right,
                     mesh_layout(axes, 6.0).width_for(MIN_SCALE))
    width = max(_WIDTH_IN, left + max(5.0, mesh_min_w) + gutter + table_w + right,
                title_w + left + right)
    mesh_w = width - left - gutter - table_w - right
    mesh = mesh_layout(axes, mesh_w)
    for text in list(fig.texts):  # the title is drawn again below, placed for the final size
        text.remove()
    # Heights: 0.3 in per table row and per bar; the mesh panel as tall as the table, or taller
    # when its boxes would otherwise be small.
    title_h, gap_h, bottom_margin = 1.15, 0.7, 0.5
    top_h = max(3.4, 0.3 * (len(rows) + 1) + 1.1, min(9.0, mesh.wanted_height(mesh_w)))
    bottom_h = max(1.2, 0.3 * len(bars) + 0.35)
    height = title_h + top_h + gap_h + bottom_h + bottom_margin
    fig.set_size_inches(width, height)

    def rect(x: float, y: float, w: float, h: float) -> list[float]:
        return [x / width, y / height, w / width, h / height]

    top_y = bottom_margin + bottom_h + gap_h
    _draw_title(fig, report, axes)
    draw_mesh(fig.add_axes(rect(left, top_y, mesh_w, top_h)), mesh)
    draw_params(fig.add_axes(rect(left + mesh_w + gutter, top_y, table_w, top_h)), rows, axes)
    draw_collectives(fig.add_axes(rect(left, bottom_margin, width - left - right, bottom_h)),
                      bars)
    return fig


# --------------------------------------------------------------------------------------------
# Title


def _draw_title(fig: Figure, report: Mapping[str, Any], axes: Sequence[tuple[str, int]]
                ) -> float:
    """The title line and a line of details under it; returns the title's width in inches."""
    run = report.get("run", {})
    memory = report.get("memory", {})
    width, height = fig.get_size_inches()
    kind = run.get("device_kind")
    devices = f"{report['devices']} × {kind}" if kind else f"{report['devices']} devices"
    parts = [f"jaxpar inspect   {devices}", f"mesh {mesh_axes_text(axes)}"]
    if run.get("param_count") is not None:
        size = f"{run['param_count'] / 1e6:.3g}M params"
        if run.get("param_bytes") is not None:
            size += f" ({short_bytes(run['param_bytes'])})"
        parts.append(size)
    if memory.get("peak_bytes") is not None:
        parts.append(f"peak {short_bytes(memory['peak_bytes'])} per device")
    title = fig.text(0.45 / width, 1 - 0.2 / height, "   |   ".join(parts), ha="left",
                     va="top", fontsize=15, fontweight="bold", color=TEXT)

    details = []
    if run.get("target"):
        details.append(f"target {run['target']}")
    if "dtype" in run:
        details.append(f"{run['dtype']}, remat={run.get('remat')}, ZeRO-{run.get('zero')}"
                       + (", sequence parallel" if run.get("sequence_parallel") else ""))
    if "batch_size" in run:
        accum = f" in {run['grad_accum']} micro-steps" if run.get("grad_accum", 1) > 1 else ""
        details.append(f"batch {run['batch_size']} × {run['seq_len']} tokens{accum}")
    if memory.get("peak_bytes") is not None and memory.get("temp_bytes") is not None:
        held = f"arguments {short_bytes(memory.get('argument_bytes'))}"
        if memory.get("params_bytes") is not None:
            held += (f" (params {short_bytes(memory['params_bytes'])}, optimizer "
                     f"{short_bytes(memory.get('optimizer_bytes'))})")
        details.append(f"per device: {held} + temp {short_bytes(memory['temp_bytes'])}")
    if details:
        fig.text(0.45 / width, 1 - 0.58 / height, "    ·    ".join(details), ha="left",
                 va="top", fontsize=10.5, color=MUTED)
    return width_in(title)


