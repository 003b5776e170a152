"""A picture of a ``jaxpar inspect`` report: the mesh, how parameters are split, where bytes go.

:func:`draw_report` turns the JSON-able report of :func:`jaxpar.inspect.report.inspect_step` (the
``--json`` shape in DESIGN.md) into one PNG with three panels under a title:

1. **device mesh**: one box per device, laid out by the mesh axes of size > 1: the innermost axis
   along the columns, the next along the rows, the outer ones as blocks side by side, then
   stacked, alternating. Coloured lines join the devices of one group along an axis, the devices
   that run that axis's collectives together.
2. **parameters**: parameters grouped by name (embedding, attention, mlp, norms, head, ...); rows
   of one group are merged when they share a ``PartitionSpec``. One cell per mesh axis says whether
   the row is split over that axis (and on which dimension) or replicated on it, and a bar shows
   the bytes one device holds against the global size.
3. **collectives**: bytes each device sends per step, one bar per (mesh axes, kind).

Every mesh axis keeps one colour in all panels (:data:`AXIS_COLORS`): "tensor" in the mesh, the
parameter table and the collectives chart is the same vermillion.

matplotlib is an optional dependency (``pip install -e '.[plot]'``), imported only when a picture
is drawn, and only through its object-oriented API on the Agg canvas: no pyplot, so no global
figure state and no GUI backend. The module is organised so that more pictures (a pipeline
schedule, say) can sit beside :func:`draw_report`: shared helpers come first (matplotlib import,
colours, byte labels, text measuring, saving), then one private ``_draw_*`` function per panel.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jaxpar.inspect.units import human_bytes

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure
    from matplotlib.text import Text

# Okabe-Ito colours (readable with the common colour-vision deficiencies), one per mesh axis.
AXIS_COLORS: dict[str, str] = {
    "pipe": "#E69F00",     # orange
    "data": "#0072B2",     # blue
    "fsdp": "#009E73",     # bluish green
    "expert": "#56B4E9",   # sky blue
    "context": "#CC79A7",  # reddish purple
    "tensor": "#D55E00",   # vermillion
}
_EXTRA_COLORS = ("#7F7F7F", "#8C564B", "#BCBD22", "#17BECF")  # axes a custom mesh may add
_REPLICATED = "#E6E6E6"
_TEXT = "#222222"
_MUTED = "#6B6B6B"
_RULE = "#D0D0D0"

_WIDTH_IN = 18.0      # figure width, unless the content needs more; heights follow the content
_MAX_WIDTH_IN = 24.0
_DPI = 110


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
    fig_cls = _require_matplotlib()
    axes = _split_axes(report["mesh"])
    rows = _param_rows(report.get("params", []), report["mesh"])
    bars = _collective_bars(report.get("collectives", []))
    fig = fig_cls(figsize=(_WIDTH_IN, 10.0), dpi=100)
    _attach_canvas(fig)  # text can be measured from here on

    # Lay the panels out in inches from their content, so that fonts keep one size whatever the
    # report holds. Widths: the parameter table as wide as its columns (measured by drawing it
    # once on a scratch panel), the mesh panel the rest, the figure wider if the title needs it.
    scratch = fig.add_axes([0, 0, 1, 1])
    table_w = _draw_params(scratch, rows, axes)
    fig.delaxes(scratch)
    left, gutter, right = 0.45, 0.5, 0.3
    title_w = _draw_title(fig, report, axes)
    # A big mesh may widen the figure (up to _MAX_WIDTH_IN) so its boxes stay legible.
    mesh_min_w = min(_MAX_WIDTH_IN - left - gutter - table_w - right,
                     _mesh_layout(axes, 6.0).width_for(_MIN_SCALE))
    width = max(_WIDTH_IN, left + max(5.0, mesh_min_w) + gutter + table_w + right,
                title_w + left + right)
    mesh_w = width - left - gutter - table_w - right
    mesh = _mesh_layout(axes, mesh_w)
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
    _draw_mesh(fig.add_axes(rect(left, top_y, mesh_w, top_h)), mesh)
    _draw_params(fig.add_axes(rect(left + mesh_w + gutter, top_y, table_w, top_h)), rows, axes)
    _draw_collectives(fig.add_axes(rect(left, bottom_margin, width - left - right, bottom_h)),
                      bars)
    return fig


# --------------------------------------------------------------------------------------------
# Shared helpers (for any picture of this module)


def _require_matplotlib() -> type[Figure]:
    """matplotlib's ``Figure``, or a one-line ImportError that says what to install."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError("pictures need matplotlib: pip install -e '.[plot]' "
                          "(or pip install matplotlib)") from None
    return Figure


def _attach_canvas(fig: Figure) -> None:
    """Give ``fig`` an Agg canvas: rendering, text measuring and PNG output, no GUI, no pyplot."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)


def save_figure(fig: Figure, path: str | Path) -> None:
    """Write ``fig`` as a PNG to ``path`` (parent folders are created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=_DPI, format="png", facecolor="white")


