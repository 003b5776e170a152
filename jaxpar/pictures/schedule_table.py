"""A picture of a pipeline schedule table (``jaxpar schedule --png``): stages down, ticks across."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jaxpar.pictures.style import (
    MUTED,
    TEXT,
    attach_canvas,
    require_matplotlib,
    save_figure,
)

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# Forward, backward and its two halves, idle: one colour each (Okabe-Ito again).
SCHEDULE_COLORS: dict[str, str] = {"F": "#0072B2", "B": "#009E73", "I": "#56B4E9",
                                   "W": "#CC79A7"}
_SCHEDULE_NAMES = {"F": "forward", "B": "backward (2 ticks)", "I": "input-gradient half (I)",
                   "W": "weight-gradient half (W)"}


def draw_schedule(table: Sequence[Sequence[Any]], path: str | Path, title: str) -> None:
    """Write a PNG timeline of a pipeline schedule table (``jaxpar.parallel.pipeline.executor``)."""
    save_figure(schedule_figure(table, title), path)


def schedule_figure(table: Sequence[Sequence[Any]], title: str) -> Figure:
    """Stages down, ticks across; each action a box labelled with its microbatch (and chunk
    letter when stages hold several chunks), idle ticks left light grey. Action boxes carry the
    gid ``action:<kind>:<stage>:<tick>``."""
    from matplotlib.patches import Patch, Rectangle

    fig_cls = require_matplotlib()
    ticks, stages = len(table), len(table[0]) if table else 0
    several = any(cell is not None and cell.chunk >= stages for tick in table for cell in tick)
    cell_in = min(0.45, max(0.16, 16.0 / max(ticks, 1)))
    width = max(8.0, 1.3 + cell_in * ticks + 0.3)
    height = 1.4 + 0.5 * stages + 0.6
    fig = fig_cls(figsize=(width, height), dpi=100)
    attach_canvas(fig)
    ax = fig.add_axes([1.3 / width, 0.75 / height, 1 - 1.6 / width, 1 - 2.0 / height])
    ax.set_xlim(0, ticks)
    ax.set_ylim(stages, 0)
    for s in range(stages):
        t = 0
        while t < ticks:
            cell, end = table[t][s], t + 1
            while end < ticks and cell is not None and table[end][s] == cell:
                end += 1
            if cell is None:
                ax.add_patch(Rectangle((t, s + 0.1), 1, 0.8, facecolor="#F2F2F2",
                                       edgecolor="white", linewidth=0.5))
            else:
                box = Rectangle((t, s + 0.1), end - t, 0.8, facecolor=SCHEDULE_COLORS[cell.kind],
                                edgecolor="white", linewidth=0.8)
                box.set_gid(f"action:{cell.kind}:{s}:{t}")
                ax.add_patch(box)
                lap = chr(ord("a") + cell.chunk // stages) if several else ""
                if cell_in * (end - t) >= 0.16:
                    ax.text((t + end) / 2, s + 0.5, f"{cell.mb}{lap}", ha="center",
                            va="center", fontsize=8 if cell_in >= 0.25 else 6, color="white")
            t = end
    ax.set_yticks([s + 0.5 for s in range(stages)], [f"stage {s}" for s in range(stages)])
    ax.set_xlabel("tick (one forward of one chunk)", color=MUTED)
    ax.tick_params(length=0, colors=MUTED)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    kinds = [k for k in SCHEDULE_COLORS if any(c is not None and c.kind == k for tick in table
                                                for c in tick)]
    handles = [Patch(facecolor=SCHEDULE_COLORS[k], label=_SCHEDULE_NAMES[k]) for k in kinds]
    handles.append(Patch(facecolor="#F2F2F2", label="idle (bubble)"))
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), frameon=False,
               fontsize=9, bbox_to_anchor=(0.5, 0.0))
    fig.text(0.2 / width, 1 - 0.2 / height, title, ha="left", va="top", fontsize=12,
             fontweight="bold", color=TEXT)
    return fig
