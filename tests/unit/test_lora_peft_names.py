"""PEFT's adapter tensors (``jaxpar export --adapters-only``, jaxpar/hf/peft.py) of a
latent-attention model's LoRA run: Hugging Face DeepSeek's module names, and ``W_hf + (alpha /
r) lora_B lora_A`` is the Hugging Face array of the merged weight (shapes only, no compile)."""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from jaxpar.config import load_config, validate
from jaxpar.hf.config import hf_config_from_model
from jaxpar.hf.names import hf_tensors, param_at, to_hf
from jaxpar.hf.peft import PEFT_PREFIX, adapter_tensors
from jaxpar.model.lora import merged_weights
from jaxpar.model.transformer import abstract_model

MLA = ("model.mla.q_lora_rank=24", "model.mla.kv_lora_rank=16", "model.mla.qk_nope_head_dim=8",
       "model.mla.qk_rope_head_dim=8", "model.mla.v_head_dim=12")
# What the deepseek_v3 export takes (jaxpar/hf/deepseek.py): a mixture in every block with
# sigmoid_bias routing and a shared expert.
DEEPSEEK = ("model.moe.router=sigmoid_bias", "model.moe.num_shared_experts=1")


def test_mla_adapters_export_under_deepseeks_module_names_and_merge_as_peft_applies_them():
    cfg = validate(load_config("moe-tiny", ["train.lora.rank=4", "train.lora.alpha=8", *MLA,
                                            *DEEPSEEK, "train.lora.targets=[q_a,q_b,kv_a,kv_b,o]"]),
                   1)
    hf_config_from_model(cfg.model)  # the exporter takes this model
    lora = cfg.train.lora
    rng = np.random.default_rng(0)
    shapes = nnx.to_pure_dict(nnx.state(abstract_model(cfg.model, lora), nnx.Param))
    params = jax.tree.map(lambda a: rng.standard_normal(a.shape).astype(np.float32), shapes)
    tensors = adapter_tensors(cfg, params)
    modules = {name.split(".")[-3] for name in tensors}
    assert modules == {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"}
    merged = merged_weights(params, lora)
    checked = 0
    for t in hf_tensors(cfg.model):
        module = PEFT_PREFIX + t.hf.removesuffix(".weight")
        if f"{module}.lora_A.weight" not in tensors:
            continue
        a, b = tensors[f"{module}.lora_A.weight"], tensors[f"{module}.lora_B.weight"]
        base = to_hf(t.layout, param_at(params, t.path)[t.index])
        want = to_hf(t.layout, param_at(merged, t.path)[t.index])
        assert a.shape == (lora.rank, base.shape[1]) and b.shape == (base.shape[0], lora.rank)
        np.testing.assert_allclose(base + lora.alpha / lora.rank * b @ a, want, rtol=1e-5,
                                   atol=1e-5)
        checked += 1
    assert checked == 5 * cfg.model.n_layers