def axis_color(axis: str) -> str:
    """The colour of a mesh axis in every panel (custom axis names get a stable extra colour)."""
    if axis in AXIS_COLORS:
        return AXIS_COLORS[axis]
    return _EXTRA_COLORS[sum(map(ord, axis)) % len(_EXTRA_COLORS)]


def _split_axes(mesh: Mapping[str, int]) -> list[tuple[str, int]]:
    """The mesh axes that split something (size > 1), outermost first."""
    return [(name, int(size)) for name, size in mesh.items() if int(size) > 1]


def _bytes(n: float | None) -> str:
    """Short label for the picture: ``1536`` -> ``'1.5 KiB'``."""
    return human_bytes(n, ".3g")


def _width_in(text: Text) -> float:
    """Rendered width of a text artist, in inches (the figure must have a canvas)."""
    fig = text.figure
    return text.get_window_extent(fig.canvas.get_renderer()).width / fig.dpi


def _mesh_text(axes: Sequence[tuple[str, int]]) -> str:
    return " × ".join(f"{name}={size}" for name, size in axes) or "1 device"


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
    parts = [f"jaxpar inspect   {devices}", f"mesh {_mesh_text(axes)}"]
    if run.get("param_count") is not None:
        size = f"{run['param_count'] / 1e6:.3g}M params"
        if run.get("param_bytes") is not None:
            size += f" ({_bytes(run['param_bytes'])})"
        parts.append(size)
    if memory.get("peak_bytes") is not None:
        parts.append(f"peak {_bytes(memory['peak_bytes'])} per device")
    title = fig.text(0.45 / width, 1 - 0.2 / height, "   |   ".join(parts), ha="left",
                     va="top", fontsize=15, fontweight="bold", color=_TEXT)

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
        held = f"arguments {_bytes(memory.get('argument_bytes'))}"
        if memory.get("params_bytes") is not None:
            held += (f" (params {_bytes(memory['params_bytes'])}, optimizer "
                     f"{_bytes(memory.get('optimizer_bytes'))})")
        details.append(f"per device: {held} + temp {_bytes(memory['temp_bytes'])}")
    if details:
        fig.text(0.45 / width, 1 - 0.58 / height, "    ·    ".join(details), ha="left",
                 va="top", fontsize=10.5, color=_MUTED)
    return _width_in(title)


# --------------------------------------------------------------------------------------------
# Panel 1: the device mesh

# Device boxes in mesh units; gaps grow with the nesting level so that blocks stand apart.
_BOX_W, _BOX_H = 1.0, 0.62
_LEVEL_GAP = (0.3, 0.3, 0.8, 0.8, 1.4, 1.4)
_ARC_RAD = 0.25      # how far the arcs joining blocks bulge, relative to their length
_MAX_ARCS = 4        # arcs per block axis: enough to show the pattern without a tangle
_LABEL_PT = 10.5     # axis labels around the mesh
_CAPTION_PT = 9.0    # the caption under the panel title
_BEST_SCALE = 0.85   # inches per box width when there is room: larger boxes only waste space
_MIN_SCALE = 0.45    # below this "#n" gets hard to read: the figure grows (up to a point)


@dataclasses.dataclass
class _MeshLayout:
    """Where every device box goes, and the room the labels around them need.

    Levels are the split axes innermost first: columns, rows, then blocks side by side, blocks
    stacked, alternating x and y. Positions are in mesh units (a box is ``_BOX_W`` wide) with y
    growing downwards; the room for labels is in inches, since their font size is fixed.
    """

    axes: list[tuple[str, int]]
    levels: list[tuple[str, int, str, float]]  # (axis, size, "x" or "y", stride), innermost first
    devices: list[dict[str, int]]              # coordinates, in mesh order
    corner: list[tuple[float, float]]          # top-left corner of each box
    width: float
    height: float
    rise_x: float  # how far arcs between blocks side by side rise above the boxes
    rise_y: float  # and arcs between stacked blocks reach left of them
    margin_in: dict[str, float]
    row_label_in: float
    block_label_in: list[float]  # one per stacked-block level, innermost first
    caption: list[str]           # lines; the last one explains the coordinates in the boxes

    @property
    def size_units(self) -> tuple[float, float]:
        return self.width + self.rise_y, self.height + self.rise_x

    @property
    def margin_xy_in(self) -> tuple[float, float]:
        m = self.margin_in
        return m["left"] + m["right"], m["top"] + m["bottom"]

    def scale(self, panel_w: float, panel_h: float) -> float:
        """Inches per mesh unit: the largest that fits the panel, capped at ``_BEST_SCALE``."""
        (units_w, units_h), (room_w, room_h) = self.size_units, self.margin_xy_in
        return min((panel_w - room_w) / units_w, (panel_h - room_h) / units_h, _BEST_SCALE)

    def width_for(self, scale: float) -> float:
        """The panel width at which boxes are ``scale`` inches wide."""
        return scale * self.size_units[0] + self.margin_xy_in[0]

    def wanted_height(self, panel_w: float) -> float:
        """The panel height at which the width, not the height, limits the boxes."""
        scale = min((panel_w - self.margin_xy_in[0]) / self.size_units[0], _BEST_SCALE)
        return scale * self.size_units[1] + self.margin_xy_in[1]

    def group(self, i: int, axis: str) -> list[int]:
        """The devices that differ from device ``i`` only along ``axis``, in order."""
        # Mesh order is row-major: a device's index is the mixed-radix number of its coordinates,
        # so one step along an axis is the product of the sizes of the axes inside it.
        inner = [name for name, _ in self.axes].index(axis) + 1
        stride = math.prod(size for _, size in self.axes[inner:])
        base = i - self.devices[i][axis] * stride
        return [base + k * stride for k in range(dict(self.axes)[axis])]


