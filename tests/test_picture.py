"""``jaxpar.pictures.figures``: the PNG of an inspect report (mesh, parameter splits, collectives).

One real report (the tiny preset compiled on data=2 x tensor=4, 8 virtual CPU devices from
conftest.py) and hand-written reports in the same shape: 3 split axes like demo-5d, all 6 axes
on 64 devices, and a single device. Each picture is checked as a file (a PNG of a sensible size)
and as a figure: one box per device, one label per mesh axis of size > 1, and no two texts on top
of each other.
"""

from __future__ import annotations

import functools
import itertools
import sys
from typing import Any

import pytest

pytest.importorskip("matplotlib")

from jaxpar.pictures.figures import draw_report, report_figure  # noqa: E402
from jaxpar.pictures.tables import param_rows  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
MESH_AXES = ["pipe", "data", "fsdp", "expert", "context", "tensor"]


@functools.cache
def real_report() -> dict[str, Any]:
    from jaxpar.config import load_config, validate
    from jaxpar.inspect.report import inspect_step
    from jaxpar.mesh import make_mesh

    cfg = validate(load_config("tiny", ["mesh.data=2", "mesh.tensor=4"]), 8)
    return inspect_step(cfg, make_mesh(cfg))


def param(name: str, shape: list[int], spec: list[Any], shards: int) -> dict[str, Any]:
    size = 4
    for n in shape:
        size *= n
    return {"name": name, "shape": shape, "spec": spec, "bytes_per_device": size // shards}


def hand_report(mesh: dict[str, int]) -> dict[str, Any]:
    """A report in the shape of ``inspect_step``'s, for any mesh (the numbers are made up)."""
    devices = 1
    for size in mesh.values():
        devices *= size
    split = [a for a in MESH_AXES if mesh.get(a, 1) > 1]
    f = "fsdp" if mesh.get("fsdp", 1) > 1 else None
    t = "tensor" if mesh.get("tensor", 1) > 1 else None
    nf, nt = mesh.get("fsdp", 1), mesh.get("tensor", 1)
    return {
        "devices": devices,
        "mesh": {a: mesh.get(a, 1) for a in MESH_AXES},
        "run": {"device_kind": "cpu", "param_count": 853120, "param_bytes": 3412480,
                "n_layers": 4, "batch_size": 16, "seq_len": 128, "grad_accum": 1,
                "dtype": "float32", "remat": "dots", "zero": 3, "sequence_parallel": True,
                "compile_seconds": 1.0},
        "params": [
            param("embedding", [256, 128], [t, f], nf * nt),
            param("final_norm/scale", [128], [f], nf),
            param("layers/attn/wk", [4, 128, 4, 16], [None, f, t, None], nf * nt),
            param("layers/attn/wo", [4, 8, 16, 128], [None, t, None, f], nf * nt),
            param("layers/attn/wq", [4, 128, 8, 16], [None, f, t, None], nf * nt),
            param("layers/attn/wv", [4, 128, 4, 16], [None, f, t, None], nf * nt),
            param("layers/attn_norm/scale", [4, 128], [None, f], nf),
            param("layers/mlp/w_down", [4, 384, 128], [None, t, f], nf * nt),
            param("layers/mlp/w_gate", [4, 128, 384], [None, f, t], nf * nt),
            param("layers/mlp/w_up", [4, 128, 384], [None, f, t], nf * nt),
            param("layers/mlp_norm/scale", [4, 128], [None, f], nf),
            param("lm_head", [128, 256], [f, t], nf * nt),
        ],
        "memory": {"argument_bytes": 2568972, "output_bytes": 2563176, "temp_bytes": 12121752,
                   "peak_bytes": 14691072, "alias_bytes": 2562828, "params_bytes": 854272,
                   "optimizer_bytes": 1708552},
        "collectives": [
            {"kind": kind, "count": 10 + k, "instructions": 4, "bytes": 2**20 * (k + 1),
             "wire_bytes": 2**19 * (k + 1), "axes": [axis], "lowered_as": [kind]}
            for k, (axis, kind) in enumerate(itertools.product(
                split, ["all-gather", "reduce-scatter", "all-reduce"]))
        ] + ([{"kind": "collective-permute", "count": 29, "bytes": 819200, "wire_bytes": 819200,
               "axes": split[:2], "lowered_as": ["collective-permute"]}] if len(split) > 1
             else []),
        "flops": {"compiled": 1e9, "analytic": 1e9},
    }


DEMO_MESH = {"data": 1, "fsdp": 2, "context": 2, "tensor": 2}
ALL_AXES = dict.fromkeys(MESH_AXES, 2)  # 64 devices


def device_boxes(fig) -> list[str]:
    return [p.get_gid() for ax in fig.axes for p in ax.patches
            if (p.get_gid() or "").startswith("device:")]


def axis_labels(fig) -> dict[str, str]:
    """``{axis: label text}`` for the texts that name a mesh axis."""
    return {t.get_gid().removeprefix("axis-label:"): t.get_text() for ax in fig.axes
            for t in ax.texts if (t.get_gid() or "").startswith("axis-label:")}


def overlapping_texts(fig) -> list[tuple[str, str]]:
    """Pairs of drawn texts whose boxes overlap by more than a pixel each way."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    from matplotlib.text import Text

    texts = list(fig.texts)
    for ax in fig.axes:  # the children are the texts and the titles
        texts += [c for c in ax.get_children() if isinstance(c, Text)] + [ax.xaxis.label]
        if ax.axison:  # tick labels are drawn only inside the view limits
            low, high = sorted(ax.get_xlim())
            texts += [t for t in ax.get_xticklabels() if low <= t.get_position()[0] <= high]
    boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in texts
             if t.get_visible() and t.get_text().strip()]
    return [(a, b) for (a, box_a), (b, box_b) in itertools.combinations(boxes, 2)
            if min(box_a.x1, box_b.x1) - max(box_a.x0, box_b.x0) > 1
            and min(box_a.y1, box_b.y1) - max(box_a.y0, box_b.y0) > 1]


@pytest.mark.parametrize("name", ["real", "demo", "all-axes", "one-device"])
def test_figure_has_a_box_per_device_and_a_label_per_split_axis(name: str) -> None:
    report = {"real": real_report, "demo": lambda: hand_report(DEMO_MESH),
              "all-axes": lambda: hand_report(ALL_AXES),
              "one-device": lambda: hand_report({})}[name]()
    fig = report_figure(report)
    assert sorted(device_boxes(fig)) == sorted(f"device:{i}" for i in range(report["devices"]))
    split = {a for a, size in report["mesh"].items() if size > 1}
    labels = axis_labels(fig)
    assert set(labels) == split
    for axis, text in labels.items():
        assert axis in text
    assert overlapping_texts(fig) == []


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
