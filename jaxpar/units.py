"""Byte counts as people read them (binary units, as memory is allocated)."""

from __future__ import annotations


def human_bytes(n: float | None, fmt: str = ",.2f") -> str:
    """``1536`` -> ``'1.50 KiB'``; ``fmt`` formats the number (``".3g"`` for short labels)."""
    if n is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:,.0f} B" if unit == "B" else f"{n:{fmt}} {unit}"
        n /= 1024
    return f"{n:{fmt}} TiB"