def _mesh_layout(axes: Sequence[tuple[str, int]], panel_w: float) -> _MeshLayout:
    """Box positions and label room for the split ``axes`` in a panel ``panel_w`` inches wide."""
    levels = []
    extent = {"x": _BOX_W, "y": _BOX_H}
    for level, (name, size) in enumerate(reversed(axes)):
        direction = "x" if level % 2 == 0 else "y"
        gap = _LEVEL_GAP[min(level, len(_LEVEL_GAP) - 1)]
        stride = extent[direction] + gap  # one step along this level: inner extent plus a gap
        levels.append((name, size, direction, stride))
        extent[direction] = size * stride - gap
    names = [name for name, _ in axes]
    devices = [dict(zip(names, coords, strict=True))
               for coords in itertools.product(*(range(size) for _, size in axes))]
    corner = [(sum(c[n] * s for n, _, d, s in levels if d == "x"),
               sum(c[n] * s for n, _, d, s in levels if d == "y")) for c in devices]

    # Labels left of the mesh run top to bottom (rotated), so each takes one line of width.
    line_in = 1.25 * _LABEL_PT / 72
    y_blocks = [lv for lv in levels[2:] if lv[2] == "y"]
    x_blocks = [lv for lv in levels[2:] if lv[2] == "x"]
    row_label_in = line_in + 0.08 if len(levels) > 1 else 0.0
    block_label_in = [line_in + 0.06 for _ in y_blocks]

    if axes:
        chars = max(40, int(panel_w / (0.48 * _CAPTION_PT / 72)))  # a line of caption text
        caption = textwrap.wrap("lines join the devices of one group along an axis: they run "
                                "that axis's collectives together", chars)
        short = _short_axis_names(axes)
        caption.append(f"#n: position in the mesh;  {' '.join(short[n] + 'k' for n in names)}: "
                       f"coordinate on {', '.join(names)}")
    else:
        caption = ["one device: nothing is split"]
    caption_in = len(caption) * 1.4 * _CAPTION_PT / 72 + 0.12
    margin_in = {"top": caption_in + 0.27 * len(x_blocks) + 0.08,
                 "bottom": 0.3 if levels else 0.45,
                 "left": row_label_in + sum(block_label_in) + 0.05, "right": 0.05}
    return _MeshLayout(
        axes=list(axes), levels=levels, devices=devices, corner=corner,
        width=extent["x"], height=extent["y"],
        rise_x=max((_ARC_RAD * s / 2 for _, _, _, s in x_blocks), default=0.0),
        rise_y=max((_ARC_RAD * s / 2 for _, _, _, s in y_blocks), default=0.0),
        margin_in=margin_in, row_label_in=row_label_in, block_label_in=block_label_in,
        caption=caption)


def _short_axis_names(axes: Sequence[tuple[str, int]]) -> dict[str, str]:
    """One-letter axis names for the coordinates in a box, when they are unambiguous."""
    letters = {name: name[0] for name, _ in axes}
    if len(set(letters.values())) == len(letters):
        return letters
    return {name: name + " " for name, _ in axes}


