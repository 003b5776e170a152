"""Hugging Face models: ``jaxpar import-hf`` against transformers' own forward pass, on one
device and under tensor, data and expert parallelism (``train.init_from``), and a config written
by this transformers. The config dialects of transformers 4.x and 5.x (read without transformers):
``tests/unit/test_hf_config.py``."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from helpers import assert_one_line_error, cached_jax_env, run_jaxpar
from hf_models import (
    LLAMA3,
    build_hf_model,
    greedy_both_ways,
    hf_logits,
    import_logits_error,
    imports_with_logits,
    jaxpar_logits,
    losses_both_ways,
    save_hf_model,
    tokens,
    trainer_from_import,
)
from hf_models import llama_config_5x as _llama_config_5x

from jaxpar.config import RopeScalingConfig
from jaxpar.hf.config import model_config_from_hf
from jaxpar.hf.importer import import_hf

pytest.importorskip("transformers")

TOLERANCE = 1e-4  # max abs logit difference, float32


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """kind -> (Hugging Face directory, jaxpar import of it, transformers' logits); llama in
    two shards with an index, as large models come."""
    return imports_with_logits(tmp_path_factory.mktemp("hf"), ("llama", "qwen2", "qwen3",
                               "mistral", "mistral_window", "mixtral", "qwen3_moe"),
                               {"llama": {"max_shard_size": "150KB"}})


def test_qwen2_with_every_layer_sliding_gives_transformers_logits(tmp_path):
    """use_sliding_window with max_window_layers=0: every layer within 64 of the 512 tokens."""
    source = tmp_path / "qwen2"
    build_hf_model("qwen2", use_sliding_window=True, sliding_window=64,
                   max_window_layers=0).save_pretrained(source)
    done = import_hf(source, tmp_path / "jaxpar")
    assert done.model.sliding_window == 64 and done.model.global_every == 0
    trainer, state = trainer_from_import(done.config_yaml, [], 1)
    ids = tokens(rows=2)
    assert np.abs(jaxpar_logits(trainer, state, ids) - hf_logits(source, ids)).max() <= TOLERANCE


def test_sharded_source_was_read_from_its_index(imported):
    source = imported["llama"][0]
    index = json.loads((source / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 2


@pytest.mark.parametrize(("kind", "overrides", "devices"), [
    ("llama", [], 1),
    ("llama", ["mesh.tensor=2"], 4),
    ("qwen2", [], 1),
    ("qwen2", ["mesh.tensor=2"], 4),
    ("qwen3", [], 1),
    ("mistral", [], 1),
    ("mistral_window", [], 1),
    ("mistral_window", ["mesh.tensor=2"], 4),
    ("mixtral", [], 1),
    ("mixtral", ["mesh.tensor=2"], 4),
    ("mixtral", ["mesh.expert=2"], 4),
    ("qwen3_moe", [], 1),
    ("qwen3_moe", ["mesh.expert=2"], 4),
])
def test_imported_logits_match_transformers(imported, kind, overrides, devices):
    diff = import_logits_error(imported[kind], overrides, devices)
    assert diff <= TOLERANCE, (kind, overrides, diff)


@pytest.mark.parametrize("kind", ["llama", pytest.param("mixtral", marks=pytest.mark.slow)])
def test_training_loss_of_an_import_under_a_pipeline_is_transformers(imported, kind):
    """The train step's loss (pipeline executor over pipe=2, data=2) of the imported weights is
    the cross-entropy of transformers' logits."""
    loss, expected = losses_both_ways(imported[kind], ["mesh.pipe=2", "train.microbatches=2"], 4)
    assert abs(loss - expected) <= 1e-5 * expected, (loss, expected)


def test_init_from_converts_to_the_stored_dtype_and_refuses_another_model(imported):
    import jax.numpy as jnp

    from jaxpar.checkpoint.state import CheckpointError
    from jaxpar.checkpoint.weights_only import read_weights

    done = imported["llama"][1]
    _, state = trainer_from_import(done.config_yaml, ["train.param_dtype=bfloat16"], 1)
    wq = state.params["layers"]["attn"]["wq"]
    assert wq.dtype == jnp.bfloat16
    expected = read_weights(done.checkpoint)[0]["layers"]["attn"]["wq"]
    np.testing.assert_array_equal(np.asarray(wq), expected.astype(jnp.bfloat16))
    with pytest.raises(CheckpointError, match="does not fit this model: params/layers/mlp"):
        trainer_from_import(done.config_yaml, ["model.d_ff=128"], 1)


def test_import_maps_the_config(imported):
    llama, qwen2, qwen3, mixtral = (imported[k][1].model for k in
                                    ("llama", "qwen2", "qwen3", "mixtral"))
    assert llama.rope_scaling == RopeScalingConfig(type="llama3", factor=8.0,
                                                   original_max_position_embeddings=64)
    assert (llama.n_heads, llama.n_kv_heads, llama.head_dim) == (4, 2, 16)
    assert qwen2.qkv_bias and qwen2.tie_embeddings and qwen2.rope_theta == 1e5
    assert qwen3.qk_norm and qwen3.head_dim == 32
    assert mixtral.moe.num_experts == 4 and mixtral.moe.norm_topk
    assert mixtral.rope_theta == 1e6  # Mixtral's default theta
    qwen3_moe = imported["qwen3_moe"][1].model
    assert qwen3_moe.qk_norm and not qwen3_moe.moe.norm_topk
    assert qwen3_moe.resolved_d_ff_expert == 48 and qwen3_moe.moe.num_experts == 4
    assert imported["mistral_window"][1].model.sliding_window == 64
    assert imported["mistral"][1].model.sliding_window is None


def test_import_copies_the_tokenizer_and_writes_a_config_to_train_from(tmp_path):
    from tokenizers import Tokenizer, models

    source = save_hf_model("llama", tmp_path / "src")
    vocab = {chr(ord("a") + i): i for i in range(26)} | {"[UNK]": 26}
    Tokenizer(models.WordLevel(vocab, unk_token="[UNK]")).save(str(source / "tokenizer.json"))
    (source / "tokenizer_config.json").write_text("{}")
    done = import_hf(source, tmp_path / "out")
    assert (tmp_path / "out" / "tokenizer_config.json").is_file()
    assert done.tokenizer == (tmp_path / "out" / "tokenizer.json").absolute()
    from jaxpar.config import load_config

    cfg = load_config(str(done.config_yaml))
    assert cfg.data.tokenizer == str(done.tokenizer)
    assert cfg.train.init_from == str((tmp_path / "out").absolute())
    assert cfg.model == done.model


def test_bfloat16_weights_import_exactly_as_float32(tmp_path):
    """Released checkpoints are mostly bfloat16: each value becomes its exact float32."""
    import torch
    from hf_models import build_hf_model

    from jaxpar.checkpoint.weights_only import read_weights

    model = build_hf_model("qwen2").to(torch.bfloat16)
    model.save_pretrained(tmp_path / "src")
    params = read_weights(import_hf(tmp_path / "src", tmp_path / "out").checkpoint)[0]
    wq = model.model.layers[1].self_attn.q_proj.weight.detach().float().numpy()  # [H*D, E]
    got = params["layers"]["attn"]["wq"][1]  # [E, H, D]
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got.reshape(got.shape[0], -1).T, wq)
    bias = model.model.layers[0].self_attn.k_proj.bias.detach().float().numpy()
    np.testing.assert_array_equal(params["layers"]["attn"]["k_bias"][0].reshape(-1), bias)


