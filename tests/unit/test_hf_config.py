"""Hugging Face configs without transformers: the config dialects of transformers 4.x and 5.x,
the fields ``import-hf`` refuses, the models ``export --format hf`` refuses, ``train.init_from``
against a named checkpoint, and export's shard sizes. Imports and exports checked against
transformers: ``tests/integration/test_hf.py``, ``tests/integration/test_hf_export.py``."""

from __future__ import annotations

import dataclasses

import pytest
from hf_models import LLAMA3
from hf_models import llama_config_5x as _llama_config_5x

from jaxpar.config import RopeScalingConfig
from jaxpar.hf.config import HFConfigError, model_config_from_hf
from jaxpar.hf.exporter import parse_size, shard_plan

# --------------------------------------------------------------------------------------------
# Config dialects


def test_4x_and_5x_config_dialects_give_the_same_model(tmp_path):
    """transformers 5 writes rope_parameters (the old keys gone or null); 4.x wrote rope_theta
    and rope_scaling (with ``type`` in older files)."""
    new = _llama_config_5x()
    new_with_nulls = dict(new, rope_theta=None, rope_scaling=None)
    old = {k: v for k, v in new.items() if k != "rope_parameters"}
    old.update(rope_theta=500000.0, rope_scaling=dict(LLAMA3))
    older = dict(old, rope_scaling={("type" if k == "rope_type" else k): v
                                    for k, v in LLAMA3.items()})
    models = [model_config_from_hf(c) for c in (new, new_with_nulls, old, older)]
    assert all(m == models[0] for m in models)
    assert models[0].rope_theta == 500000.0 and models[0].rope_scaling.type == "llama3"
    # Reading one dialect only would fall back to the default RoPE: make sure it differs.
    assert model_config_from_hf({**new, "rope_parameters": None}) != models[0]


@pytest.mark.parametrize(("change", "field"), [
    ({"model_type": "gpt2"}, "model_type"),
    ({"model_type": "qwen2_moe"}, "shared_expert_intermediate_size"),
    ({"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2,
      "moe_intermediate_size": 32, "decoder_sparse_step": 2}, "decoder_sparse_step"),
    ({"model_type": "mistral", "sliding_window": 0}, "sliding_window"),
    ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 64,
      "max_window_layers": 1}, "max_window_layers"),
    ({"attention_bias": True}, "attention_bias"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_parameters": {"rope_theta": 1e4, "rope_type": "yarn", "factor": 4.0}},
     "rope_parameters.rope_type"),
    ({"rope_parameters": None, "rope_scaling": {"type": "dynamic", "factor": 2.0}},
     "rope_scaling.rope_type"),
    ({"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
])
def test_unsupported_fields_are_named(change, field):
    with pytest.raises(HFConfigError, match=field.replace(".", r"\.")):
        model_config_from_hf({**_llama_config_5x(), **change})


GEMMA3_5X = {"model_type": "gemma3_text", "vocab_size": 256, "hidden_size": 64,
             "intermediate_size": 96, "num_hidden_layers": 6, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 16, "query_pre_attn_scalar": 24,
             "sliding_window": 32, "hidden_activation": "gelu_pytorch_tanh",
             "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
             "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                    "rope_theta": 1e6},
                                 "sliding_attention": {"rope_type": "default",
                                                       "rope_theta": 1e4}}}


