"""Gemma 2 and Gemma 3 ``config.json`` <-> jaxpar's :class:`~jaxpar.config.ModelConfig`.

Read: ``gemma2``, ``gemma3_text`` and the multimodal ``gemma3`` (settings in ``text_config``; the
vision tower left out). Written: ``gemma3_text`` with q/k norms, else ``gemma2``, RoPE in both
dialects. Which Gemma setting is which jaxpar one: docs/hugging-face.md, "Gemma 2 and Gemma 3".
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jaxpar.config import ModelConfig, RopeScalingConfig
from jaxpar.hf.common import refuse as _refuse
from jaxpar.hf.common import required as _get
from jaxpar.hf.common import rope_from_hf

GEMMA_TYPES = ("gemma2", "gemma3_text", "gemma3")
ARCHITECTURES = {"gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}
# Hugging Face activation -> model.mlp_activation (the gated MLP's).
ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "silu": "silu"}
FULL, SLIDING = "full_attention", "sliding_attention"
# transformers' defaults where a config leaves a field out.
GLOBAL_THETA = {"gemma2": 10000.0, "gemma3_text": 1e6}
LOCAL_THETA = 10000.0
WINDOW_PATTERN = {"gemma2": 2, "gemma3_text": 6}  # every k-th layer global, before layer_types


def text_config(hf: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's settings: ``text_config`` of the multimodal ``gemma3``."""
    if hf.get("model_type") != "gemma3":
        return hf
    text = hf.get("text_config")
    _refuse(not isinstance(text, Mapping), "text_config", "missing (gemma3 keeps its language "
            "model's settings there)")
    return text


def gemma_model_config(hf: Mapping[str, Any]) -> ModelConfig:
    """The jaxpar model of a Gemma 2/3 ``config.json``; refuses, naming the field, what differs."""
    text = text_config(hf)
    kind = "gemma2" if hf["model_type"] == "gemma2" else "gemma3_text"
    activation = text.get("hidden_activation") or text.get("hidden_act") or "gelu_pytorch_tanh"
    _refuse(activation not in ACTIVATIONS, "hidden_activation", f"{activation!r} is not "
            f"supported; supported: {', '.join(ACTIVATIONS)}")
    _refuse(bool(text.get("attention_bias")), "attention_bias", "true is not supported")
    _refuse(bool(text.get("use_bidirectional_attention")), "use_bidirectional_attention",
            "true is not supported (jaxpar's attention is causal)")
    _refuse(bool(hf.get("quantization_config")), "quantization_config",
            "quantized weights are not supported")
    n_layers, d_model = int(_get(text, "num_hidden_layers")), int(_get(text, "hidden_size"))
    heads = int(_get(text, "num_attention_heads"))
    window, every = _window_pattern(text, kind, n_layers)
    theta, local_theta, scaling = _rope(text, kind)
    tie = hf.get("tie_word_embeddings", text.get("tie_word_embeddings", True))
    return ModelConfig(
        d_model=d_model, n_layers=n_layers, n_heads=heads,
        n_kv_heads=int(text.get("num_key_value_heads") or heads),
        head_dim=int(text.get("head_dim") or 256), d_ff=int(_get(text, "intermediate_size")),
        vocab_size=int(_get(text, "vocab_size")), rope_theta=theta, rope_scaling=scaling,
        norm_eps=float(text.get("rms_norm_eps", 1e-6)), tie_embeddings=bool(tie),
        qk_norm=kind == "gemma3_text", mlp_activation=ACTIVATIONS[activation], post_norms=True,
        embed_scale=True, final_softcap=float(text.get("final_logit_softcapping") or 0.0),
        query_scale=float(text.get("query_pre_attn_scalar") or 256),
        sliding_window=window, global_every=every,
        attn_softcap=float(text.get("attn_logit_softcapping") or 0.0),
        # Local layers never take the global layers' scaling: a base of their own says so.
        rope_local_theta=(local_theta if window is not None
                          and (local_theta != theta or scaling.enabled) else None))


def _window_pattern(text: Mapping[str, Any], kind: str, n_layers: int) -> tuple[int | None, int]:
    """``layer_types`` as (``sliding_window``, ``global_every``).

    Layers k, 2k, ... (from 1) full, the others sliding; all full: no window; all sliding: 0.
    """
    types = text.get("layer_types")
    if types is None:
        k = int(text.get("sliding_window_pattern") or WINDOW_PATTERN[kind])
        types = [FULL if (i + 1) % k == 0 else SLIDING for i in range(n_layers)]
    _refuse(len(types) != n_layers, "layer_types", f"{len(types)} entries for "
            f"{n_layers} layers")
    unknown = sorted(set(types) - {FULL, SLIDING})
    _refuse(bool(unknown), "layer_types", f"{unknown[0] if unknown else ''!r} is not supported; "
            f"supported: {FULL}, {SLIDING}")
    full = [i for i, t in enumerate(types) if t == FULL]
    if len(full) == n_layers:
        return None, 0
    window = text.get("sliding_window")
    _refuse(window is None, "sliding_window", f"null, but layer_types has {SLIDING} layers")
    every = full[0] + 1 if full else 0
    periodic = [i for i in range(n_layers) if every and (i + 1) % every == 0]
    _refuse(full != periodic, "layer_types", f"{FULL} at layers {full} is not periodic (jaxpar "
            f"needs every k-th layer {FULL}, the others {SLIDING})")
    return int(window), every