def _draw_mesh(ax: Axes, mesh: _MeshLayout) -> None:
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

    ax.set_axis_off()
    ax.set_title("device mesh: one box per device", loc="left", fontsize=12.5,
                 fontweight="bold", color=_TEXT, pad=8)
    axes, levels, devices, corner = mesh.axes, mesh.levels, mesh.devices, mesh.corner
    center = [(x + _BOX_W / 2, y + _BOX_H / 2) for x, y in corner]
    panel = ax.get_position()
    panel_w = panel.width * ax.figure.get_figwidth()
    panel_h = panel.height * ax.figure.get_figheight()
    scale = mesh.scale(panel_w, panel_h)  # one scale for x and y: boxes keep their shape
    x0 = -mesh.rise_y - mesh.margin_in["left"] / scale
    y0 = -mesh.rise_x - mesh.margin_in["top"] / scale
    ax.set_xlim(x0, x0 + panel_w / scale)
    ax.set_ylim(y0 + panel_h / scale, y0)  # inverted: y grows downwards

    def block_instances(level: int) -> list[list[int]]:
        """The blocks of a level: devices sharing their coordinates on it and the outer levels."""
        outer = [name for name, _, _, _ in levels[level:]]
        blocks: dict[tuple[int, ...], list[int]] = {}
        for i, c in enumerate(devices):
            blocks.setdefault(tuple(c[n] for n in outer), []).append(i)
        return list(blocks.values())

    def bounds(members: Sequence[int]) -> tuple[float, float, float, float]:
        xs = [corner[i][0] for i in members]
        ys = [corner[i][1] for i in members]
        return min(xs), min(ys), max(xs) + _BOX_W, max(ys) + _BOX_H

    # Blocks get a faint frame so that they read as units before anything else is looked at.
    for level in range(2, len(levels)):
        pad = 0.12 + 0.1 * ((level - 2) // 2)
        for members in block_instances(level):
            xa, ya, xb, yb = bounds(members)
            ax.add_patch(FancyBboxPatch((xa - pad, ya - pad), xb - xa + 2 * pad,
                                        yb - ya + 2 * pad, facecolor="#000000", alpha=0.035,
                                        boxstyle="round,pad=0,rounding_size=0.1",
                                        edgecolor="none", zorder=0))

    # Boxes: the position in the mesh and, when the box is large enough, the coordinates.
    box_pt = 72 * scale * _BOX_W
    short = _short_axis_names(axes)  # the caption explains these
    coords_pt = min(9.0, box_pt * 0.85 / (max(len(axes), 1) * 3 * 0.6))
    coords_line = len(axes) > 1 and coords_pt >= 6.0
    index_pt = min(12.0, max(5.0, box_pt / (4.5 if coords_line else 3.4)))
    for i, coords in enumerate(devices):
        ax.add_patch(FancyBboxPatch(corner[i], _BOX_W, _BOX_H,
                                    boxstyle="round,pad=0,rounding_size=0.07",
                                    facecolor="white", edgecolor="#4A4A4A", linewidth=1.0,
                                    zorder=3, gid=f"device:{i}"))
        cx, cy = center[i]
        ax.text(cx, cy - (0.1 if coords_line else 0.0), f"#{i}", ha="center", va="center",
                fontsize=index_pt, fontweight="bold", color=_TEXT, zorder=4)
        if coords_line:
            ax.text(cx, cy + 0.16, " ".join(f"{short[n]}{c}" for n, c in coords.items()),
                    ha="center", va="center", fontsize=coords_pt, color=_MUTED, zorder=4)

    label = {"fontsize": _LABEL_PT, "fontweight": "bold", "textcoords": "offset points",
             "annotation_clip": False, "zorder": 5}
    wire_pt = min(6.0, 0.09 * box_pt + 1)
    for level, (name, size, direction, _stride) in enumerate(levels):
        color = axis_color(name)
        starts = [i for i, c in enumerate(devices) if c[name] == 0]
        if level < 2:
            # Columns and rows: a thick line behind each group's boxes shows in the gaps between
            # them, a wire joining neighbours.
            for i in starts:
                (xa, ya), (xb, yb) = center[i], center[mesh.group(i, name)[-1]]
                ax.plot([xa, xb], [ya, yb], color=color, linewidth=wire_pt,
                        solid_capstyle="round", zorder=1)
            first = mesh.group(0, name)  # device #0's group, in the top-left block
            if direction == "x":  # name the axis under the first block's columns
                mid = (center[first[0]][0] + center[first[-1]][0]) / 2
                ax.annotate(f"{name} ({size}) →", (mid, mesh.height), xytext=(0, -4),
                            ha="center", va="top", color=color, gid=f"axis-label:{name}",
                            **label)
            else:  # and left of its rows, reading downwards
                mid = (center[first[0]][1] + center[first[-1]][1]) / 2
                ax.annotate(f"{name} ({size}) →", (-mesh.rise_y, mid), xytext=(-5, 0),
                            ha="center", va="top", rotation=-90, rotation_mode="anchor",
                            color=color, gid=f"axis-label:{name}", **label)
            continue

        # Blocks: arcs join a device to its counterparts in the other blocks, from the outer
        # edge (top row for blocks side by side, left column for stacked ones) so they cross no
        # box. Every position has such a group; those of the first block's edge show the pattern.
        along = 1 if direction == "x" else 0  # the edge: y = 0 (top) or x = 0 (left)
        others = [n for n, _, _, _ in levels[2:] if n != name]
        edge = [i for i in starts
                if corner[i][along] == 0.0 and all(devices[i][n] == 0 for n in others)]
        for i in edge[:_MAX_ARCS]:
            for a, b in itertools.pairwise(mesh.group(i, name)):
                if direction == "x":
                    ends = (center[a][0], 0.0), (center[b][0], 0.0)
                else:
                    ends = (0.0, center[a][1]), (0.0, center[b][1])
                # arc3 bends to the right of a->b for negative rad: with y drawn downwards that
                # is up for a left-to-right arc, and left for a top-to-bottom one.
                rad = -_ARC_RAD if direction == "x" else _ARC_RAD
                ax.add_patch(FancyArrowPatch(*ends, arrowstyle="-", color=color, linewidth=2.2,
                                             connectionstyle=f"arc3,rad={rad}", zorder=2,
                                             shrinkA=0, shrinkB=0))
        # Block headers: the axis and coordinate above (or left of) every block on the edge,
        # stacked outwards by nesting depth so that no two levels share a line. Where "name k"
        # is longer than a block, the blocks get just "k" and the name stands once before them.
        depth = (level - 2) // 2
        edge_blocks = [m for m in block_instances(level)
                       if min(corner[i][1 if direction == "x" else 0] for i in m) == 0.0]
        xa, ya, xb, yb = bounds(edge_blocks[0])
        span_in = (xb - xa if direction == "x" else yb - ya) * scale
        fits = 0.6 * _LABEL_PT / 72 * (len(name) + 3) < span_in
        offset = 72 * (mesh.row_label_in + sum(mesh.block_label_in[:depth])) + 5
        for n, members in enumerate(edge_blocks):
            k = devices[members[0]][name]
            text = f"{name} {k}" if fits else (f"{name}  {k}" if n == 0 else str(k))
            gid = f"axis-label:{name}" if n == 0 else None
            xa, ya, xb, yb = bounds(members)
            if direction == "x":
                ax.annotate(text, ((xa + xb) / 2, -mesh.rise_x), xytext=(0, 4 + 19 * depth),
                            ha="center" if fits or n else "right", va="bottom", color=color,
                            gid=gid, **label)
            else:
                ax.annotate(text, (-mesh.rise_y, (ya + yb) / 2), xytext=(-offset, 0),
                            ha="center" if fits or n else "right", va="top", rotation=-90,
                            rotation_mode="anchor", color=color, gid=gid, **label)

    caption = mesh.caption if coords_line or not axes else mesh.caption[:-1]
    ax.text(0.0, 1.0, "\n".join(caption), transform=ax.transAxes, ha="left", va="top",
            fontsize=_CAPTION_PT, color=_MUTED, linespacing=1.4)


# --------------------------------------------------------------------------------------------
# Panel 2: parameters and how they are split

# Name fragments -> group. Norms come first so that 'layers/attn_norm/scale' is a norm.
_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("norms", ("norm",)),
    ("embedding", ("embed",)),
    ("attention", ("attn", "attention")),
    ("experts", ("moe", "expert", "router")),
    ("mlp", ("mlp", "ffn")),
    ("head", ("head", "unembed")),
)
_GROUP_ORDER = ("embedding", "attention", "mlp", "experts", "norms", "head")  # forward-ish
_MEMBER_ORDER = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "router", "w_gate", "w_up",
                 "w_down", "final_norm")