def test_gemma3_reads_the_same_from_both_rope_dialects_and_its_pattern_as_global_every():
    old = {**GEMMA3_5X, "rope_parameters": None, "layer_types": None, "rope_theta": 1e6,
           "rope_local_base_freq": 1e4, "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    new = model_config_from_hf(GEMMA3_5X)
    assert model_config_from_hf(old) == new  # 4.x: the pattern from sliding_window_pattern 6
    assert (new.sliding_window, new.global_every, new.rope_local_theta) == (32, 6, 1e4)
    assert new.rope_scaling.type == "linear" and new.rope_theta == 1e6
    multimodal = {"model_type": "gemma3", "text_config": GEMMA3_5X}
    assert model_config_from_hf(multimodal) == new


@pytest.mark.parametrize(("change", "field"), [
    ({"hidden_activation": "gelu"}, "hidden_activation"),
    ({"layer_types": ["full_attention"] + ["sliding_attention"] * 5}, "not periodic"),
    ({"layer_types": ["sliding_attention"] * 5}, "layer_types"),
    ({"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
     "sliding_attention.rope_type"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
])
def test_gemma_fields_jaxpar_cannot_compute_are_named(change, field):
    with pytest.raises(HFConfigError, match=field.replace(".", r"\.")):
        model_config_from_hf({**GEMMA3_5X, **change})


def test_gemma_export_picks_the_type_and_refuses_what_no_type_computes():
    from jaxpar.hf.config import hf_config_from_model

    m = model_config_from_hf(GEMMA3_5X)
    assert hf_config_from_model(m)["model_type"] == "gemma3_text"
    written = hf_config_from_model(m)
    assert model_config_from_hf(written) == m
    no_qk = dataclasses.replace(m, qk_norm=False)
    for bad, field in ((dataclasses.replace(m, embed_scale=False), "model.embed_scale"),
                       (dataclasses.replace(m, query_scale=24.5), "model.query_scale"),
                       (no_qk, "model.rope_scaling"),
                       (dataclasses.replace(m, post_norms=False), "model.mlp_activation"),
                       (dataclasses.replace(m, post_norms=False, mlp_activation="silu"),
                        "model.embed_scale")):
        with pytest.raises(HFConfigError, match=field):
            hf_config_from_model(bad)
    gemma2 = dataclasses.replace(no_qk, rope_scaling=RopeScalingConfig(), rope_local_theta=None)
    assert hf_config_from_model(gemma2)["model_type"] == "gemma2"
    assert model_config_from_hf(hf_config_from_model(gemma2)) == gemma2


# --------------------------------------------------------------------------------------------
# Export and init_from


@pytest.mark.parametrize(("change", "window"), [
    ({"model_type": "mistral", "sliding_window": 4096}, 4096),
    ({"model_type": "mistral", "sliding_window": None}, None),
    ({"model_type": "qwen2", "use_sliding_window": False, "sliding_window": 64}, None),
    ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 64,
      "max_window_layers": 0}, 64),
    ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 64,
      "max_window_layers": 2}, None),  # every layer one of the "first" global ones
    ({"layer_types": ["sliding_attention"] * 2, "sliding_window": 32}, 32),
])
def test_sliding_windows_read_as_one_window_for_every_layer(change, window):
    assert model_config_from_hf({**_llama_config_5x(), **change}).sliding_window == window


def test_init_from_and_a_named_checkpoint_to_resume_contradict():
    from jaxpar.config import ConfigError, load_config, validate

    for resume in ("auto", "never"):
        validate(load_config("tiny", ["train.init_from=x", f"train.resume={resume}"]), 8)
    with pytest.raises(ConfigError, match="train.init_from=x and train.resume=3"):
        validate(load_config("tiny", ["train.init_from=x", "train.resume=3"]), 8)


def test_export_refuses_a_model_transformers_has_no_class_for():
    from jaxpar.config import ModelConfig, MoEConfig
    from jaxpar.hf.config import HFConfigError, hf_config_from_model

    for moe, field in ((MoEConfig(num_experts=4), "model.moe.norm_topk=False"),
                       (MoEConfig(num_experts=4, norm_topk=True, every=2), "model.moe.every=2"),
                       (MoEConfig(num_experts=4, norm_topk=True, router="sigmoid_bias"),
                        "model.moe.router=sigmoid_bias")):
        with pytest.raises(HFConfigError, match=field):
            hf_config_from_model(ModelConfig(n_layers=2, moe=moe))
    with pytest.raises(HFConfigError, match="model.qkv_bias"):
        hf_config_from_model(ModelConfig(qkv_bias=True, qk_norm=True, moe=MoEConfig(num_experts=4)))
    with pytest.raises(HFConfigError, match="qkv_bias and model.qk_norm"):
        hf_config_from_model(ModelConfig(qkv_bias=True, qk_norm=True))


def test_shard_sizes():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2MiB") == 2 * 2**20
    assert parse_size("1000") == 1000
    assert shard_plan([40, 40, 40, 100, 10], 100) == [0, 0, 1, 2, 3]
    with pytest.raises(ValueError, match="max-shard-size"):
        parse_size("lots")
