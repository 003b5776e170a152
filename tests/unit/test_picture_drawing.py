"""``jaxpar.pictures``: the PNG of an inspect report (mesh, parameter splits, collectives), drawn
from hand-written reports in the shape of ``inspect_step``'s (nothing compiled): 3 split axes like
demo-5d, all 6 axes on 64 devices, and a single device. Each figure has one box per device, one
label per mesh axis of size > 1, and no two texts on top of each other. The picture of a real
report (the tiny preset compiled on data=2 x tensor=4): ``tests/equivalence/
test_picture_of_compiled_report.py``.
"""

from __future__ import annotations

import sys

import pytest

pytest.importorskip("matplotlib")

from helpers import (  # noqa: E402
    ALL_AXES,
    DEMO_MESH,
    assert_a_box_per_device_and_a_label_per_split_axis,
    hand_report,
    real_report,
)

from jaxpar.pictures.figures import report_figure  # noqa: E402
from jaxpar.pictures.tables import param_rows  # noqa: E402


# The "real" case (a compiled report) is in tests/equivalence/test_picture_of_compiled_report.py.
@pytest.mark.parametrize("name", ["demo", "all-axes", "one-device"])
def test_figure_has_a_box_per_device_and_a_label_per_split_axis(name: str) -> None:
    report = {"real": real_report, "demo": lambda: hand_report(DEMO_MESH),
              "all-axes": lambda: hand_report(ALL_AXES),
              "one-device": lambda: hand_report({})}[name]()
    assert_a_box_per_device_and_a_label_per_split_axis(report)


def test_parameters_are_grouped_and_merged_by_spec() -> None:
    rows = param_rows(hand_report(DEMO_MESH)["params"], DEMO_MESH)
    # in the order of the forward pass, not the report's alphabetical one
    assert [r["names"] for r in rows] == [["embedding"], ["wq", "wk", "wv"], ["wo"],
                                          ["w_gate", "w_up"], ["w_down"],
                                          ["attn_norm", "mlp_norm"], ["final_norm"], ["lm_head"]]
    assert [r["group"] for r in rows] == ["embedding", "attention", "attention", "mlp", "mlp",
                                          "norms", "norms", "head"]
    qkv = rows[1]
    assert qkv["split"] == {"fsdp": 1, "tensor": 2}
    assert qkv["global"] == 4 * qkv["device"]


def test_without_matplotlib_the_error_says_what_to_install(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # makes the import fail
    with pytest.raises(ImportError, match=r"pip install -e '\.\[plot\]'"):
        report_figure(hand_report(DEMO_MESH))
