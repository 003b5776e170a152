"""The layers of ``jaxpar`` and the direction of their imports (docs/design.md, "Architecture").

A module's layer is its first package below ``jaxpar`` (``jaxpar/train/loop.py`` -> ``train``,
``jaxpar/config.py`` -> ``config``). The scan reads every ``import`` statement of the source,
including those inside functions (the CLI imports jax lazily), without importing anything; the
same scan shows that jaxpar never imports torch or transformers (the Hugging Face tests' reference).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "jaxpar"

# Each layer and the layers it may import. Everything points down: cli -> {inspect, pictures,
# hf} -> train -> checkpoint -> {model, parallel, data} -> config/mesh/distributed. `parallel`
# may use `model`'s layer code (the MoE dispatch runs the model's experts); nothing below
# `train` knows training exists. The cost model (`cost`, `hardware`, `units`) describes the
# layers without being imported by them: it imports no layer above `model` and `parallel`.
ALLOWED = {
    "cli": {"inspect", "pictures", "cost", "hardware", "hf", "train", "checkpoint", "generate",
            "model", "parallel", "data", "mesh", "distributed", "config", "units"},
    # What the compiler made (HLO, memory, TPU targets), compared with the cost model's plan.
    "inspect": {"cost", "hardware", "units", "train", "model", "parallel", "data", "mesh",
                "config"},
    "pictures": {"units"},
    "cost": {"hardware", "units", "model", "parallel", "config"},
    "hardware": {"config"},
    "units": set(),
    # Hugging Face checkpoints in and out: jaxpar's weights-only checkpoints on one side.
    "hf": {"checkpoint", "model", "parallel", "config"},
    # Text generation runs the model with a KV cache on a mesh; the CLI loads its weights.
    "generate": {"model", "parallel", "config"},
    "train": {"checkpoint", "hardware", "model", "parallel", "data", "mesh", "distributed",
              "config"},
    "checkpoint": {"model", "parallel", "config"},
    "parallel": {"model", "config"},
    "model": {"config"},
    "data": {"config"},
    "mesh": {"config"},
    "distributed": {"config"},
    "config": set(),
    "__init__": set(),
}


def imported_layers(source: str) -> set[str]:
    """The ``jaxpar`` layers a module's source imports (``from jaxpar.x.y import z`` -> x)."""
    layers = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module or ""]
        else:
            continue
        layers |= {n.split(".")[1] for n in names if n.startswith("jaxpar.")}
    return layers


def layer_imports() -> dict[str, dict[str, set[str]]]:
    """layer -> {module path: the other layers it imports}."""
    out: dict[str, dict[str, set[str]]] = defaultdict(dict)
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        layer = rel.parts[0].removesuffix(".py")
        out[layer][str(rel)] = imported_layers(path.read_text()) - {layer}
    return out


def test_the_scan_sees_plain_from_and_function_level_imports():
    source = ("import jaxpar.train.step\nfrom jaxpar.inspect import report\n"
              "def f():\n    from jaxpar.model.flops import param_count\n"
              "from . import sibling\nimport numpy\n")
    assert imported_layers(source) == {"train", "inspect", "model"}


def test_every_layer_is_known():
    assert set(layer_imports()) <= set(ALLOWED)


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_layer_imports_only_layers_below_it(layer):
    wrong = {module: sorted(layers - ALLOWED[layer])
             for module, layers in layer_imports().get(layer, {}).items()
             if layers - ALLOWED[layer]}
    assert not wrong, f"{layer} imports layers above it: {wrong}"


def test_no_cycle_between_layers():
    edges = {layer: set().union(*modules.values()) for layer, modules in layer_imports().items()}
    cycles = sorted((a, b) for a in edges for b in edges[a] if a < b and a in edges.get(b, ()))
    assert not cycles


# --------------------------------------------------------------------------------------------
# Hugging Face's libraries (tests/integration/test_hf*.py)


def test_jaxpar_never_imports_torch_or_transformers():
    """They are the tests' reference, not a dependency: conversion reads safetensors itself."""
    import ast
    from pathlib import Path

    package = Path(__file__).resolve().parents[2] / "jaxpar"
    found = []
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{path.name}: {n}" for n in names
                      if n.split(".")[0] in ("torch", "transformers")]
    assert not found, found
