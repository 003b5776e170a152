"""Gemma 2 and Gemma 3 through ``jaxpar import-hf`` and ``jaxpar export --format hf``: the
logits of transformers' own models (gemma2, gemma3_text, and the multimodal gemma3's language
model), on one device and under tensor, data and FSDP parallelism; the export loads back into
transformers with the same logits; what jaxpar cannot represent is one line, exit 2.

The tiny models' local layers see the whole test sequence with the global layers' RoPE base
and their scores are not soft-capped (``tests/hf_models.py``)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import assert_one_line_error, cached_jax_env, run_jaxpar
from hf_models import (
    greedy_both_ways,
    hf_logits,
    import_logits_error,
    imports_with_logits,
    losses_both_ways,
    tokens,
)

from jaxpar.checkpoint.weights_only import read_weights
from jaxpar.config import RopeScalingConfig
from jaxpar.hf.exporter import export_hf
from jaxpar.hf.importer import import_hf

pytest.importorskip("transformers")

TOLERANCE = 1e-4  # max abs logit difference, float32
KINDS = ("gemma2", "gemma3_text", "gemma3")


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """kind -> (Hugging Face directory, jaxpar import of it, transformers' logits)."""
    return imports_with_logits(tmp_path_factory.mktemp("gemma"), KINDS)


@pytest.mark.parametrize(("kind", "overrides", "devices"), [
    ("gemma2", [], 1),
    ("gemma2", ["mesh.tensor=2"], 4),
    ("gemma2", ["mesh.tensor=2", "parallel.sequence_parallel=true"], 4),
    ("gemma3_text", [], 1),
    ("gemma3_text", ["mesh.fsdp=2", "mesh.tensor=2"], 4),
    ("gemma3", [], 1),
    ("gemma3", ["mesh.tensor=2", "train.loss_pieces=2"], 4),
    ("gemma3", ["mesh.context=2"], 4),
])
def test_imported_gemma_logits_match_transformers(imported, kind, overrides, devices):
    diff = import_logits_error(imported[kind], overrides, devices)
    assert diff <= TOLERANCE, (kind, overrides, diff)


@pytest.mark.parametrize("overrides", [["mesh.tensor=2", "train.loss_pieces=4"],
                                       ["mesh.pipe=2", "train.microbatches=2",
                                        "train.loss_pieces=2"]])
def test_training_loss_of_a_soft_capped_gemma_is_transformers(imported, overrides):
    """The train step's loss, the head run over pieces of the sequence (train.loss_pieces)
    under tensor=2 data=2, and in the pipeline executor (pipe=2 data=2: its own embedding,
    scaled, and its vocabulary pieces, capped), is the cross-entropy of transformers'
    soft-capped logits."""
    loss, expected = losses_both_ways(imported["gemma2"], overrides, 4)
    assert abs(loss - expected) <= 1e-5 * expected, (loss, expected)


@pytest.mark.parametrize("kind", ["gemma2", "gemma3"])
def test_generation_from_a_gemma_import_is_transformers_greedy_decoding(imported, kind):
    """``jaxpar generate``'s KV-cached decoding (scaled queries, post-norms, scaled embeddings,
    soft-capped logits) gives transformers' greedy tokens."""
    source, done, _ = imported[kind]
    expected, got = greedy_both_ways(source, done.checkpoint, done.model)
    assert got == expected


def test_import_maps_the_gemma_configs(imported):
    gemma2, gemma3_text, gemma3 = (imported[k][1] for k in KINDS)
    m = gemma2.model
    assert (m.post_norms, m.embed_scale, m.mlp_activation, m.qk_norm) == (
        True, True, "gelu_tanh", False)
    assert (m.final_softcap, m.query_scale, m.sliding_window, m.global_every, m.attn_softcap
            ) == (30.0, 24.0, 64, 2, 2.0)
    m = gemma3_text.model
    assert m.qk_norm and (m.sliding_window, m.global_every, m.final_softcap) == (64, 2, 0.0)
    assert m.rope_theta == 1e5 and m.rope_scaling == RopeScalingConfig(type="linear", factor=8.0)
    assert m.rope_local_theta == 1e4
    m = gemma3.model
    assert (m.sliding_window, m.global_every, m.query_scale) == (64, 2, 32.0)
    assert (m.rope_theta, m.rope_local_theta) == (1e6, 1e4)
    assert gemma3.left_out > 0 and gemma2.left_out == 0  # the vision tower and projector


@pytest.mark.parametrize("kind", KINDS)
def test_gemma_export_loads_in_transformers_with_the_same_logits(imported, tmp_path, kind):
    """gemma2 exports as gemma2, both Gemma 3 as gemma3_text; a re-import is bit-exact
    (the norms' 1 + weight survives the subtraction and the addition)."""
    source, done, _ = imported[kind]
    export_hf(done.checkpoint, tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == ("gemma2" if kind == "gemma2" else "gemma3_text")
    ids = tokens(rows=2)
    np.testing.assert_allclose(hf_logits(tmp_path / "hf", ids), hf_logits(source, ids),
                               atol=TOLERANCE, rtol=0)
    again = import_hf(tmp_path / "hf", tmp_path / "again")
    assert again.model == done.model
    import jax

    jax.tree.map(np.testing.assert_array_equal, read_weights(again.checkpoint)[0],
                 read_weights(done.checkpoint)[0])


def test_import_hf_gemma_cli_notice_and_errors(imported, tmp_path_factory):
    source = imported["gemma3"][0]
    env = cached_jax_env(tmp_path_factory.mktemp("jax-cache"))
    out = tmp_path_factory.mktemp("cli")
    result = run_jaxpar("import-hf", str(source), "--to", str(out / "ok"), env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "left out" in result.stdout and "vision tower" in result.stdout
    config = json.loads((source / "config.json").read_text())
    text = config["text_config"]
    bad = [({**text, "hidden_activation": "relu"}, ("hidden_activation", "relu")),
           ({**text, "num_hidden_layers": 3, "layer_types": [
               "sliding_attention", "full_attention", "full_attention"]},
            ("layer_types", "not periodic"))]
    try:
        for i, (changed, needles) in enumerate(bad):
            (source / "config.json").write_text(json.dumps({**config, "text_config": changed}))
            assert_one_line_error(run_jaxpar("import-hf", str(source), "--to",
                                             str(out / f"bad{i}"), env=env), *needles, code=2)
    finally:
        (source / "config.json").write_text(json.dumps(config))
