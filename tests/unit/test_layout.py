"""The one layout object the model reads (jaxpar/model/annotate.py: Layout), and the model's ends
written once (jaxpar/model/edges.py)."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from jaxpar.config import load_config
from jaxpar.model import annotate
from jaxpar.model.edges import Edges
from jaxpar.parallel.hooks import model_layout

PACKAGE = Path(__file__).resolve().parents[2] / "jaxpar"


def _context_vars(path: Path) -> int:
    """How many ``ContextVar(...)`` calls a module makes."""
    return sum(1 for node in ast.walk(ast.parse(path.read_text()))
               if isinstance(node, ast.Call)
               and getattr(node.func, "attr", getattr(node.func, "id", None)) == "ContextVar")


def test_the_model_reads_exactly_one_context_variable_and_the_package_no_other():
    per_file = {str(p.relative_to(PACKAGE.parent)): _context_vars(p)
                for p in PACKAGE.rglob("*.py")}
    assert {k: n for k, n in per_file.items() if n} == {"jaxpar/model/annotate.py": 1}


def test_describe_shows_every_field_of_a_five_axis_layout():
    cfg = load_config("tiny", ["mesh.data=1", "mesh.fsdp=2", "mesh.tensor=2", "mesh.context=2",
                               "mesh.expert=2",
                               "model.moe.num_experts=4"])
    layout = model_layout(cfg, cfg.mesh_shape, "cpu")
    text = layout.describe()
    names = [f.name for f in dataclasses.fields(annotate.Layout)]
    assert [line.split(":")[0] for line in text.splitlines()] == names
    assert layout.attention is not None and layout.experts is not None
    assert layout.split_counts["heads"] == 2 and "'heads': 2" in text
    assert "weights_prepared: False" in text


def test_one_device_layout_is_the_default_and_changes_are_undone_after_the_block():
    assert annotate.current_layout() is annotate.ONE_DEVICE
    x = jnp.ones((2, 3))
    assert annotate.constrain(x, ("batch", "embed")) is x
    with annotate.layout_with(split_counts={"heads": 4}, weights_prepared=True) as inner:
        assert annotate.current_layout() is inner
        assert annotate.split_count("heads") == 4 and annotate.is_split("heads")
        assert inner.weights_prepared and inner.attention is None
    assert annotate.current_layout() is annotate.ONE_DEVICE
    assert annotate.split_count("heads") == 1


def test_the_pipeline_names_the_model_ends_only_through_model_functions():
    # The grep: the pipeline re-derives no feature of the model's ends.
    words = ("embed_scale", "final_softcap", "tied_embeddings", "tie_embeddings")
    found = [(str(p.relative_to(PACKAGE)), w) for p in (PACKAGE / "parallel").rglob("*.py")
             for w in words if w in p.read_text()]
    assert found == []


def test_edges_scale_tie_and_mask_as_the_plain_formulas():
    cfg = load_config("tiny", ["model.embed_scale=true", "model.tie_embeddings=true",
                               "model.final_softcap=3"]).model
    edges = Edges(cfg, cfg.vocab_size + 3)
    rows = jnp.ones((2, cfg.d_model), jnp.bfloat16)
    np.testing.assert_array_equal(edges.scaled(rows),
                                  rows * jnp.asarray(np.sqrt(cfg.d_model), jnp.bfloat16))
    assert edges.head_param == "embedding" and edges.masked_from == cfg.vocab_size
    table = jnp.arange(edges.vocab_rows * cfg.d_model, dtype=jnp.float32).reshape(
        edges.vocab_rows, cfg.d_model) / 1e4
    assert edges.head_table({"embedding": table}) is table
    name, grad, axis = edges.head_grad(table.T)
    assert (name, axis) == ("embedding", 0) and grad.shape == table.shape
    h = jnp.ones((1, 2, cfg.d_model))
    logits = edges.logits(h, table.T)
    expected = 3 * np.tanh(np.asarray(h @ table.T) / 3)
    np.testing.assert_allclose(logits[..., :cfg.vocab_size], expected[..., :cfg.vocab_size],
                               rtol=1e-6)
    assert np.all(np.isneginf(logits[..., cfg.vocab_size:]))
    untied = Edges(load_config("tiny").model, cfg.vocab_size)
    assert untied.head_param == "lm_head" and untied.masked_from is None
    assert untied.head_grad(table.T)[::2] == ("lm_head", 1)
