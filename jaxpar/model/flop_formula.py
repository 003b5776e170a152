"""Analytic training flops of the model, the yardstick for TFLOP/s and MFU.

Per token a weight of P parameters costs 6P flops (2P forward, 4P backward). Causal
attention counts half the S x S square, as MaxText does (docs/plan.md, "How the bound
counts"), so MFU stays <= 100%; a local layer (``model.sliding_window`` W < S) drops the
(S - W)^2 / 2 pairs beyond its window. Not counted: remat's recomputation, the padded
vocabulary. :func:`matmul_params` counts a MoE layer's *active* parameters (router, ``top_k``
and shared experts); :func:`param_count` counts every expert.
"""

from __future__ import annotations

from jaxpar.config import ModelConfig


def attention_params(cfg: ModelConfig) -> int:
    """The attention's weights; multi-head latent attention's (``model.mla``): the query's
    down- and up-projections (or its full-rank one), the key/value latent with the rope key,
    its up-projection to every head's k_nope and v, and the output projection."""
    e, h = cfg.d_model, cfg.n_heads
    if cfg.mla.enabled:
        a = cfg.mla
        q = (e * a.q_lora_rank + a.q_lora_rank * h * a.qk_head_dim if a.q_lora_rank
             else e * h * a.qk_head_dim)
        kv = e * (a.kv_lora_rank + a.qk_rope_head_dim) + a.kv_lora_rank * h * (
            a.qk_nope_head_dim + a.v_head_dim)
        return q + kv + h * a.v_head_dim * e
    k, d = cfg.n_kv_heads, cfg.resolved_head_dim
    return e * h * d + 2 * e * k * d + h * d * e


def _attention_widths(cfg: ModelConfig) -> tuple[int, int]:
    """Per-head widths of the scores' product (q and k) and of the values."""
    if cfg.mla.enabled:
        return cfg.mla.qk_head_dim, cfg.mla.v_head_dim
    return cfg.resolved_head_dim, cfg.resolved_head_dim


def _moe_params(cfg: ModelConfig, experts: int) -> int:
    """Router + ``experts`` routed experts + the shared experts of one MoE layer."""
    moe, e = cfg.moe, cfg.d_model
    expert = 3 * e * cfg.resolved_d_ff_expert
    return e * moe.num_experts + (experts + moe.num_shared_experts) * expert


def matmul_params(cfg: ModelConfig) -> int:
    """Parameters one token's forward pass multiplies with (everything but norms and the
    embedding lookup; in MoE layers only the router, the top_k experts and shared experts)."""
    n_moe = cfg.n_moe_layers
    dense_ffn = 3 * cfg.d_model * cfg.d_ff
    ffn = (cfg.n_layers - n_moe) * dense_ffn
    if n_moe:
        ffn += n_moe * _moe_params(cfg, cfg.moe.top_k)
    # + output projection (tied or not)
    return cfg.n_layers * attention_params(cfg) + ffn + cfg.d_model * cfg.vocab_size


def param_count(cfg: ModelConfig) -> int:
    """All parameters, including every expert, the embedding table and norm scales."""
    n_moe = cfg.n_moe_layers
    layers = (cfg.n_layers * attention_params(cfg)
              + (cfg.n_layers - n_moe) * 3 * cfg.d_model * cfg.d_ff)
    if n_moe:
        layers += n_moe * _moe_params(cfg, cfg.moe.num_experts)
    embedding = cfg.vocab_size * cfg.d_model
    head = 0 if cfg.tie_embeddings else cfg.d_model * cfg.vocab_size
    # two norms a block (four with post_norms) and the final one; q/k norms of one head each
    norms = ((2 + 2 * cfg.post_norms) * cfg.n_layers + 1) * cfg.d_model
    norms += 2 * cfg.n_layers * cfg.resolved_head_dim * cfg.qk_norm
    if cfg.mla.enabled:  # the latents' norms
        norms += cfg.n_layers * (cfg.mla.q_lora_rank + cfg.mla.kv_lora_rank)
    return layers + embedding + head + norms


def causal_attention_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Useful attention flops per token, forward and backward: the causal half of the square
    (scores over the q/k width, the weighted sum over the values' width), the band of the
    window in local layers (module docstring)."""
    qk, v = _attention_widths(cfg)
    keys = seq_len / 2  # keys per query, on average, in a global layer
    window = cfg.sliding_window
    if window is None or window >= seq_len:
        return 6.0 * cfg.n_layers * cfg.n_heads * (qk + v) * keys
    band = keys - (seq_len - window) ** 2 / (2 * seq_len)
    local = cfg.n_layers - (cfg.n_layers // cfg.global_every if cfg.global_every else 0)
    per_layer = local * band + (cfg.n_layers - local) * keys
    return 6.0 * cfg.n_heads * (qk + v) * per_layer


def train_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Useful training flops per token: the yardstick of MFU in the trainer, ``jaxpar plan``
    and ``scripts/bench_mfu.py`` (module docstring)."""
    attention = causal_attention_flops_per_token(cfg, seq_len)
    return 6.0 * matmul_params(cfg) + attention
