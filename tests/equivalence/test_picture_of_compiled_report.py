"""``jaxpar.pictures.figures``: the PNG of a real inspect report (the tiny preset compiled on
data=2 x tensor=4, 8 virtual CPU devices from conftest.py), checked as a file (a PNG of a sensible
size) and as a figure: one box per device, one label per mesh axis of size > 1, and no two texts on
top of each other. Hand-written reports: ``tests/unit/test_picture_drawing.py``.
"""

from __future__ import annotations

import pytest

pytest.importorskip("matplotlib")

from helpers import (  # noqa: E402
    ALL_AXES,
    DEMO_MESH,
    assert_a_box_per_device_and_a_label_per_split_axis,
    hand_report,
    real_report,
)

from jaxpar.pictures.figures import draw_report, report_figure  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# The hand-written cases ("demo", "all-axes", "one-device"): tests/unit/test_picture_drawing.py.
@pytest.mark.parametrize("name", ["real"])
def test_figure_has_a_box_per_device_and_a_label_per_split_axis(name: str) -> None:
    report = {"real": real_report, "demo": lambda: hand_report(DEMO_MESH),
              "all-axes": lambda: hand_report(ALL_AXES),
              "one-device": lambda: hand_report({})}[name]()
    assert_a_box_per_device_and_a_label_per_split_axis(report)


def test_draw_report_writes_a_png(tmp_path) -> None:
    path = tmp_path / "sub" / "report.png"  # missing folders are created
    draw_report(real_report(), path)
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert 30_000 < len(data) < 5_000_000
    # Width and height from the IHDR chunk: a picture to look at, not a thumbnail or a poster.
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert 1800 <= width <= 3000 and 600 <= height <= 2000


def test_real_report_picture_names_what_the_layout_does() -> None:
    fig = report_figure(real_report())
    texts = " ".join(t.get_text() for ax in fig.axes for t in ax.texts)
    title = " ".join(t.get_text() for t in fig.texts)
    assert "mesh data=2 × tensor=4" in title and "peak" in title and "M params" in title
    # tensor splits the embedding over the vocabulary; data replicates every parameter
    assert "P('tensor', None)" in texts
    assert "all-reduce" in texts
