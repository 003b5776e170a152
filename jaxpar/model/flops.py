"""Analytic training flops of the model, the yardstick for TFLOP/s and MFU.

Per token, a matmul with a weight of P parameters costs 2P flops forward and 4P backward, so 6P
in all; attention adds 2 x 2 x S x H x D per layer forward (scores and weighted sum over the full
S x S square that the model computes) and twice that backward. Recomputation under remat is
deliberately not counted: MFU measures useful work.
"""

from __future__ import annotations

from jaxpar.config import ModelConfig


def matmul_params(cfg: ModelConfig) -> int:
    """Parameters used in matmuls (everything but norms and the embedding lookup)."""
    e, h, k, d, f = (cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.resolved_head_dim, cfg.d_ff)
    per_layer = e * h * d + 2 * e * k * d + h * d * e + 3 * e * f
    return cfg.n_layers * per_layer + e * cfg.vocab_size  # + output projection (tied or not)


def param_count(cfg: ModelConfig) -> int:
    """All parameters, including the embedding table and norm scales."""
    embedding = cfg.vocab_size * cfg.d_model
    head = 0 if cfg.tie_embeddings else cfg.d_model * cfg.vocab_size
    norms = (2 * cfg.n_layers + 1) * cfg.d_model
    return matmul_params(cfg) - cfg.d_model * cfg.vocab_size + embedding + head + norms


def train_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    attention = 12 * cfg.n_layers * cfg.n_heads * cfg.resolved_head_dim * seq_len
    return 6.0 * matmul_params(cfg) + attention
