"""Panels 2 and 3 of the inspect picture: the parameter table and the collectives chart.

Parameters are grouped by name (embedding, attention, mlp, norms, head, ...); rows of one group
are merged when they share a ``PartitionSpec``. One cell per mesh axis says whether the row is
split over that axis (and on which dimension) or replicated on it, and a bar shows the bytes one
device holds against the global size. The collectives chart has one bar per (mesh axes, kind):
the bytes each device sends per step.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from jaxpar.pictures.style import (
    MUTED,
    REPLICATED,
    RULE,
    TEXT,
    axis_color,
    short_bytes,
    width_in,
)

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.text import Text

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


def spec_text(spec: Sequence[Any]) -> str:
    def entry(e: Any) -> str:
        if isinstance(e, list | tuple):
            return "(" + ", ".join(repr(a) for a in e) + ")"
        return repr(e)

    return "P(" + ", ".join(entry(e) for e in spec) + ")"


def param_rows(params: Sequence[Mapping[str, Any]], mesh: Mapping[str, int]
                ) -> list[dict[str, Any]]:
    """Parameters merged by (group, spec): ``{group, names, spec, split, device, global}``."""
    merged: dict[tuple[str, str], dict[str, Any]] = {}
    for p in params:
        group = _param_group(p["name"])
        spec = [list(e) if isinstance(e, tuple) else e for e in p["spec"]]
        split = _spec_axes(spec)
        shards = math.prod(int(mesh.get(a, 1)) for a in split)
        row = merged.setdefault((group, spec_text(spec)), {
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


_PAD = 0.2  # inches between the table's columns
_ROW_IN = 0.3  # inches between its rows
_HEADER = {"fontsize": 9.5, "fontweight": "bold", "color": MUTED}


def _column(ax: Axes, x: float, texts: Sequence[tuple[float, str, dict[str, Any]]]) -> float:
    """Draw a column of texts at x; the x where the next column can start."""
    drawn = [ax.text(x, y, s, va="center" if y >= 0 else "bottom", **kw) for y, s, kw in texts]
    return x + max(width_in(t) for t in drawn) + _PAD


def _axis_cells(ax: Axes, rows: Sequence[Mapping[str, Any]], axes: Sequence[tuple[str, int]],
                x: float) -> float:
    """One cell per split mesh axis: the axis colour and the dimension it splits, or grey.
    Returns the x where the next column can start."""
    from matplotlib.patches import FancyBboxPatch

    row_in = _ROW_IN
    heads = [ax.text(0, -0.55, f"{name}\n×{size}", ha="center", va="bottom", fontsize=9.5,
                     fontweight="bold", color=axis_color(name), linespacing=1.05)
             for name, size in axes]
    cell_w = max([0.62] + [width_in(t) + 0.1 for t in heads])
    for k, (name, _size) in enumerate(axes):
        cx = x + k * cell_w + cell_w / 2
        heads[k].set_x(cx)
        for r, row in enumerate(rows):
            split = name in row["split"]
            ax.add_patch(FancyBboxPatch((x + k * cell_w + 0.03, r - 0.36), cell_w - 0.06, 0.72,
                                        boxstyle="round,pad=0,rounding_size=0.05",
                                        mutation_aspect=1 / row_in, edgecolor="none",
                                        facecolor=axis_color(name) if split else REPLICATED))
            ax.text(cx, r, f"dim {row['split'][name]}" if split else "repl.", ha="center",
                    va="center", fontsize=8.5, color="white" if split else "#8A8A8A",
                    fontweight="bold" if split else "normal")
    return x + (len(axes) * cell_w + _PAD)


def _byte_bars(ax: Axes, rows: Sequence[Mapping[str, Any]], x: float, panel_w: float) -> float:
    """Bytes: the numbers, then a light bar for the global size (to scale across rows) with the
    device's share dark on it; the bar takes the width that is left. Returns the bar's x."""
    from matplotlib.patches import Rectangle

    n = len(rows)
    total_device = sum(row["device"] for row in rows)
    total_global = sum(row["global"] for row in rows)

    def share(device: int, global_: int) -> str:
        return "all" if global_ <= device else f"1/{global_ / max(device, 1):.3g}"

    bar_x = _column(ax, x, [(-0.55, "per device of global", _HEADER)]
                    + [(r, f"{short_bytes(row['device'])} of {short_bytes(row['global'])} "
                           f"({share(row['device'], row['global'])})", {"fontsize": 9})
                       for r, row in enumerate(rows)]
                    + [(n + 0.15, f"{short_bytes(total_device)} of {short_bytes(total_global)} "
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
    return bar_x


def draw_params(ax: Axes, rows: Sequence[Mapping[str, Any]],
                 axes: Sequence[tuple[str, int]]) -> float:
    """Draw the table; returns the width it would like, in inches (its columns and a bar)."""
    ax.set_axis_off()
    ax.set_title("parameters: which mesh axis splits them, bytes per device", loc="left",
                 fontsize=12.5, fontweight="bold", color=TEXT, pad=8)
    n = len(rows)
    panel_w = ax.get_position().width * ax.figure.get_figwidth()
    panel_h = ax.get_position().height * ax.figure.get_figheight()
    # Rows are 0.3 in apart whatever the panel height (row r is centred on y = r), under a
    # two-line caption and a header; leftover height stays empty at the bottom.
    ax.set_xlim(0, panel_w)  # x in inches, so columns can be placed by measured text widths
    ax.set_ylim(-2.95 + panel_h / _ROW_IN, -2.95)
    if not rows:
        ax.text(0, 0, "no parameters in the report", fontsize=10, color=MUTED)
        return 4.0

    starts = [r for r in range(n) if r == 0 or rows[r]["group"] != rows[r - 1]["group"]]
    x = _column(ax, 0.0, [(-0.55, "group", _HEADER)]
                + [(r, rows[r]["group"], {"fontsize": 10, "fontweight": "bold"})
                   for r in starts])
    x = _column(ax, x, [(-0.55, "parameters", _HEADER)]
                + [(r, ", ".join(row["names"]), {"fontsize": 9.5})
                   for r, row in enumerate(rows)])
    x = _column(ax, x, [(-0.55, "PartitionSpec", _HEADER)]
                + [(r, spec_text(row["spec"]), {"fontsize": 9, "family": "monospace"})
                   for r, row in enumerate(rows)])
    x = _axis_cells(ax, rows, axes, x)
    bar_x = _byte_bars(ax, rows, x, panel_w)

    for r in starts[1:]:  # rules between groups, and above the total
        ax.plot([0, panel_w], [r - 0.5, r - 0.5], color=RULE, linewidth=0.8)
    ax.plot([0, panel_w], [n - 0.45, n - 0.45], color="#8A8A8A", linewidth=1.0)
    ax.text(0, n + 0.15, "total", fontsize=10, fontweight="bold", va="center")

    caption = ("dim k: split over that mesh axis on dimension k (one device holds 1/size);  "
               "repl.: every device along that axis holds the same copy\n"
               "bars: global bytes (light, to scale across rows) and the part one device holds "
               "(dark)")
    caption = ax.text(0, -1.6, caption, fontsize=9, color=MUTED, va="bottom", linespacing=1.4)
    return max(bar_x + 1.6, width_in(caption))


# --------------------------------------------------------------------------------------------
# Panel 3: collectives


def collective_bars(collectives: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
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


def _label_bars(ax: Axes, bars: Sequence[Mapping[str, Any]],
                groups: Mapping[tuple[str, ...], list[int]], title: Text) -> float:
    """Labels left of the bars, measured so that the plot starts right after them: the axes
    group (with its total) once per group, then the kind on each bar. Returns the plot's width
    in inches once shifted right to make room."""
    from matplotlib.transforms import blended_transform_factory

    left = blended_transform_factory(ax.transAxes, ax.transData)
    group_labels, kind_labels, rules = [], [], []
    for names, ys in groups.items():
        total = sum(bars[y]["wire"] for y in ys)
        # One line when the group has one bar, else two (the name over its total).
        sep = "\n" if len(ys) > 1 else "  "
        group_labels.append(ax.text(0, (ys[0] + ys[-1]) / 2,
                                    f"{' + '.join(names) or '?'}{sep}{short_bytes(total)}",
                                    transform=left, ha="left", va="center", fontsize=10.5,
                                    fontweight="bold", color=axis_color((names or ("?",))[0]),
                                    linespacing=1.15))
        if ys[0] > 0:  # a rule between groups, extended under the labels below
            rules.append(ax.axhline(ys[0] - 0.5, color=RULE, linewidth=0.8, clip_on=False))
    for y, b in enumerate(bars):
        kind_labels.append(ax.text(0, y, b["kind"], transform=left, ha="right", va="center",
                                   fontsize=9.5, color=TEXT))
    group_w = max(width_in(t) for t in group_labels) + 0.25
    kind_w = max(width_in(t) for t in kind_labels) + 0.1
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
    return plot_w


def draw_collectives(ax: Axes, bars: Sequence[Mapping[str, Any]]) -> None:
    from matplotlib.ticker import MaxNLocator

    title = ax.set_title("collectives: bytes each device sends per step (ring algorithm), by "
                         "mesh axes and kind", loc="left", fontsize=12.5, fontweight="bold",
                         color=TEXT, pad=8)
    if not bars:
        ax.set_axis_off()
        ax.text(0.0, 0.7, "none: one device, or nothing is split", fontsize=11, color=MUTED,
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
        values.append(ax.annotate(f"{short_bytes(b['wire'])}{note}", (b["wire"] / scale, y),
                                  xytext=(4, 0), textcoords="offset points", va="center",
                                  fontsize=9, color=TEXT))

    plot_w = _label_bars(ax, bars, groups, title)

    ax.set_yticks([])
    ax.set_ylim(len(bars) - 0.5, -0.5)
    # The x range that leaves room for each value label right of its bar (bar length scales
    # with the range, the label does not).
    xmax = max(b["wire"] / scale / max(0.2, 1 - (width_in(t) + 0.15) / plot_w)
               for b, t in zip(bars, values, strict=True))
    ax.set_xlim(0, max(xmax, largest / scale * 1.05))
    ax.xaxis.set_major_locator(MaxNLocator(nbins=10, steps=[1, 2, 5, 10]))
    ax.set_xlabel(f"{unit} sent per device per step", fontsize=9.5, color=MUTED, loc="right")
    ax.tick_params(axis="x", labelsize=9, colors=MUTED)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    ax.grid(axis="x", color="#EEEEEE", linewidth=0.8)
    ax.set_axisbelow(True)