def _param_group(name: str) -> str:
    """``'layers/attn/wq'`` -> ``'attention'``; a name matching no fragment keeps its first part."""
    lowered = name.lower()
    for group, fragments in _GROUPS:
        if any(f in lowered for f in fragments):
            return group
    return name.split("/")[0]


def _member_name(name: str, group: str) -> str:
    """The part of a parameter name that tells it apart inside its group."""
    parts = name.split("/")
    if parts[0] == "layers" and len(parts) > 1:  # the scanned layer stack
        parts = parts[1:]
    if group in ("attention", "mlp", "experts") and len(parts) > 1:
        parts = parts[1:]  # 'attn/wq' -> 'wq': the group already says attention
    if len(parts) > 1 and parts[-1] in ("scale", "kernel", "weight"):
        parts = parts[:-1]  # 'attn_norm/scale' -> 'attn_norm'
    return "/".join(parts)


def _spec_axes(spec: Sequence[Any]) -> dict[str, int]:
    """Mesh axis -> the dimension it splits (a spec entry is None, an axis or a list of axes)."""
    split = {}
    for dim, entry in enumerate(spec):
        for axis in entry if isinstance(entry, list | tuple) else [entry]:
            if axis is not None:
                split[axis] = dim
    return split


def _spec_text(spec: Sequence[Any]) -> str:
    def entry(e: Any) -> str:
        if isinstance(e, list | tuple):
            return "(" + ", ".join(repr(a) for a in e) + ")"
        return repr(e)

    return "P(" + ", ".join(entry(e) for e in spec) + ")"


