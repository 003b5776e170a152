"""What every jaxpar picture shares: matplotlib (optional, Agg only), colours, labels, saving.

Every mesh axis keeps one colour in all panels and pictures (:data:`AXIS_COLORS`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from jaxpar.units import human_bytes

if TYPE_CHECKING:
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
REPLICATED = "#E6E6E6"
TEXT = "#222222"
MUTED = "#6B6B6B"
RULE = "#D0D0D0"
_DPI = 110


def require_matplotlib() -> type[Figure]:
    """matplotlib's ``Figure``, or a one-line ImportError that says what to install."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError("pictures need matplotlib: pip install -e '.[plot]' "
                          "(or pip install matplotlib)") from None
    return Figure


def attach_canvas(fig: Figure) -> None:
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


def split_axes(mesh: Mapping[str, int]) -> list[tuple[str, int]]:
    """The mesh axes that split something (size > 1), outermost first."""
    return [(name, int(size)) for name, size in mesh.items() if int(size) > 1]


def short_bytes(n: float | None) -> str:
    """Short label for the picture: ``1536`` -> ``'1.5 KiB'``."""
    return human_bytes(n, ".3g")


def width_in(text: Text) -> float:
    """Rendered width of a text artist, in inches (the figure must have a canvas)."""
    fig = text.figure
    return text.get_window_extent(fig.canvas.get_renderer()).width / fig.dpi


def mesh_axes_text(axes: Sequence[tuple[str, int]]) -> str:
    return " × ".join(f"{name}={size}" for name, size in axes) or "1 device"


