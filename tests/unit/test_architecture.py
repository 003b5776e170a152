"""The layers of ``jaxpar`` and the direction of their imports (docs/design.md, "Architecture").

A module's layer is its first package below ``jaxpar`` (``jaxpar/train/loop.py`` -> ``train``,
``jaxpar/config.py`` -> ``config``). The scan reads every ``import`` statement of the source,
including those inside functions (the CLI imports jax lazily), without importing anything; the
same scan shows that jaxpar never imports torch or transformers (the Hugging Face tests' reference).
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "jaxpar"

# Each layer and the layers it may import. Everything points down: cli -> {inspect, pictures,
# hf, evaluation} -> train -> checkpoint -> {model, parallel, data} -> config/mesh/distributed ->
# platform. `parallel` may use `model`'s layer code (the MoE dispatch runs the model's experts);
# nothing below `train` knows training exists. The cost model (`cost`, `hardware`, `units`)
# describes the layers without being imported by them: it imports no layer above `model` and
# `parallel`.
ALLOWED = {
    "cli": {"inspect", "pictures", "cost", "hardware", "hf", "train", "checkpoint", "evaluation",
            "inference", "model", "parallel", "data", "mesh", "distributed", "config", "units",
            "platform"},
    # What the compiler made (HLO, memory, TPU targets), compared with the cost model's plan.
    "inspect": {"cost", "hardware", "units", "train", "model", "parallel", "data", "mesh",
                "config"},
    "pictures": {"units"},
    "cost": {"hardware", "units", "model", "parallel", "config", "platform"},
    "hardware": {"config"},
    "units": set(),
    # Hugging Face checkpoints in and out: jaxpar's weights-only checkpoints on one side.
    "hf": {"checkpoint", "model", "parallel", "config"},
    # A checkpoint scored: `jaxpar eval` on a split (the train layer's eval step) and lm-eval's
    # model "jaxpar" (generation's scoring); the CLI runs the first, lm-eval the second.
    "evaluation": {"inference", "train", "checkpoint", "model", "data", "mesh", "config"},
    # Text generation runs the model with a KV cache on a mesh; the CLI loads its weights.
    "inference": {"model", "parallel", "config"},
    # The old names kept as aliases (jaxpar/lm_eval.py: python -m jaxpar.lm_eval; generate.py).
    "lm_eval": {"evaluation"},
    "generate": {"inference"},
    "train": {"checkpoint", "hardware", "model", "parallel", "data", "mesh", "distributed",
              "config", "platform"},
    "checkpoint": {"model", "parallel", "config"},
    "parallel": {"model", "config", "platform"},
    "model": {"config"},
    "data": {"config"},
    "mesh": {"config", "platform"},
    "distributed": {"config"},
    # Platform and compiler workarounds: the standard library only, so even config may ask.
    "config": {"platform"},
    "platform": set(),
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
              "def f():\n    from jaxpar.model.flop_formula import param_count\n"
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


def imported_modules(source: str) -> set[str]:
    """The ``jaxpar`` modules a source imports, dotted (``from jaxpar.cost import ledger`` names
    ``jaxpar.cost.ledger`` when that is a module, else ``jaxpar.cost``)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("jaxpar.")}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and \
                (node.module or "").startswith("jaxpar"):
            for alias in node.names:
                child = f"{node.module}.{alias.name}"
                found.add(child if _module_path(child) else node.module)
    return found


def _module_path(dotted: str) -> Path | None:
    rel = Path(*dotted.split(".")[1:])
    for path in (PACKAGE / rel.with_suffix(".py"), PACKAGE / rel / "__init__.py"):
        if path.is_file():
            return path
    return None


def module_graph() -> dict[str, set[str]]:
    """module -> the jaxpar modules it imports (packages' ``__init__`` count as modules)."""
    graph = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        graph[name] = {m for m in imported_modules(path.read_text()) if _module_path(m)}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of ``graph`` (the modules on it, the first repeated at the end), or []."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str]:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [node, nxt] if nxt in path else [node, nxt]
            if nxt not in state and (cycle := visit(nxt, path + [node])):
                return cycle
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state and (cycle := visit(node, [])):
            return cycle
    return []


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_itself_back():
    # Counting every import (inside functions and under TYPE_CHECKING too): two modules that
    # import each other are one module, or the thing they share belongs in a third.
    assert find_cycle(module_graph()) == []


def test_every_module_is_in_the_module_map():
    # docs/design.md holds the one module map; a module it does not name is one a reader of
    # the map cannot find.
    design = (PACKAGE.parent / "docs" / "design.md").read_text()
    named = set(re.findall(r"`(jaxpar/[\w/]+\.py)`", design))
    modules = {str(p.relative_to(PACKAGE.parent)) for p in PACKAGE.rglob("*.py")}
    assert sorted(modules - named) == [], "modules missing from docs/design.md's module map"
    assert sorted(named - modules) == [], "docs/design.md names modules that do not exist"


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
