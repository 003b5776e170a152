"""What the Hugging Face config readers share: the error, its checks, the RoPE settings.

Both transformers dialects are read, DeepSeek-V3's YaRN included.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jaxpar.config import ConfigError, RopeScalingConfig


class HFConfigError(ConfigError):
    """A Hugging Face model jaxpar cannot represent: exit 2, one line naming the field."""


# RoPE base when a config names none (transformers' defaults per model type).
DEFAULT_THETA = {"mixtral": 1e6, "gemma3_text": 1e6}
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor",
               "original_max_position_embeddings")


def required(hf: Mapping[str, Any], key: str) -> Any:
    if hf.get(key) is None:
        raise HFConfigError(f"config.json: {key} is missing")
    return hf[key]


def refuse(condition: bool, field: str, why: str) -> None:
    if condition:
        raise HFConfigError(f"config.json: {field}: {why}")


def rope_from_hf(hf: Mapping[str, Any], kind: str) -> tuple[float, RopeScalingConfig]:
    """RoPE base and scaling from 5.x's ``rope_parameters`` or 4.x's ``rope_theta`` +
    ``rope_scaling``.
    """
    params = hf.get("rope_parameters") or {}
    legacy = hf.get("rope_scaling") or {}
    refuse(not isinstance(params, Mapping) or not isinstance(legacy, Mapping),
           "rope_parameters", "expected one dict (per-layer-type RoPE is not supported)")
    theta = params.get("rope_theta", hf.get("rope_theta"))
    theta = float(theta if theta is not None else DEFAULT_THETA.get(kind, 10000.0))
    # 5.x keeps the rule in rope_parameters; 4.x in rope_scaling (rope_type, or older "type").
    rule = params if params.get("rope_type", "default") != "default" else legacy
    rope_type = rule.get("rope_type", rule.get("type", "default"))
    field = "rope_parameters" if rule is params else "rope_scaling"
    factor = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    refuse(factor not in (None, 1, 1.0), "partial_rotary_factor",
           f"{factor}: only full rotary embeddings are supported")
    if rope_type == "default":
        return theta, RopeScalingConfig()
    if rope_type == "linear":
        refuse(rule.get("factor") is None, f"{field}.factor", "missing (linear)")
        return theta, RopeScalingConfig(type="linear", factor=float(rule["factor"]))
    if rope_type == "yarn" and kind == "deepseek_v3":
        return theta, yarn_from_hf(rule, field)
    refuse(rope_type != "llama3", f"{field}.rope_type", f"{rope_type!r} is not supported; "
           "supported: default, linear, llama3 (and yarn for deepseek_v3)")
    missing = [k for k in LLAMA3_KEYS if rule.get(k) is None]
    refuse(bool(missing), f"{field}.{missing[0] if missing else ''}", "missing (llama3)")
    return theta, RopeScalingConfig(
        type="llama3", factor=float(rule["factor"]),
        low_freq_factor=float(rule["low_freq_factor"]),
        high_freq_factor=float(rule["high_freq_factor"]),
        original_max_position_embeddings=int(rule["original_max_position_embeddings"]))


def yarn_from_hf(rule: Mapping[str, Any], field: str) -> RopeScalingConfig:
    """DeepSeek-V3's yarn: frequencies, the rotary dims' factor and the softmax scale."""
    for key in ("factor", "original_max_position_embeddings"):
        refuse(rule.get(key) is None, f"{field}.{key}", "missing (yarn)")
    refuse(rule.get("attention_factor") is not None, f"{field}.attention_factor",
           "an explicit factor is not supported (yarn: derived from mscale)")
    refuse(rule.get("truncate", True) is not True, f"{field}.truncate", "only true")
    return RopeScalingConfig(
        type="yarn", factor=float(rule["factor"]),
        original_max_position_embeddings=int(rule["original_max_position_embeddings"]),
        beta_fast=float(rule.get("beta_fast") or 32), beta_slow=float(rule.get("beta_slow") or 1),
        mscale=float(rule.get("mscale") or 0.0),
        mscale_all_dim=float(rule.get("mscale_all_dim") or 0.0))
