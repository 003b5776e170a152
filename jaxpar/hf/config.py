"""Hugging Face ``config.json`` <-> jaxpar's :class:`~jaxpar.config.ModelConfig`.

Read: the Llama family, ``mixtral`` and ``qwen3_moe``, DeepSeek-V3 (:mod:`jaxpar.hf.deepseek`),
Gemma 2 and 3 (:mod:`jaxpar.hf.gemma`). Which of each is read: docs/hugging-face.md, "Import".
Anything jaxpar would compute differently is a one-line :class:`HFConfigError` naming the field,
never silently dropped. The RoPE settings are read in both transformers dialects (4.x's top-level
keys, 5.x's ``rope_parameters``) and written in both.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from jaxpar.config import ModelConfig, MoEConfig
from jaxpar.hf import deepseek
from jaxpar.hf.common import LLAMA3_KEYS, HFConfigError, rope_from_hf
from jaxpar.hf.common import refuse as _refuse
from jaxpar.hf.common import required as _get
from jaxpar.hf.gemma import (
    GEMMA_TYPES,
    gemma_hf_config,
    gemma_model_config,
    gemma_model_type,
    is_gemma,
)

DENSE_TYPES = ("llama", "mistral", "qwen2", "qwen3")
MOE_TYPES = ("mixtral", "qwen3_moe", "deepseek_v3")
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "mixtral": "MixtralForCausalLM",
                 "mistral": "MistralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                 "deepseek_v3": "DeepseekV3ForCausalLM"}


def read_hf_config(directory: Path) -> dict[str, Any]:
    path = directory / "config.json"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise HFConfigError(f"{directory}: no config.json (expected a Hugging Face model "
                            "directory, as save_pretrained writes it)") from None
    except (OSError, json.JSONDecodeError) as err:
        raise HFConfigError(f"{path}: cannot read it as JSON ({err})") from None
    if not isinstance(data, dict):
        raise HFConfigError(f"{path}: expected a JSON object")
    return data


def model_config_from_hf(hf: Mapping[str, Any]) -> ModelConfig:
    """The jaxpar model of a ``config.json`` dict; :class:`HFConfigError` names a field it cannot
    represent.
    """
    kind = hf.get("model_type")
    _refuse(kind == "qwen2_moe", "shared_expert_intermediate_size", "qwen2_moe's sigmoid-gated "
            "shared expert has no jaxpar equivalent")
    supported = DENSE_TYPES + MOE_TYPES + GEMMA_TYPES
    _refuse(kind not in supported, "model_type",
            f"{kind!r} is not supported; supported: {', '.join(supported)}")
    if kind in GEMMA_TYPES:
        return gemma_model_config(hf)
    _check_unsupported(hf, kind)
    if kind == "deepseek_v3":
        return deepseek.deepseek_model_config(hf)
    d_model, heads = int(_get(hf, "hidden_size")), int(_get(hf, "num_attention_heads"))
    theta, scaling = rope_from_hf(hf, kind)
    return ModelConfig(
        d_model=d_model, n_layers=int(_get(hf, "num_hidden_layers")), n_heads=heads,
        n_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or d_model // heads),
        d_ff=int(_get(hf, "intermediate_size")), vocab_size=int(_get(hf, "vocab_size")),
        rope_theta=theta, rope_scaling=scaling, norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=kind == "qwen2", qk_norm=kind in ("qwen3", "qwen3_moe"),
        sliding_window=_window_from_hf(hf, kind), moe=_moe_from_hf(hf, kind))


def _moe_from_hf(hf: Mapping[str, Any], kind: str) -> MoEConfig:
    """Softmax routers, every layer a mixture, dropless (the same function on any mesh)."""
    if kind not in MOE_TYPES:
        return MoEConfig()
    if kind == "qwen3_moe":
        _refuse(hf.get("decoder_sparse_step", 1) != 1, "decoder_sparse_step",
                f"{hf.get('decoder_sparse_step')}: only 1 (every layer a mixture) is supported")
        _refuse(bool(hf.get("mlp_only_layers")), "mlp_only_layers", "must be empty (every "
                "layer a mixture)")
    # transformers 5 writes num_local_experts for both; 4.x wrote num_experts for qwen3_moe.
    experts = hf.get("num_local_experts") or _get(hf, "num_experts")
    return MoEConfig(
        num_experts=int(experts), top_k=int(_get(hf, "num_experts_per_tok")),
        d_ff_expert=int(_get(hf, "moe_intermediate_size")) if kind == "qwen3_moe" else None,
        router="softmax", dispatch="dropless",
        norm_topk=kind == "mixtral" or bool(hf.get("norm_topk_prob")),
        aux_loss_weight=float(hf.get("router_aux_loss_coef") or 0.0), z_loss_weight=0.0)


def _check_unsupported(hf: Mapping[str, Any], kind: str) -> None:
    """Fields that would make the Hugging Face model compute something else."""
    _refuse(hf.get("hidden_act", "silu") != "silu", "hidden_act",
            f"{hf.get('hidden_act')!r} is not supported (jaxpar's MLP is SwiGLU: silu)")
    _refuse(bool(hf.get("attention_bias")), "attention_bias",
            "true puts a bias on o_proj too, which jaxpar's attention lacks")
    _refuse(bool(hf.get("mlp_bias")), "mlp_bias", "true is not supported (no MLP biases)")
    if kind == "deepseek_v3":
        deepseek.check_fp8_blocks(hf)
    else:
        _refuse(bool(hf.get("quantization_config")), "quantization_config",
                "quantized weights are not supported")
    if kind == "mixtral":
        _refuse(bool(hf.get("router_jitter_noise")), "router_jitter_noise", "must be 0")


def _window_from_hf(hf: Mapping[str, Any], kind: str) -> int | None:
    """Every layer's one window (``model.sliding_window``), or None.

    A mix of local and global layers jaxpar cannot express is refused.
    """
    window = hf.get("sliding_window")
    layers = int(_get(hf, "num_hidden_layers"))
    if kind.startswith("qwen"):  # their sliding_window is a setting, off unless enabled
        window = window if hf.get("use_sliding_window") else None
        first_global = int(hf.get("max_window_layers") or 0)
        if window is not None and first_global >= layers:
            window = None  # every layer is one of the "first" global ones
        _refuse(window is not None and first_global > 0, "max_window_layers",
                f"{first_global}: layers 0..{first_global - 1} global and the rest local has "
                "no jaxpar equivalent (model.global_every alternates); supported: 0 (every layer "
                f"local) or >= num_hidden_layers={layers} (none)")
    _refuse(window is not None and (not isinstance(window, int) or window < 1),
            "sliding_window", f"{window!r}: expected a positive integer or null")
    want = "full_attention" if window is None else "sliding_attention"
    other = [t for t in hf.get("layer_types") or [] if t != want]
    _refuse(bool(other), "layer_types", f"{other[0] if other else ''!r} layers beside "
            f"{want} ones are not supported (sliding_window={window}: every layer {want})")
    return window


# --------------------------------------------------------------------------------------------
# Writing


def hf_model_type(m: ModelConfig) -> str:
    """The Hugging Face model type computing what ``m`` does, or an error naming the setting."""
    if m.mla.enabled:
        deepseek.check_deepseek_export(m, _refuse_export)
        return "deepseek_v3"
    if is_gemma(m):
        return gemma_model_type(m, _refuse_export)
    for name, off in (("mlp_activation", "silu"), ("embed_scale", False), ("final_softcap", 0.0),
                      ("query_scale", None)):
        _refuse_export(getattr(m, name) != off, f"model.{name}={getattr(m, name)}", "only the "
                       "Gemmas (model.post_norms) have it")
    if m.moe.enabled:
        moe = m.moe
        # qwen3_moe (q/k norms) has any expert size and either gate; mixtral renormalises.
        checks = (("every", moe.every == 1), ("router", moe.router == "softmax"),
                  ("num_shared_experts", moe.num_shared_experts == 0))
        if not m.qk_norm:
            checks += (("norm_topk", moe.normalise_gates), ("d_ff_expert", moe.d_ff_expert in
                                                            (None, m.d_ff)))
        shown = {"norm_topk": moe.normalise_gates}
        for name, ok in checks:
            value = shown.get(name, getattr(moe, name))
            _refuse_export(not ok, f"model.moe.{name}={value}", "the exported "
                           "mixtures, qwen3_moe (with model.qk_norm) and mixtral, have every=1, "
                           "router=softmax, no shared experts; mixtral also norm_topk=true, "
                           "d_ff_expert=d_ff")
        _refuse_export(m.qkv_bias, "model.qkv_bias", "no exported mixture has q/k/v biases")
        _refuse_export(m.qk_norm and m.sliding_window is not None, "model.sliding_window",
                       "the exported windowed mixture is mixtral (no q/k norms)")
        return "qwen3_moe" if m.qk_norm else "mixtral"
    _refuse_export(m.qkv_bias and m.qk_norm, "model.qkv_bias and model.qk_norm",
                   "no exported model type has both (qwen2: biases, qwen3: norms)")
    if m.sliding_window is not None:
        _refuse_export(m.qkv_bias or m.qk_norm, f"model.sliding_window={m.sliding_window} "
                       "with model.qkv_bias or model.qk_norm", "the exported windowed model "
                       "is mistral (no biases, no q/k norms)")
        return "mistral"
    return "qwen3" if m.qk_norm else "qwen2" if m.qkv_bias else "llama"


def _check_attention_export(m: ModelConfig, kind: str) -> None:
    """Refuse what the exported types lack: per-layer windows, soft caps, a local RoPE base."""
    _refuse_export(m.global_every > 0, f"model.global_every={m.global_every}",
                   f"{kind}'s sliding window is the same in every layer")
    _refuse_export(m.attn_softcap > 0, f"model.attn_softcap={m.attn_softcap}",
                   f"{kind} does not cap its attention scores")
    _refuse_export(m.rope_local_theta is not None, f"model.rope_local_theta="
                   f"{m.rope_local_theta}", f"{kind} has one RoPE base")


def _refuse_export(condition: bool, field: str, why: str) -> None:
    if condition:
        raise HFConfigError(f"{field}: no Hugging Face equivalent; {why}")


def hf_config_from_model(m: ModelConfig) -> dict[str, Any]:
    """A ``config.json`` for ``m``, with the RoPE settings in both dialects."""
    kind = hf_model_type(m)
    if not is_gemma(m):
        _check_attention_export(m, kind)
    rope_parameters: dict[str, Any] = {"rope_theta": m.rope_theta, "rope_type": "default"}
    rope_scaling = None
    max_positions = 8192
    if m.rope_scaling.enabled:
        r = m.rope_scaling
        keys = LLAMA3_KEYS if r.type == "llama3" else ("factor",) if r.type == "linear" else (
            "factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
            "mscale_all_dim")
        rope_scaling = {"rope_type": r.type, **{k: getattr(r, k) for k in keys}}
        rope_parameters.update(rope_scaling)
        max_positions = int(r.original_max_position_embeddings * r.factor)
    if is_gemma(m):
        return gemma_hf_config(m, kind, rope_parameters, rope_scaling, max_positions)
    out: dict[str, Any] = {
        "architectures": [ARCHITECTURES[kind]], "model_type": kind,
        "vocab_size": m.vocab_size, "hidden_size": m.d_model, "intermediate_size": m.d_ff,
        "num_hidden_layers": m.n_layers, "num_attention_heads": m.n_heads,
        "num_key_value_heads": m.n_kv_heads, "head_dim": m.resolved_head_dim,
        "hidden_act": "silu", "rms_norm_eps": m.norm_eps,
        "tie_word_embeddings": m.tie_embeddings, "max_position_embeddings": max_positions,
        "rope_theta": m.rope_theta, "rope_scaling": rope_scaling,
        "rope_parameters": rope_parameters, "attention_dropout": 0.0, "dtype": "float32",
        "torch_dtype": "float32", "use_cache": True,
    }
    if kind in ("llama", "qwen3", "qwen3_moe"):
        out.update(attention_bias=False)
    if kind == "llama":
        out.update(mlp_bias=False)
    if kind.startswith("qwen"):
        out.update(use_sliding_window=False, sliding_window=None,
                   layer_types=["full_attention"] * m.n_layers)
    if kind == "mixtral":
        out.update(num_local_experts=m.moe.num_experts, num_experts_per_tok=m.moe.top_k,
                   router_aux_loss_coef=m.moe.aux_loss_weight, router_jitter_noise=0.0,
                   output_router_logits=False, sliding_window=m.sliding_window)
    if kind == "mistral":
        out.update(sliding_window=m.sliding_window)
    if kind == "deepseek_v3":
        out.update(deepseek.deepseek_fields(m))
    if kind == "qwen3_moe":
        out.update(num_experts=m.moe.num_experts, num_local_experts=m.moe.num_experts,
                   num_experts_per_tok=m.moe.top_k, moe_intermediate_size=m.resolved_d_ff_expert,
                   norm_topk_prob=m.moe.normalise_gates,
                   decoder_sparse_step=1, mlp_only_layers=[], output_router_logits=False,
                   router_aux_loss_coef=m.moe.aux_loss_weight)
    return out