# --------------------------------------------------------------------------------------------
# Config dialects


def test_config_written_by_this_transformers_reads_as_the_hand_written_one(tmp_path):
    import transformers as tr

    cfg = tr.LlamaConfig(**{k: v for k, v in _llama_config_5x().items()
                            if k not in ("model_type", "rope_parameters")},
                         rope_theta=500000.0, rope_scaling=dict(LLAMA3))
    cfg.save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert model_config_from_hf(written) == model_config_from_hf(_llama_config_5x())


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_generation_from_an_import_is_transformers_greedy_decoding(imported, kind):
    """``jaxpar generate``'s KV-cached decoding runs the imported weights as transformers does
    (llama3 RoPE scaling, biases, tied embeddings included)."""
    source, done, _ = imported[kind]
    expected, got = greedy_both_ways(source, done.checkpoint, done.model)
    assert got == expected


def test_a_checkpoint_whose_tensors_do_not_match_its_config_is_one_line(imported, tmp_path):
    """A tensor of another shape than config.json makes, a missing one and an unknown one: exit
    2, one line naming the tensor, nothing written."""
    source = shutil.copytree(imported["llama"][0], tmp_path / "llama")
    config = json.loads((source / "config.json").read_text())
    env = cached_jax_env(tmp_path / "jax-cache")
    bad = [({"intermediate_size": 80}, ("gate_proj.weight is [96, 64]", "makes it [80, 64]")),
           ({"num_hidden_layers": 3}, ("model.layers.2.", "missing")),
           ({"num_hidden_layers": 1}, ("model.layers.1.", "has no such weight"))]
    for i, (change, needles) in enumerate(bad):
        (source / "config.json").write_text(json.dumps({**config, **change}))
        out = tmp_path / f"bad{i}"
        assert_one_line_error(run_jaxpar("import-hf", str(source), "--to", str(out), env=env),
                              *needles, code=2)
        assert not (out / "checkpoints").exists()
