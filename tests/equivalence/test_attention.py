"""Attention implementations against an independent reference (jax.nn.dot_product_attention),
the memory blockwise attention saves, and bfloat16. The choice `model.attention` makes is in
tests/unit/test_attention_choice.py, full-model equivalence under a sharded layout in
test_parallel_layouts.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.model.attention import blockwise_attention, dense_attention
from jaxpar.model.fused import splash_attention
from jaxpar.parallel.context import zigzag_order
from jaxpar.parallel.hooks import per_device

B, S, D = 2, 64, 16


def qkv(heads: int, kv_heads: int, seq: int = S, dtype=jnp.float32, scale: float = 1.0):
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q = scale * jax.random.normal(kq, (B, seq, heads, D))
    k = scale * jax.random.normal(kk, (B, seq, kv_heads, D))
    v = jax.random.normal(kv, (B, seq, kv_heads, D))
    return q.astype(dtype), k.astype(dtype), v.astype(dtype)


def reference(q, k, v, order):
    """jax's own causal attention on the tokens in storage order, scattered back to ``order``
    (an out-of-order layout must give each token the output of its position)."""
    inverse = np.argsort(order)
    out = jax.nn.dot_product_attention(q[:, inverse], k[:, inverse], v[:, inverse],
                                       is_causal=True, implementation="xla")
    return out[:, order]


def grads(fn, q, k, v):
    weights = jax.random.normal(jax.random.key(1), q.shape)
    return jax.grad(lambda *a: jnp.sum(fn(*a) * weights), argnums=(0, 1, 2))(q, k, v)


@pytest.mark.parametrize("impl,block", [("dense", None), ("blockwise", 8), ("blockwise", 16),
                                        ("blockwise", 64)])
@pytest.mark.parametrize("heads,kv_heads,zigzag", [(4, 4, False), (8, 2, False), (8, 2, True),
                                                   (4, 1, True)],
                         ids=["mha", "gqa", "gqa-zigzag", "mqa-zigzag"])
def test_attention_matches_jax_reference_output_and_gradients(impl, block, heads, kv_heads,
                                                              zigzag):
    q, k, v = qkv(heads, kv_heads)
    order = zigzag_order(S, 2) if zigzag else np.arange(S)
    positions = jnp.broadcast_to(jnp.asarray(order, jnp.int32), (B, S))
    attend = dense_attention if impl == "dense" else blockwise_attention(block)

    def ours(q, k, v):
        return attend(q, k, v, positions)

    def theirs(q, k, v):
        return reference(q, k, v, order)

    np.testing.assert_allclose(ours(q, k, v), theirs(q, k, v), atol=2e-6, rtol=1e-5)
    for got, want in zip(grads(ours, q, k, v), grads(theirs, q, k, v), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-4)


def test_blockwise_attention_in_bfloat16_tracks_the_float32_result():
    # Large-scale inputs make the softmax peaked, so a wrong mask or normalisation in the bf16
    # path would move the output by O(1), far beyond bf16 round-off.
    q, k, v = qkv(8, 2, scale=3.0)
    positions = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    attend = blockwise_attention(16)
    want = reference(q, k, v, np.arange(S))
    low = attend(*(a.astype(jnp.bfloat16) for a in (q, k, v)), positions)
    assert low.dtype == jnp.bfloat16
    error = jnp.abs(low.astype(jnp.float32) - want)
    assert float(error.max()) < 0.1 and float(error.mean()) < 0.01, (error.max(), error.mean())
    g_low = grads(lambda *a: attend(*a, positions).astype(jnp.float32),
                  *(a.astype(jnp.bfloat16) for a in (q, k, v)))
    g_ref = grads(lambda *a: reference(*a, np.arange(S)), q, k, v)
    for got, ref in zip(g_low, g_ref, strict=True):
        rel = float(jnp.linalg.norm(got.astype(jnp.float32) - ref) / jnp.linalg.norm(ref))
        assert rel < 0.05, rel


def temp_bytes_of_gradient(attend, seq: int) -> int:
    q, k, v = qkv(4, 2, seq=seq)
    positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (B, seq))

    def loss(q, k, v):
        return jnp.sum(attend(q, k, v, positions) ** 2)

    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_blockwise_attention_memory_grows_linearly_where_dense_grows_quadratically():
    block = 128
    dense = [temp_bytes_of_gradient(dense_attention, s) for s in (1024, 2048)]
    tiled = [temp_bytes_of_gradient(blockwise_attention(block), s) for s in (1024, 2048)]
    score_matrix = B * 4 * 2048 * 2048 * 4  # one float32 [B, H, S, S] at S = 2048
    assert dense[1] > score_matrix and dense[1] / dense[0] > 3.5, dense
    assert tiled[1] < score_matrix / 8 and tiled[1] / tiled[0] < 2.5, tiled


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
def test_splash_kernel_matches_jax_reference_output_and_gradients(heads, kv_heads):
    """The TPU kernel, run by Pallas' interpreter on the CPU (its smallest block is 128)."""
    q, k, v = qkv(heads, kv_heads, seq=256)
    attend = splash_attention(128, interpret=True)

    def ours(q, k, v):
        return attend(q, k, v)

    def theirs(q, k, v):
        return reference(q, k, v, np.arange(256))

    np.testing.assert_allclose(ours(q, k, v), theirs(q, k, v), atol=2e-6, rtol=1e-5)
    for got, want in zip(grads(ours, q, k, v), grads(theirs, q, k, v), strict=True):
        np.testing.assert_allclose(got, want, atol=5e-5, rtol=1e-4)


def test_splash_runs_per_device_on_its_rows_and_heads():
    """The shard_map around the kernel (a Pallas kernel cannot be split by the compiler) hands
    each device its own sequences and heads: data=2 tensor=2 gives the unsplit result."""
    q, k, v = qkv(8, 2, seq=256)
    mesh = jax.make_mesh((2, 2), ("data", "tensor"), devices=jax.devices()[:4],
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    attend = per_device(splash_attention(128, interpret=True), ("data",),
                        {"heads": ("tensor",), "kv_heads": ("tensor",)})
    positions = jnp.broadcast_to(jnp.arange(256, dtype=jnp.int32), (B, 256))
    with jax.set_mesh(mesh):
        out = jax.jit(attend)(q, k, v, positions)
    np.testing.assert_allclose(out, reference(q, k, v, np.arange(256)), atol=2e-6, rtol=1e-5)