def _rope(text: Mapping[str, Any], kind: str) -> tuple[float, float, RopeScalingConfig]:
    """(global RoPE base, local RoPE base, global scaling), from either transformers dialect."""
    params = text.get("rope_parameters") or {}
    if not (FULL in params or SLIDING in params):  # one dict for every layer (or 4.x's keys)
        theta, scaling = rope_from_hf(text, kind)
        local = float(text.get("rope_local_base_freq") or
                      (LOCAL_THETA if kind == "gemma3_text" else theta))
        return theta, local, scaling
    local = params.get(SLIDING) or {}
    _refuse(local.get("rope_type", "default") != "default",
            f"rope_parameters.{SLIDING}.rope_type", f"{local.get('rope_type')!r}: the local "
            "layers' RoPE must be plain (default)")
    theta, scaling = rope_from_hf({"rope_parameters": params.get(FULL) or {}}, kind)
    return theta, float(local.get("rope_theta") or LOCAL_THETA), scaling


# --------------------------------------------------------------------------------------------
# Writing


def is_gemma(m: ModelConfig) -> bool:
    """Whether ``m`` exports as a Gemma: its "sandwich" norms are Gemma's alone."""
    return m.post_norms


def gemma_model_type(m: ModelConfig, refuse) -> str:
    """``gemma3_text`` (q/k norms) or ``gemma2``; ``refuse(condition, field, why)`` the rest."""
    refuse(not m.embed_scale, "model.post_norms without model.embed_scale", "the Gemmas "
           "(the models with post-norms) scale their embeddings")
    refuse(m.moe.enabled, "model.moe", "no Gemma has a mixture of experts")
    refuse(m.qkv_bias, "model.qkv_bias", "no Gemma has q/k/v biases")
    refuse(not float(m.query_scale or 1).is_integer(), f"model.query_scale={m.query_scale}",
           "transformers' Gemma configs take a whole query_pre_attn_scalar")
    if m.qk_norm:
        return "gemma3_text"
    refuse(m.rope_scaling.enabled, "model.rope_scaling", "gemma2 (no q/k norms) has plain RoPE")
    refuse(m.rope_local_theta not in (None, m.rope_theta), "model.rope_local_theta",
           "gemma2 (no q/k norms) has one RoPE base")
    return "gemma2"


def gemma_hf_config(m: ModelConfig, kind: str, rope_parameters: dict, rope_scaling: dict | None,
                    max_positions: int) -> dict[str, Any]:
    """``config.json`` of the Gemma ``kind`` that ``m`` is (RoPE dicts as the Llama family's)."""
    every = m.global_every
    types = [FULL if m.sliding_window is None or (every and (i + 1) % every == 0) else SLIDING
             for i in range(m.n_layers)]
    activation = {v: k for k, v in ACTIVATIONS.items()}[m.mlp_activation]
    out: dict[str, Any] = {
        "architectures": [ARCHITECTURES[kind]], "model_type": kind,
        "vocab_size": m.vocab_size, "hidden_size": m.d_model, "intermediate_size": m.d_ff,
        "num_hidden_layers": m.n_layers, "num_attention_heads": m.n_heads,
        "num_key_value_heads": m.n_kv_heads, "head_dim": m.resolved_head_dim,
        "hidden_activation": activation, "rms_norm_eps": m.norm_eps,
        "tie_word_embeddings": m.tie_embeddings, "max_position_embeddings": max_positions,
        # an int: transformers' Gemma configs refuse a float there
        "query_pre_attn_scalar": int(m.query_scale or m.resolved_head_dim),
        # transformers builds the local layers' mask even when none is local
        "sliding_window": m.sliding_window or max_positions, "layer_types": types,
        "final_logit_softcapping": m.final_softcap or None,
        "attn_logit_softcapping": m.attn_softcap or None, "attention_bias": False,
        "attention_dropout": 0.0, "dtype": "float32", "torch_dtype": "float32", "use_cache": True,
        "rope_theta": m.rope_theta, "rope_scaling": rope_scaling,
    }
    if kind == "gemma2":
        return {**out, "rope_parameters": rope_parameters}
    local = m.rope_local_theta or m.rope_theta
    return {**out, "rope_local_base_freq": local, "rope_parameters": {
        FULL: rope_parameters, SLIDING: {"rope_type": "default", "rope_theta": local}}}
