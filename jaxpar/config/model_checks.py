"""The model's shape, checked (part of :func:`jaxpar.config.validation.validate`, which runs
these first): positive sizes, grouped-query heads, rotary's even head dimension, the splits
over ``tensor``, MLA, windows, Gemma's features and rope scaling; each a one-line
:class:`~jaxpar.config.schema.ConfigError` naming the field and what is allowed."""

from __future__ import annotations

import math

from jaxpar.config.schema import ConfigError, MeshConfig, ModelConfig, RopeScalingConfig


def require(condition: bool, message: str) -> None:
    """Raise ``ConfigError(message)`` unless ``condition``: every rule's one line."""
    if not condition:
        raise ConfigError(message)


def check_model(m: ModelConfig, mesh: MeshConfig) -> None:
    """Model shape: positive sizes, grouped-query heads, rotary's even head_dim, tensor splits."""
    for name in ("d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "vocab_size",
                 "vocab_multiple"):
        value = getattr(m, name)
        require(value >= 1, f"model.{name}={value}: must be >= 1")
    require(m.n_heads % m.n_kv_heads == 0, f"model.n_heads={m.n_heads} must be a multiple of "
            f"model.n_kv_heads={m.n_kv_heads} (grouped-query attention)")
    if m.head_dim is None and not m.mla.enabled:
        require(m.d_model % m.n_heads == 0, f"model.d_model={m.d_model} must be divisible by "
                f"model.n_heads={m.n_heads} (or set model.head_dim)")
    require(m.mla.enabled or m.resolved_head_dim % 2 == 0, f"model.head_dim="
            f"{m.resolved_head_dim}: rotary embeddings need an even head_dim")
    # (The vocabulary needs no such rule: it is padded for the devices that split it,
    # Config.vocab_rows.)
    for name in ("n_heads", "n_kv_heads", "d_ff"):
        value = getattr(m, name)
        require(value % mesh.tensor == 0, f"model.{name}={value} is not divisible by "
                f"mesh.tensor={mesh.tensor}")
    require(math.isfinite(m.rope_theta) and m.rope_theta > 1, f"model.rope_theta={m.rope_theta}: "
            "must be a finite number > 1")
    require(math.isfinite(m.norm_eps) and m.norm_eps > 0, f"model.norm_eps={m.norm_eps}: must "
            "be a finite number > 0")
    _check_rope_scaling(m.rope_scaling)
    _check_mla(m)
    require(m.rope_scaling.type != "yarn" or m.mla.enabled, "model.rope_scaling.type=yarn: "
            "only with multi-head latent attention (model.mla); others take none, llama3 or "
            "linear")
    _check_window(m)
    _check_gemma_features(m)


def _check_mla(m: ModelConfig) -> None:
    """Multi-head latent attention: sizes that make a query, a key and a value."""
    a = m.mla
    for name in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                 "v_head_dim"):
        value = getattr(a, name)
        require(value >= 0, f"model.mla.{name}={value}: must be >= 0")
    if not a.enabled:
        require(not (a.q_lora_rank or a.qk_rope_head_dim or a.v_head_dim), "model.mla: set "
                "kv_lora_rank > 0 to use multi-head latent attention (0 leaves it off, so its "
                "other sizes must stay 0)")
        return
    require(a.qk_rope_head_dim >= 2 and a.qk_rope_head_dim % 2 == 0, "model.mla."
            f"qk_rope_head_dim={a.qk_rope_head_dim}: rotary embeddings need an even size >= 2")
    require(a.v_head_dim >= 1, f"model.mla.v_head_dim={a.v_head_dim}: must be >= 1")
    require(m.sliding_window is None and not m.attn_softcap, "model.mla: multi-head latent "
            "attention has no sliding window or score cap (set model.sliding_window: null, "
            "model.attn_softcap: 0)")


def _check_window(m: ModelConfig) -> None:
    """Sliding windows, score soft-capping and the local layers' RoPE base."""
    w = m.sliding_window
    require(w is None or w >= 1, f"model.sliding_window={w}: must be >= 1 (or null: global "
            "attention)")
    require(m.global_every >= 0, f"model.global_every={m.global_every}: must be >= 0")
    require(m.global_every == 0 or w is not None, f"model.global_every={m.global_every} "
            "needs model.sliding_window (the window of the other layers)")
    require(math.isfinite(m.attn_softcap) and m.attn_softcap >= 0, f"model.attn_softcap="
            f"{m.attn_softcap}: must be 0 (off) or a finite number > 0")
    t = m.rope_local_theta
    require(t is None or (math.isfinite(t) and t > 1), f"model.rope_local_theta={t}: must be "
            "a finite number > 1 (or null: model.rope_theta)")
    require(t is None or w is not None, f"model.rope_local_theta={t} needs "
            "model.sliding_window (it is the local layers' RoPE base)")


def _check_gemma_features(m: ModelConfig) -> None:
    """The Gemma 2/3 settings (``jaxpar/hf/config.py`` reads them from Hugging Face)."""
    require(m.mlp_activation in ("silu", "gelu_tanh"), f"model.mlp_activation="
            f"{m.mlp_activation!r}: must be silu or gelu_tanh")
    require(m.mlp_activation == "silu" or not m.moe.enabled, "model.mlp_activation="
            f"{m.mlp_activation}: the experts of model.moe are SwiGLU (silu) only")
    require(math.isfinite(m.final_softcap) and m.final_softcap >= 0, "model.final_softcap="
            f"{m.final_softcap}: must be a finite number >= 0 (0: off)")
    require(m.query_scale is None or (math.isfinite(m.query_scale) and m.query_scale > 0),
            f"model.query_scale={m.query_scale}: must be null or a finite number > 0")


def _check_rope_scaling(r: RopeScalingConfig) -> None:
    """The llama3 and yarn rules interpolate between two wavelengths: they must be ordered."""
    if not r.enabled:
        return
    require(r.factor >= 1, f"model.rope_scaling.factor={r.factor}: must be >= 1")
    if r.type == "linear":
        return
    require(r.type != "yarn" or 0 < r.beta_slow < r.beta_fast, "model.rope_scaling: "
            f"beta_slow={r.beta_slow} must be > 0 and below beta_fast={r.beta_fast} (yarn)")
    require(r.type == "yarn" or 0 < r.low_freq_factor < r.high_freq_factor,
            f"model.rope_scaling: low_freq_factor={r.low_freq_factor} must be > 0 and below "
            f"high_freq_factor={r.high_freq_factor}")
    require(r.original_max_position_embeddings >= 1, "model.rope_scaling."
            f"original_max_position_embeddings={r.original_max_position_embeddings}: must be "
            ">= 1")
