"""DeepSeek-V3 (``deepseek_v3``) <-> jaxpar's :class:`~jaxpar.config.ModelConfig`.

Latent attention, group-limited sigmoid routing, dense first blocks, YaRN RoPE and float8 block
scales: docs/hugging-face.md, "DeepSeek-V3".
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from jaxpar.config import MLAConfig, ModelConfig, MoEConfig
from jaxpar.hf.common import refuse, required, rope_from_hf


def check_fp8_blocks(hf: Mapping[str, Any]) -> None:
    """Accept only DeepSeek's float8 e4m3 with a float32 ``weight_scale_inv`` per block.

    Dequantized on import (:mod:`jaxpar.hf.importer`).
    """
    q = hf.get("quantization_config")
    if not q:
        return
    refuse(q.get("quant_method") != "fp8" or q.get("fmt", "e4m3") != "e4m3",
           "quantization_config", f"{q.get('quant_method')!r} {q.get('fmt')!r}: only fp8 "
           "e4m3 block-scaled weights are read")
    block = q.get("weight_block_size")
    refuse(not (isinstance(block, list) and len(block) == 2 and all(
        isinstance(b, int) and b > 0 for b in block)), "quantization_config.weight_block_size",
           f"{block}: expected two positive ints")


def deepseek_model_config(hf: Mapping[str, Any]) -> ModelConfig:
    """The jaxpar model of DeepSeek-V3; multi-token-prediction layers are not read."""
    for key, allowed in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"),
                         ("moe_layer_freq", 1)):
        refuse(hf.get(key, allowed) != allowed, key, f"{hf.get(key)!r}: only {allowed!r} "
               "is supported")
    theta, scaling = rope_from_hf(hf, "deepseek_v3")
    rope_dims = int(required(hf, "qk_rope_head_dim"))
    refuse(int(hf.get("head_dim") or rope_dims) != rope_dims, "head_dim", f"{hf.get('head_dim')}"
           f": deepseek_v3's rotary embedding needs qk_rope_head_dim={rope_dims}")
    d_model, heads = int(required(hf, "hidden_size")), int(required(hf, "num_attention_heads"))
    mla = MLAConfig(q_lora_rank=int(hf.get("q_lora_rank") or 0),
                    kv_lora_rank=int(required(hf, "kv_lora_rank")),
                    qk_nope_head_dim=int(required(hf, "qk_nope_head_dim")),
                    qk_rope_head_dim=int(required(hf, "qk_rope_head_dim")),
                    v_head_dim=int(required(hf, "v_head_dim")),
                    rope_interleave=bool(hf.get("rope_interleave", True)))
    moe = MoEConfig(
        num_experts=int(required(hf, "n_routed_experts")),
        top_k=int(required(hf, "num_experts_per_tok")),
        d_ff_expert=int(required(hf, "moe_intermediate_size")),
        num_shared_experts=int(hf.get("n_shared_experts") or 0), router="sigmoid_bias",
        dispatch="dropless", norm_topk=bool(hf.get("norm_topk_prob", True)),
        n_group=int(hf.get("n_group") or 1), topk_group=int(hf.get("topk_group") or 1),
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
        first_dense=int(hf.get("first_k_dense_replace") or 0), aux_loss_weight=0.0,
        z_loss_weight=0.0)
    return ModelConfig(
        d_model=d_model, n_layers=int(required(hf, "num_hidden_layers")), n_heads=heads,
        n_kv_heads=heads, head_dim=mla.qk_head_dim, d_ff=int(required(hf, "intermediate_size")),
        vocab_size=int(required(hf, "vocab_size")), rope_theta=theta, rope_scaling=scaling,
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), moe=moe, mla=mla)


def check_deepseek_export(m: ModelConfig, refuse_export: Callable[[bool, str, str], None]
                          ) -> None:
    """What DeepSeek-V3's Hugging Face model fixes; ``refuse_export`` raises otherwise.

    A sigmoid_bias router (normalised or not), shared experts, every block after the dense ones a
    mixture.
    """
    moe = m.moe
    checks = (("num_experts", moe.enabled), ("router", moe.router == "sigmoid_bias"),
              ("every", moe.every == 1), ("num_shared_experts", moe.num_shared_experts >= 1))
    for name, ok in checks:
        refuse_export(not ok, f"model.moe.{name}={getattr(moe, name)}", "deepseek_v3 (the "
                      "exported model with model.mla) has a mixture with router=sigmoid_bias, "
                      "every=1 and shared experts")
    refuse_export(m.qkv_bias or m.qk_norm, "model.qkv_bias/qk_norm", "deepseek_v3 has neither")


def deepseek_fields(m: ModelConfig) -> dict[str, Any]:
    """The ``config.json`` fields of ``deepseek_v3`` beyond the Llama family's."""
    mla, moe = m.mla, m.moe
    return dict(
        q_lora_rank=mla.q_lora_rank or None, kv_lora_rank=mla.kv_lora_rank,
        qk_nope_head_dim=mla.qk_nope_head_dim, qk_rope_head_dim=mla.qk_rope_head_dim,
        v_head_dim=mla.v_head_dim, head_dim=mla.qk_rope_head_dim,
        rope_interleave=mla.rope_interleave, n_routed_experts=moe.num_experts,
        num_experts_per_tok=moe.top_k, moe_intermediate_size=m.resolved_d_ff_expert,
        n_shared_experts=moe.num_shared_experts, n_group=moe.n_group,
        topk_group=moe.topk_group, norm_topk_prob=moe.normalise_gates,
        routed_scaling_factor=moe.routed_scaling_factor,
        first_k_dense_replace=moe.first_dense, num_nextn_predict_layers=0,
        num_key_value_heads=m.n_heads, attention_bias=False)
