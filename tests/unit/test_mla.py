"""Multi-head latent attention (jaxpar/model/mla.py) against a direct transcription of its
math, both paddings of the values (v narrower and wider than q/k), both RoPE layouts, and its
configuration errors. Against transformers' DeepSeek-V3: tests/integration/test_hf_deepseek.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpar.config import ConfigError, MLAConfig, ModelConfig, load_config, validate
from jaxpar.model.attention import dense_attention
from jaxpar.model.mla import MLA, interleaved_rotary, padded_attention

S = 12


def _rope(x, pos, theta, interleave):
    """Reference RoPE in numpy (float64): interleaved pairs, or halves."""
    p = x.shape[-1]
    inv = theta ** (-np.arange(p // 2) / (p // 2))
    ang = pos[..., None] * inv
    cos, sin = np.cos(ang)[:, :, None], np.sin(ang)[:, :, None]
    a, b = (x[..., 0::2], x[..., 1::2]) if interleave else (x[..., :p // 2], x[..., p // 2:])
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], -1)


def _reference(m: MLA, x: np.ndarray, mla: MLAConfig) -> np.ndarray:
    """The module docstring's formulas, in float64 numpy, with a causal softmax."""
    def p(name):
        return np.asarray(getattr(m, name)[...], np.float64)

    def rms(v, scale):
        return v / np.sqrt(np.mean(v * v, -1, keepdims=True) + 1e-6) * scale

    pos = np.broadcast_to(np.arange(S), x.shape[:2]).astype(np.float64)
    if mla.q_lora_rank:
        q = np.einsum("bsr,rhd->bshd", rms(x @ p("wq_a"), np.asarray(m.q_norm.scale[...])),
                      p("wq_b"))
    else:
        q = np.einsum("bse,ehd->bshd", x, p("wq"))
    kv = x @ p("wkv_a")
    c, kr = kv[..., :mla.kv_lora_rank], kv[..., None, mla.kv_lora_rank:]
    c = rms(c, np.asarray(m.kv_norm.scale[...]))
    kvb = np.einsum("bsr,rhd->bshd", c, p("wkv_b"))
    n = mla.qk_nope_head_dim
    k_nope, v = kvb[..., :n], kvb[..., n:]
    q = np.concatenate([q[..., :n], _rope(q[..., n:], pos, 10000.0, mla.rope_interleave)], -1)
    kr = np.broadcast_to(_rope(kr, pos, 10000.0, mla.rope_interleave), (*k_nope.shape[:-1],
                                                                         kr.shape[-1]))
    k = np.concatenate([k_nope, kr], -1)
    s = np.einsum("bshd,bthd->bhst", q, k) / np.sqrt(mla.qk_head_dim)
    s = np.where(np.tril(np.ones((S, S), bool)), s, -np.inf)
    prob = np.exp(s - s.max(-1, keepdims=True))
    prob /= prob.sum(-1, keepdims=True)
    out = np.einsum("bhst,bthd->bshd", prob, v)
    return np.einsum("bshd,hde->bse", out, p("wo"))


@pytest.mark.parametrize("mla", [
    MLAConfig(q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
              v_head_dim=6, rope_interleave=True),  # v narrower than q/k: v padded
    MLAConfig(q_lora_rank=0, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
              v_head_dim=20),  # v wider: q and k padded, q rescaled
], ids=["q-lora-v-padded", "full-rank-q-qk-padded"])
def test_mla_is_its_formulas(mla):
    with nnx.use_eager_sharding(False):
        m = MLA(ModelConfig(mla=mla, init_std=0.3), nnx.Rngs(params=0))
    for norm in ("q_norm", "kv_norm"):
        if hasattr(m, norm):  # scales away from 1, so that a norm left out shows
            scale = getattr(m, norm).scale
            scale[...] = 1 + 0.3 * jax.random.normal(jax.random.key(3), scale.shape)
    x = np.asarray(jax.random.normal(jax.random.key(1), (2, S, 64)), np.float64)
    pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (2, S))
    got = np.asarray(m(jnp.asarray(x, jnp.float32), pos))
    np.testing.assert_allclose(got, _reference(m, x, mla), atol=2e-5, rtol=1e-4)


def test_interleaved_rotary_is_rotate_half_of_the_deinterleaved_dims():
    x = jax.random.normal(jax.random.key(0), (1, 5, 2, 8))
    pos = jnp.arange(5)[None]
    np.testing.assert_allclose(np.asarray(interleaved_rotary(x, pos, 100.0)),
                               _rope(np.asarray(x, np.float64), np.arange(5)[None], 100.0, True),
                               atol=1e-5)


def test_padded_attention_equals_attention_of_the_unpadded_values():
    q, k = (jax.random.normal(jax.random.key(i), (1, 6, 2, 8)) for i in (0, 1))
    v = jax.random.normal(jax.random.key(2), (1, 6, 2, 8))
    want = dense_attention(q, k, v)
    np.testing.assert_allclose(padded_attention(dense_attention, q, k, v[..., :5], None),
                               want[..., :5], atol=1e-6)


MLA_ON = ["model.mla.kv_lora_rank=16", "model.mla.qk_rope_head_dim=4", "model.mla.v_head_dim=8",
          "model.mla.qk_nope_head_dim=4"]


@pytest.mark.parametrize(("overrides", "needle"), [
    (["model.mla.kv_lora_rank=16", "model.mla.qk_rope_head_dim=3", "model.mla.v_head_dim=8"],
     "model.mla.qk_rope_head_dim=3"),
    (["model.mla.kv_lora_rank=16", "model.mla.qk_rope_head_dim=4"], "model.mla.v_head_dim=0"),
    (["model.mla.q_lora_rank=8"], "kv_lora_rank > 0"),
    (["model.mla.kv_lora_rank=-1"], "model.mla.kv_lora_rank=-1"),
    ([*MLA_ON, "model.sliding_window=8"], "no sliding window or score cap"),
    ([*MLA_ON, "model.attn_softcap=30"], "no sliding window or score cap"),
])
def test_mla_config_errors_are_one_line(overrides, needle):
    with pytest.raises(ConfigError) as info:
        validate(load_config("tiny", overrides), 8)
    assert needle in str(info.value) and "\n" not in str(info.value)
