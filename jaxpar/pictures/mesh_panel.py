"""Panel 1 of the inspect picture: the device mesh, one box per device.

The split axes (size > 1) are laid out innermost first: the innermost along the columns, the next
along the rows, the outer ones as blocks side by side, then stacked, alternating. Coloured lines
join the devices of one group along an axis, the devices that run that axis's collectives
together: lines for columns and rows, arcs between blocks.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import textwrap
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from jaxpar.pictures.style import (
    MUTED,
    TEXT,
    axis_color,
)

if TYPE_CHECKING:
    from matplotlib.axes import Axes

# Device boxes in mesh units; gaps grow with the nesting level so that blocks stand apart.
_BOX_W, _BOX_H = 1.0, 0.62
_LEVEL_GAP = (0.3, 0.3, 0.8, 0.8, 1.4, 1.4)
_ARC_RAD = 0.25      # how far the arcs joining blocks bulge, relative to their length
_MAX_ARCS = 4        # arcs per block axis: enough to show the pattern without a tangle
_LABEL_PT = 10.5     # axis labels around the mesh
_CAPTION_PT = 9.0    # the caption under the panel title
_BEST_SCALE = 0.85   # inches per box width when there is room: larger boxes only waste space
MIN_SCALE = 0.45    # below this "#n" gets hard to read: the figure grows (up to a point)


@dataclasses.dataclass
class MeshPanel:
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


def mesh_layout(axes: Sequence[tuple[str, int]], panel_w: float) -> MeshPanel:
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
    return MeshPanel(
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


def draw_mesh(ax: Axes, mesh: MeshPanel) -> None:
    """Draw the mesh panel into ``ax``: block frames, device boxes, the lines and arcs of each
    axis with its labels, and the caption."""
    ax.set_axis_off()
    ax.set_title("device mesh: one box per device", loc="left", fontsize=12.5,
                 fontweight="bold", color=TEXT, pad=8)
    panel = ax.get_position()
    panel_w = panel.width * ax.figure.get_figwidth()
    panel_h = panel.height * ax.figure.get_figheight()
    scale = mesh.scale(panel_w, panel_h)  # one scale for x and y: boxes keep their shape
    x0 = -mesh.rise_y - mesh.margin_in["left"] / scale
    y0 = -mesh.rise_x - mesh.margin_in["top"] / scale
    ax.set_xlim(x0, x0 + panel_w / scale)
    ax.set_ylim(y0 + panel_h / scale, y0)  # inverted: y grows downwards

    _draw_block_frames(ax, mesh)
    coords_line = _draw_boxes(ax, mesh, scale)
    for level in range(len(mesh.levels)):
        if level < 2:
            _draw_rows_and_columns(ax, mesh, level, scale)
        else:
            _draw_block_arcs(ax, mesh, level)
            _draw_block_headers(ax, mesh, level, scale)
    caption = mesh.caption if coords_line or not mesh.axes else mesh.caption[:-1]
    ax.text(0.0, 1.0, "\n".join(caption), transform=ax.transAxes, ha="left", va="top",
            fontsize=_CAPTION_PT, color=MUTED, linespacing=1.4)


def _centers(mesh: MeshPanel) -> list[tuple[float, float]]:
    return [(x + _BOX_W / 2, y + _BOX_H / 2) for x, y in mesh.corner]


def _block_instances(mesh: MeshPanel, level: int) -> list[list[int]]:
    """The blocks of a level: devices sharing their coordinates on it and the outer levels."""
    outer = [name for name, _, _, _ in mesh.levels[level:]]
    blocks: dict[tuple[int, ...], list[int]] = {}
    for i, c in enumerate(mesh.devices):
        blocks.setdefault(tuple(c[n] for n in outer), []).append(i)
    return list(blocks.values())


def _bounds(mesh: MeshPanel, members: Sequence[int]) -> tuple[float, float, float, float]:
    xs = [mesh.corner[i][0] for i in members]
    ys = [mesh.corner[i][1] for i in members]
    return min(xs), min(ys), max(xs) + _BOX_W, max(ys) + _BOX_H


def _label_style() -> dict[str, Any]:
    return {"fontsize": _LABEL_PT, "fontweight": "bold", "textcoords": "offset points",
            "annotation_clip": False, "zorder": 5}


def _draw_block_frames(ax: Axes, mesh: MeshPanel) -> None:
    """Blocks get a faint frame so that they read as units before anything else is looked at."""
    from matplotlib.patches import FancyBboxPatch

    for level in range(2, len(mesh.levels)):
        pad = 0.12 + 0.1 * ((level - 2) // 2)
        for members in _block_instances(mesh, level):
            xa, ya, xb, yb = _bounds(mesh, members)
            ax.add_patch(FancyBboxPatch((xa - pad, ya - pad), xb - xa + 2 * pad,
                                        yb - ya + 2 * pad, facecolor="#000000", alpha=0.035,
                                        boxstyle="round,pad=0,rounding_size=0.1",
                                        edgecolor="none", zorder=0))


def _draw_boxes(ax: Axes, mesh: MeshPanel, scale: float) -> bool:
    """Boxes: the position in the mesh and, when the box is large enough, the coordinates
    (returns whether they were drawn)."""
    from matplotlib.patches import FancyBboxPatch

    axes, center = mesh.axes, _centers(mesh)
    box_pt = 72 * scale * _BOX_W
    short = _short_axis_names(axes)  # the caption explains these
    coords_pt = min(9.0, box_pt * 0.85 / (max(len(axes), 1) * 3 * 0.6))
    coords_line = len(axes) > 1 and coords_pt >= 6.0
    index_pt = min(12.0, max(5.0, box_pt / (4.5 if coords_line else 3.4)))
    for i, coords in enumerate(mesh.devices):
        ax.add_patch(FancyBboxPatch(mesh.corner[i], _BOX_W, _BOX_H,
                                    boxstyle="round,pad=0,rounding_size=0.07",
                                    facecolor="white", edgecolor="#4A4A4A", linewidth=1.0,
                                    zorder=3, gid=f"device:{i}"))
        cx, cy = center[i]
        ax.text(cx, cy - (0.1 if coords_line else 0.0), f"#{i}", ha="center", va="center",
                fontsize=index_pt, fontweight="bold", color=TEXT, zorder=4)
        if coords_line:
            ax.text(cx, cy + 0.16, " ".join(f"{short[n]}{c}" for n, c in coords.items()),
                    ha="center", va="center", fontsize=coords_pt, color=MUTED, zorder=4)
    return coords_line


def _draw_rows_and_columns(ax: Axes, mesh: MeshPanel, level: int, scale: float) -> None:
    """Columns and rows: a thick line behind each group's boxes shows in the gaps between them,
    a wire joining neighbours; the axis is named under the columns or left of the rows."""
    name, size, direction, _stride = mesh.levels[level]
    color, center = axis_color(name), _centers(mesh)
    wire_pt = min(6.0, 0.09 * 72 * scale * _BOX_W + 1)
    for i in (i for i, c in enumerate(mesh.devices) if c[name] == 0):
        (xa, ya), (xb, yb) = center[i], center[mesh.group(i, name)[-1]]
        ax.plot([xa, xb], [ya, yb], color=color, linewidth=wire_pt,
                solid_capstyle="round", zorder=1)
    first = mesh.group(0, name)  # device #0's group, in the top-left block
    if direction == "x":  # name the axis under the first block's columns
        mid = (center[first[0]][0] + center[first[-1]][0]) / 2
        ax.annotate(f"{name} ({size}) →", (mid, mesh.height), xytext=(0, -4),
                    ha="center", va="top", color=color, gid=f"axis-label:{name}",
                    **_label_style())
    else:  # and left of its rows, reading downwards
        mid = (center[first[0]][1] + center[first[-1]][1]) / 2
        ax.annotate(f"{name} ({size}) →", (-mesh.rise_y, mid), xytext=(-5, 0),
                    ha="center", va="top", rotation=-90, rotation_mode="anchor",
                    color=color, gid=f"axis-label:{name}", **_label_style())


def _draw_block_arcs(ax: Axes, mesh: MeshPanel, level: int) -> None:
    """Blocks: arcs join a device to its counterparts in the other blocks, from the outer edge
    (top row for blocks side by side, left column for stacked ones) so they cross no box. Every
    position has such a group; those of the first block's edge show the pattern."""
    from matplotlib.patches import FancyArrowPatch

    name, _size, direction, _stride = mesh.levels[level]
    color, center, corner, devices = axis_color(name), _centers(mesh), mesh.corner, mesh.devices
    along = 1 if direction == "x" else 0  # the edge: y = 0 (top) or x = 0 (left)
    others = [n for n, _, _, _ in mesh.levels[2:] if n != name]
    edge = [i for i, c in enumerate(devices) if c[name] == 0
            and corner[i][along] == 0.0 and all(devices[i][n] == 0 for n in others)]
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


