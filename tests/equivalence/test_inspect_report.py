"""``jaxpar inspect``'s report of one compiled (never run) train step, built in this process.

Two layouts are compiled here (8 virtual CPU devices from conftest.py) and shared by the report
tests. The command line: ``tests/integration/test_inspect_cli.py``.
"""

from __future__ import annotations

import functools
import json
import math

import pytest
from helpers import INSPECT_JSON_KEYS as DESIGN_KEYS
from rich.console import Console

from jaxpar.config import load_config, validate
from jaxpar.inspect.report import inspect_step, print_report
from jaxpar.mesh import make_mesh
from jaxpar.model.flop_formula import train_flops_per_token

# DESIGN_KEYS (helpers.INSPECT_JSON_KEYS): the JSON contract of docs/design.md; the keys of its
# parts:
PARAM_KEYS = {"name", "shape", "spec", "bytes_per_device"}
MEMORY_KEYS = {"argument_bytes", "output_bytes", "temp_bytes", "peak_bytes"}
COLLECTIVE_KEYS = {"kind", "count", "bytes", "axes"}
FLOPS_KEYS = {"compiled", "analytic"}
MESH_AXES = ["pipe", "data", "fsdp", "expert", "context", "tensor"]
FLOAT32_BYTES = 4


@functools.cache
def report_for(*overrides: str) -> dict:
    cfg = validate(load_config("tiny", list(overrides)), 8)
    return inspect_step(cfg, make_mesh(cfg))


def fsdp8() -> dict:
    return report_for("mesh.data=1", "mesh.fsdp=8")


def data2_tensor4() -> dict:
    return report_for("mesh.data=2", "mesh.tensor=4")


def rows(report: dict, kind: str, axes: list[str]) -> list[dict]:
    return [r for r in report["collectives"] if r["kind"] == kind and r["axes"] == axes]


def global_bytes(row: dict) -> int:
    return math.prod(row["shape"]) * FLOAT32_BYTES  # parameters are stored in float32


# --------------------------------------------------------------------------------------------
# The report (in process)


def test_report_keys_are_design_md_json_and_serialisable():
    report = fsdp8()
    assert set(report) == DESIGN_KEYS | {"run"}
    assert list(report["mesh"]) == MESH_AXES and report["devices"] == 8
    assert report["params"] and all(set(p) == PARAM_KEYS for p in report["params"])
    assert all(len(p["spec"]) == len(p["shape"]) for p in report["params"])
    assert MEMORY_KEYS <= set(report["memory"])
    assert report["collectives"] and all(COLLECTIVE_KEYS <= set(c) for c in report["collectives"])
    assert FLOPS_KEYS <= set(report["flops"])
    assert json.loads(json.dumps(report)) == report  # plain JSON types only


def test_fsdp8_holds_one_eighth_of_every_parameter_per_device():
    report = fsdp8()
    for param in report["params"]:
        assert "fsdp" in param["spec"], param
        assert param["bytes_per_device"] * 8 == global_bytes(param), param
    per_device = sum(p["bytes_per_device"] for p in report["params"])
    assert per_device == pytest.approx(report["run"]["param_bytes"] / 8)


def test_fsdp8_gathers_weights_and_reduce_scatters_grads_over_fsdp():
    report = fsdp8()
    assert rows(report, "all-gather", ["fsdp"])
    assert rows(report, "reduce-scatter", ["fsdp"])
    # XLA:CPU spells reduce-scatter as all-reduce + dynamic-slice (docs/jax-notes.md).
    lowered = {s for r in rows(report, "reduce-scatter", ["fsdp"]) for s in r["lowered_as"]}
    assert lowered == {"all-reduce+dynamic-slice"}


def test_memory_arguments_hold_the_per_device_train_state_and_peak_adds_up():
    memory = fsdp8()["memory"]
    params = sum(p["bytes_per_device"] for p in fsdp8()["params"])
    assert memory["params_bytes"] == params
    # AdamW keeps two float32 moments per parameter (+ scalar step counters).
    assert memory["optimizer_bytes"] == pytest.approx(2 * params, abs=64)
    assert memory["argument_bytes"] >= params + memory["optimizer_bytes"]
    assert memory["temp_bytes"] > 0
    assert memory["peak_bytes"] == (memory["argument_bytes"] + memory["output_bytes"]
                                    - memory["alias_bytes"] + memory["temp_bytes"])


def test_flops_are_per_device_and_xla_counts_the_layer_loop_once():
    report = fsdp8()
    flops, run = report["flops"], report["run"]
    cfg = load_config("tiny")
    tokens = run["batch_size"] * run["seq_len"]
    assert flops["analytic"] == pytest.approx(
        train_flops_per_token(cfg.model, run["seq_len"]) * tokens / 8)
    # compiled is one device's share of one layer (module docstring); if XLA starts counting
    # loop iterations, this ratio jumps to ~n_layers and the printed note must change.
    assert 1.0 <= flops["ratio_loops_once"] < 1.6, flops
    assert flops["compiled"] < flops["analytic"]


def test_tensor4_splits_heads_and_mlp_and_all_reduces_over_tensor():
    report = data2_tensor4()
    split = {p["name"]: p for p in report["params"] if "tensor" in p["spec"]}
    assert {"layers/attn/wq", "layers/attn/wo", "layers/mlp/w_up", "layers/mlp/w_down"} <= set(
        split)
    for param in split.values():
        assert param["bytes_per_device"] * 4 == global_bytes(param), param
    assert rows(report, "all-reduce", ["tensor"])
    assert not rows(report, "all-gather", ["fsdp"])


def test_print_report_shows_every_table_and_the_cpu_reduce_scatter_note():
    console = Console(record=True, width=140)
    print_report(fsdp8(), console)
    text = console.export_text()
    for needle in ("jaxpar inspect 8 x cpu", "mesh fsdp=8", "parameters", "layers/attn/wq",
                   "memory per device", "peak", "collectives", "reduce-scatter",
                   "all-reduce+dynamic-slice: XLA:CPU", "flops per device", "loops once"):
        assert needle in text, needle