def _param_rows(params: Sequence[Mapping[str, Any]], mesh: Mapping[str, int]
                ) -> list[dict[str, Any]]:
    """Parameters merged by (group, spec): ``{group, names, spec, split, device, global}``."""
    merged: dict[tuple[str, str], dict[str, Any]] = {}
    for p in params:
        group = _param_group(p["name"])
        spec = [list(e) if isinstance(e, tuple) else e for e in p["spec"]]
        split = _spec_axes(spec)
        shards = math.prod(int(mesh.get(a, 1)) for a in split)
        row = merged.setdefault((group, _spec_text(spec)), {
            "group": group, "names": [], "spec": spec, "split": split, "device": 0, "global": 0})
        row["names"].append(_member_name(p["name"], group))
        row["device"] += p["bytes_per_device"]
        row["global"] += p["bytes_per_device"] * shards  # sharding is even (the rules say so)

    # The report lists parameters alphabetically; the picture follows the forward pass instead.
    def rank(name: str) -> int:
        return _MEMBER_ORDER.index(name) if name in _MEMBER_ORDER else len(_MEMBER_ORDER)

    def order(row: dict[str, Any]) -> tuple[int, str, int]:
        g = row["group"]
        return (_GROUP_ORDER.index(g) if g in _GROUP_ORDER else len(_GROUP_ORDER), g,
                min(rank(n) for n in row["names"]))

    for row in merged.values():
        row["names"].sort(key=rank)  # stable: unknown names keep the report's order
    return sorted(merged.values(), key=order)


def _draw_params(ax: Axes, rows: Sequence[Mapping[str, Any]],
                 axes: Sequence[tuple[str, int]]) -> float:
    """Draw the table; returns the width it would like, in inches (its columns and a bar)."""
    from matplotlib.patches import FancyBboxPatch, Rectangle

    ax.set_axis_off()
    ax.set_title("parameters: which mesh axis splits them, bytes per device", loc="left",
                 fontsize=12.5, fontweight="bold", color=_TEXT, pad=8)
    n = len(rows)
    panel_w = ax.get_position().width * ax.figure.get_figwidth()
    panel_h = ax.get_position().height * ax.figure.get_figheight()
    # Rows are 0.3 in apart whatever the panel height (row r is centred on y = r), under a
    # two-line caption and a header; leftover height stays empty at the bottom.
    row_in = 0.3
    ax.set_xlim(0, panel_w)  # x in inches, so columns can be placed by measured text widths
    ax.set_ylim(-2.95 + panel_h / row_in, -2.95)
    if not rows:
        ax.text(0, 0, "no parameters in the report", fontsize=10, color=_MUTED)
        return 4.0

    pad = 0.2
    header = {"fontsize": 9.5, "fontweight": "bold", "color": _MUTED}

    def column(x: float, texts: Sequence[tuple[float, str, dict[str, Any]]]) -> float:
        """Draw a column of texts at x; the x where the next column can start."""
        drawn = [ax.text(x, y, s, va="center" if y >= 0 else "bottom", **kw)
                 for y, s, kw in texts]
        return x + max(_width_in(t) for t in drawn) + pad

    starts = [r for r in range(n) if r == 0 or rows[r]["group"] != rows[r - 1]["group"]]
    x = column(0.0, [(-0.55, "group", header)]
               + [(r, rows[r]["group"], {"fontsize": 10, "fontweight": "bold"}) for r in starts])
    x = column(x, [(-0.55, "parameters", header)]
               + [(r, ", ".join(row["names"]), {"fontsize": 9.5}) for r, row in enumerate(rows)])
    x = column(x, [(-0.55, "PartitionSpec", header)]
               + [(r, _spec_text(row["spec"]), {"fontsize": 9, "family": "monospace"})
                  for r, row in enumerate(rows)])

    # One cell per split mesh axis: the axis colour and the dimension it splits, or grey.
    heads = [ax.text(0, -0.55, f"{name}\n×{size}", ha="center", va="bottom", fontsize=9.5,
                     fontweight="bold", color=axis_color(name), linespacing=1.05)
             for name, size in axes]
    cell_w = max([0.62] + [_width_in(t) + 0.1 for t in heads])
    for k, (name, _size) in enumerate(axes):
        cx = x + k * cell_w + cell_w / 2
        heads[k].set_x(cx)
        for r, row in enumerate(rows):
            split = name in row["split"]
            ax.add_patch(FancyBboxPatch((x + k * cell_w + 0.03, r - 0.36), cell_w - 0.06, 0.72,
                                        boxstyle="round,pad=0,rounding_size=0.05",
                                        mutation_aspect=1 / row_in, edgecolor="none",
                                        facecolor=axis_color(name) if split else _REPLICATED))
            ax.text(cx, r, f"dim {row['split'][name]}" if split else "repl.", ha="center",
                    va="center", fontsize=8.5, color="white" if split else "#8A8A8A",
                    fontweight="bold" if split else "normal")
    x += len(axes) * cell_w + pad

    # Bytes: the numbers, then a light bar for the global size (to scale across rows) with the
    # device's share dark on it; the bar takes the width that is left.
    total_device = sum(row["device"] for row in rows)
    total_global = sum(row["global"] for row in rows)

    def share(device: int, global_: int) -> str:
        return "all" if global_ <= device else f"1/{global_ / max(device, 1):.3g}"

    bar_x = column(x, [(-0.55, "per device of global", header)]
                   + [(r, f"{_bytes(row['device'])} of {_bytes(row['global'])} "
                          f"({share(row['device'], row['global'])})", {"fontsize": 9})
                      for r, row in enumerate(rows)]
                   + [(n + 0.15, f"{_bytes(total_device)} of {_bytes(total_global)} "
                                 f"({share(total_device, total_global)})",
                       {"fontsize": 9.5, "fontweight": "bold"})])
    bar_w = min(2.5, max(0.8, panel_w - bar_x))  # the scratch panel is wide: its bar is 2.5 in
    largest = max(row["global"] for row in rows) or 1
    for r, row in enumerate(rows):
        full = bar_w * row["global"] / largest
        ax.add_patch(Rectangle((bar_x, r - 0.27), full, 0.54, facecolor="#D5DCE6",
                               edgecolor="none"))
        ax.add_patch(Rectangle((bar_x, r - 0.27), full * row["device"] / max(row["global"], 1),
                               0.54, facecolor="#3E4F66", edgecolor="none"))

    for r in starts[1:]:  # rules between groups, and above the total
        ax.plot([0, panel_w], [r - 0.5, r - 0.5], color=_RULE, linewidth=0.8)
    ax.plot([0, panel_w], [n - 0.45, n - 0.45], color="#8A8A8A", linewidth=1.0)
    ax.text(0, n + 0.15, "total", fontsize=10, fontweight="bold", va="center")

    caption = ("dim k: split over that mesh axis on dimension k (one device holds 1/size);  "
               "repl.: every device along that axis holds the same copy\n"
               "bars: global bytes (light, to scale across rows) and the part one device holds "
               "(dark)")
    caption = ax.text(0, -1.6, caption, fontsize=9, color=_MUTED, va="bottom", linespacing=1.4)
    return max(bar_x + 1.6, _width_in(caption))