def _draw_block_headers(ax: Axes, mesh: MeshPanel, level: int, scale: float) -> None:
    """Block headers: the axis and coordinate above (or left of) every block on the edge,
    stacked outwards by nesting depth so that no two levels share a line. Where "name k" is
    longer than a block, the blocks get just "k" and the name stands once before them."""
    name, _size, direction, _stride = mesh.levels[level]
    color, corner = axis_color(name), mesh.corner
    depth = (level - 2) // 2
    edge_blocks = [m for m in _block_instances(mesh, level)
                   if min(corner[i][1 if direction == "x" else 0] for i in m) == 0.0]
    xa, ya, xb, yb = _bounds(mesh, edge_blocks[0])
    span_in = (xb - xa if direction == "x" else yb - ya) * scale
    fits = 0.6 * _LABEL_PT / 72 * (len(name) + 3) < span_in
    offset = 72 * (mesh.row_label_in + sum(mesh.block_label_in[:depth])) + 5
    for n, members in enumerate(edge_blocks):
        k = mesh.devices[members[0]][name]
        text = f"{name} {k}" if fits else (f"{name}  {k}" if n == 0 else str(k))
        gid = f"axis-label:{name}" if n == 0 else None
        xa, ya, xb, yb = _bounds(mesh, members)
        if direction == "x":
            ax.annotate(text, ((xa + xb) / 2, -mesh.rise_x), xytext=(0, 4 + 19 * depth),
                        ha="center" if fits or n else "right", va="bottom", color=color,
                        gid=gid, **_label_style())
        else:
            ax.annotate(text, (-mesh.rise_y, (ya + yb) / 2), xytext=(-offset, 0),
                        ha="center" if fits or n else "right", va="top", rotation=-90,
                        rotation_mode="anchor", color=color, gid=gid, **_label_style())
