"""The logical -> mesh axis table: resolved specs (golden file) and its errors."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from flax import nnx
from jax.sharding import PartitionSpec

from jaxpar.config import ConfigError, load_config, validate
from jaxpar.model.transformer import abstract_model
from jaxpar.parallel.rules import logical_rules, param_logical_axes, param_specs, resolve_spec

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "param_specs.json"
# Presets as shipped, and the tiny model under each single parallelism.
CASES = {
    "tiny": ("tiny", []),
    "demo-5d": ("demo-5d", []),
    "tiny fsdp=8": ("tiny", ["mesh.data=1", "mesh.fsdp=8"]),
    "tiny data=2 tensor=4": ("tiny", ["mesh.data=2", "mesh.tensor=4"]),
    "tiny data=4 zero=1": ("tiny", ["mesh.data=4", "mesh.tensor=2", "parallel.zero=1"]),
    "moe-tiny data=2 fsdp=2 expert=2": ("moe-tiny", ["mesh.data=2", "mesh.fsdp=2",
                                                     "mesh.expert=2"]),
    "moe-tiny expert=4 tensor=2 every=2": ("moe-tiny", ["mesh.data=1", "mesh.expert=4",
                                                        "mesh.tensor=2", "model.n_layers=4",
                                                        "model.moe.every=2"]),
}


def resolved_specs(preset: str, overrides: list[str]) -> dict[str, list]:
    cfg = load_config(preset, overrides)
    cfg = validate(cfg, cfg.host_devices or 8)
    model = abstract_model(cfg.model)
    abstract = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    specs = param_specs(abstract, param_logical_axes(model), logical_rules(cfg), cfg.mesh_shape)
    flat = {}

    def visit(node, prefix):
        for key, value in node.items():
            name = f"{prefix}/{key}" if prefix else str(key)
            if isinstance(value, PartitionSpec):
                flat[name] = [list(e) if isinstance(e, tuple) else e for e in value]
            else:
                visit(value, name)

    visit(specs, "")
    return dict(sorted(flat.items()))


def golden_text(cases: dict[str, dict[str, list]]) -> str:
    """JSON with one parameter per line, so a layout change is a one-line diff."""
    blocks = []
    for case, specs in cases.items():
        lines = [f"  {json.dumps(name)}: {json.dumps(spec)}" for name, spec in specs.items()]
        blocks.append(f" {json.dumps(case)}: {{\n" + ",\n".join(lines) + "\n }")
    return "{\n" + ",\n".join(blocks) + "\n}\n"


def test_parameter_specs_match_golden_file():
    """A change of layout must show up in review: update with JAXPAR_UPDATE_GOLDEN=1."""
    current = {name: resolved_specs(*case) for name, case in CASES.items()}
    if os.environ.get("JAXPAR_UPDATE_GOLDEN"):
        GOLDEN.write_text(golden_text(current))
    assert current == json.loads(GOLDEN.read_text())


def test_golden_file_shows_the_expected_splits():
    golden = json.loads(GOLDEN.read_text())
    assert golden["tiny fsdp=8"]["layers/attn/wq"] == [None, "fsdp", None, None]
    assert golden["tiny data=2 tensor=4"]["layers/attn/wo"] == [None, "tensor", None, None]
    assert golden["tiny data=2 tensor=4"]["layers/mlp/w_up"] == [None, None, "tensor"]
    assert golden["tiny data=2 tensor=4"]["embedding"] == ["tensor", None]
    assert golden["demo-5d"]["layers/block_0/mlp/w_down"] == ["pipe", "tensor", None]
    assert golden["demo-5d"]["layers/block_1/moe/w_gate"] == ["pipe", "expert", None, "tensor"]
    moe = golden["moe-tiny data=2 fsdp=2 expert=2"]
    assert moe["layers/moe/w_down"] == [None, "expert", None, "fsdp"]
    # Outside the experts, expert splits the weights as fsdp does (FSDP over fsdp x expert);
    # routers' expert dimension is never split.
    assert moe["layers/attn/wq"] == [None, ["fsdp", "expert"], None, None]
    assert moe["layers/moe/router"] == [None, ["fsdp", "expert"], None]
    assert golden["tiny data=4 zero=1"]["layers/mlp/w_gate"] == [None, None, "tensor"]


def test_one_mesh_axis_for_two_dims_of_an_array_is_an_error_naming_it():
    with pytest.raises(ConfigError, match=r"layers/mlp/w_\w+: mesh axis 'fsdp' is used for two"):
        resolved_specs("tiny", ["mesh.data=1", "mesh.fsdp=8", "parallel.rules.mlp=fsdp"])


def test_rule_naming_an_axis_the_mesh_lacks_is_an_error_naming_the_array():
    with pytest.raises(ConfigError, match=r"layers/attn/wq: rule 'heads' -> 'model' names an axis"):
        resolve_spec("layers/attn/wq", ("layers", "embed", "heads", "head_dim"), None,
                     {"heads": ("model",), "embed": (), "layers": (), "head_dim": ()},
                     {"data": 2, "tensor": 4})


def test_logical_axis_without_rule_is_an_error_naming_the_array():
    with pytest.raises(ConfigError, match=r"embedding: no rule for logical axis 'vocab'"):
        resolve_spec("embedding", ("vocab", "embed"), None, {"embed": ()}, {"data": 8})


def test_dimension_that_does_not_divide_is_an_error_naming_the_array():
    with pytest.raises(ConfigError, match=r"layers/mlp/w_up: dimension 'mlp' of size 6"):
        resolve_spec("layers/mlp/w_up", ("embed", "mlp"), (8, 6), {"embed": (), "mlp": ("tensor",)},
                     {"tensor": 4})


def test_size_one_axes_are_left_out_of_specs():
    spec = resolve_spec("x", ("batch", "seq"), (8, 4), {"batch": ("data", "fsdp"), "seq": ()},
                        {"data": 8, "fsdp": 1})
    assert spec == PartitionSpec("data", None)