# --------------------------------------------------------------------------------------------
# Panel 3: collectives


def _collective_bars(collectives: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One bar per report row, grouped by mesh axes: the busiest axes first, biggest kind first."""
    bars = []
    for c in collectives:
        wire = c.get("wire_bytes")
        bars.append({
            "axes": tuple(c.get("axes") or ()),
            "kind": c["kind"],
            "count": c.get("count"),
            "wire": c["bytes"] if wire is None else wire,  # older reports have payload only
            "lowered_as": [x for x in c.get("lowered_as", []) if x != c["kind"]],
        })
    totals: dict[tuple[str, ...], float] = {}
    for b in bars:
        totals[b["axes"]] = totals.get(b["axes"], 0) + b["wire"]
    return sorted(bars, key=lambda b: (-totals[b["axes"]], b["axes"], -b["wire"]))


def _draw_collectives(ax: Axes, bars: Sequence[Mapping[str, Any]]) -> None:
    from matplotlib.ticker import MaxNLocator
    from matplotlib.transforms import blended_transform_factory

    title = ax.set_title("collectives: bytes each device sends per step (ring algorithm), by "
                         "mesh axes and kind", loc="left", fontsize=12.5, fontweight="bold",
                         color=_TEXT, pad=8)
    if not bars:
        ax.set_axis_off()
        ax.text(0.0, 0.7, "none: one device, or nothing is split", fontsize=11, color=_MUTED,
                transform=ax.transAxes)
        return

    # Plot in the unit of the largest bar, so the ticks are round numbers of KiB/MiB/GiB.
    largest = max(b["wire"] for b in bars) or 1
    exponent = min(4, max(0, int(math.log(largest, 1024))))
    unit = ("B", "KiB", "MiB", "GiB", "TiB")[exponent]
    scale = 1024.0 ** exponent

    groups: dict[tuple[str, ...], list[int]] = {}
    values = []  # the value label right of each bar
    for y, b in enumerate(bars):
        groups.setdefault(b["axes"], []).append(y)
        names = b["axes"] or ("?",)
        # Over several axes at once: the first axis's colour, hatched in the second's.
        many = len(names) > 1
        ax.barh(y, b["wire"] / scale, height=0.66, color=axis_color(names[0]),
                edgecolor=axis_color(names[1]) if many else "none", hatch="///" if many else None,
                linewidth=0)
        note = f"  ×{b['count']}" if b["count"] is not None else ""
        if b["lowered_as"]:
            note += f"   (lowered as {', '.join(b['lowered_as'])})"
        values.append(ax.annotate(f"{_bytes(b['wire'])}{note}", (b["wire"] / scale, y),
                                  xytext=(4, 0), textcoords="offset points", va="center",
                                  fontsize=9, color=_TEXT))

    # Labels left of the bars, measured so that the plot starts right after them: the axes group
    # (with its total) once per group, then the kind on each bar.
    left = blended_transform_factory(ax.transAxes, ax.transData)
    group_labels, kind_labels, rules = [], [], []
    for names, ys in groups.items():
        total = sum(bars[y]["wire"] for y in ys)
        # One line when the group has one bar, else two (the name over its total).
        sep = "\n" if len(ys) > 1 else "  "
        group_labels.append(ax.text(0, (ys[0] + ys[-1]) / 2,
                                    f"{' + '.join(names) or '?'}{sep}{_bytes(total)}",
                                    transform=left, ha="left", va="center", fontsize=10.5,
                                    fontweight="bold", color=axis_color((names or ("?",))[0]),
                                    linespacing=1.15))
        if ys[0] > 0:  # a rule between groups, extended under the labels below
            rules.append(ax.axhline(ys[0] - 0.5, color=_RULE, linewidth=0.8, clip_on=False))
    for y, b in enumerate(bars):
        kind_labels.append(ax.text(0, y, b["kind"], transform=left, ha="right", va="center",
                                   fontsize=9.5, color=_TEXT))
    group_w = max(_width_in(t) for t in group_labels) + 0.25
    kind_w = max(_width_in(t) for t in kind_labels) + 0.1
    # Shift the plot right by the label widths, then pin the labels to inches left of it.
    fig_w = ax.figure.get_figwidth()
    pos = ax.get_position()
    shift = (group_w + kind_w) / fig_w
    ax.set_position([pos.x0 + shift, pos.y0, pos.width - shift, pos.height])
    plot_w = (pos.width - shift) * fig_w
    for t in group_labels:
        t.set_x(-(group_w + kind_w) / plot_w)
    for t in kind_labels:
        t.set_x(-0.1 / plot_w)
    for line in rules:
        line.set_xdata([-(group_w + kind_w) / plot_w, 1])
    title.set_x(-(group_w + kind_w) / plot_w)

    ax.set_yticks([])
    ax.set_ylim(len(bars) - 0.5, -0.5)
    # The x range that leaves room for each value label right of its bar (bar length scales
    # with the range, the label does not).
    xmax = max(b["wire"] / scale / max(0.2, 1 - (_width_in(t) + 0.15) / plot_w)
               for b, t in zip(bars, values, strict=True))
    ax.set_xlim(0, max(xmax, largest / scale * 1.05))
    ax.xaxis.set_major_locator(MaxNLocator(nbins=10, steps=[1, 2, 5, 10]))
    ax.set_xlabel(f"{unit} sent per device per step", fontsize=9.5, color=_MUTED, loc="right")
    ax.tick_params(axis="x", labelsize=9, colors=_MUTED)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    ax.grid(axis="x", color="#EEEEEE", linewidth=0.8)
    ax.set_axisbelow(True)


# --------------------------------------------------------------------------------------------
# Pipeline schedule

# Forward, backward and its two halves, idle: one colour each (Okabe-Ito again).
SCHEDULE_COLORS: dict[str, str] = {"F": "#0072B2", "B": "#009E73", "I": "#56B4E9",
                                   "W": "#CC79A7"}
_SCHEDULE_NAMES = {"F": "forward", "B": "backward (2 ticks)", "I": "input-gradient half (I)",
                   "W": "weight-gradient half (W)"}


def draw_schedule(table: Sequence[Sequence[Any]], path: str | Path, title: str) -> None:
    """Write a PNG timeline of a pipeline schedule table (``jaxpar.parallel.pipeline``)."""
    save_figure(schedule_figure(table, title), path)


def schedule_figure(table: Sequence[Sequence[Any]], title: str) -> Figure:
    """Stages down, ticks across; each action a box labelled with its microbatch (and chunk
    letter when stages hold several chunks), idle ticks left light grey. Action boxes carry the
    gid ``action:<kind>:<stage>:<tick>``."""
    from matplotlib.patches import Patch, Rectangle

    fig_cls = _require_matplotlib()
    ticks, stages = len(table), len(table[0]) if table else 0
    several = any(cell is not None and cell.chunk >= stages for tick in table for cell in tick)
    cell_in = min(0.45, max(0.16, 16.0 / max(ticks, 1)))
    width = max(8.0, 1.3 + cell_in * ticks + 0.3)
    height = 1.4 + 0.5 * stages + 0.6
    fig = fig_cls(figsize=(width, height), dpi=100)
    _attach_canvas(fig)
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
    ax.set_xlabel("tick (one forward of one chunk)", color=_MUTED)
    ax.tick_params(length=0, colors=_MUTED)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    kinds = [k for k in SCHEDULE_COLORS if any(c is not None and c.kind == k for tick in table
                                                for c in tick)]
    handles = [Patch(facecolor=SCHEDULE_COLORS[k], label=_SCHEDULE_NAMES[k]) for k in kinds]
    handles.append(Patch(facecolor="#F2F2F2", label="idle (bubble)"))
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), frameon=False,
               fontsize=9, bbox_to_anchor=(0.5, 0.0))
    fig.text(0.2 / width, 1 - 0.2 / height, title, ha="left", va="top", fontsize=12,
             fontweight="bold", color=_TEXT)
    return fig
