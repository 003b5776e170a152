"""Sliding-window attention and soft-capped scores (``model.sliding_window``, ``global_every``,
``attn_softcap``, ``rope_local_theta``) in every attention implementation.

The kernels against a plain-JAX reference written out here (float32, outputs and gradients):
windows, soft caps, both with documents, tokens stored out of order (zigzag); the block counts
of the blockwise and ring kernels (blocks outside the window are skipped at run time); a tiny
model whose layers alternate local and global attention on several layouts against one device;
generation with prompts longer than the window against the uncached forward pass."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import (
    GENERATION_MODEL,
    LAYOUT_BASE,
    assert_grads_and_params_match,
    greedy_by_full_forward,
    max_relative_error,
    random_qkv,
    run_layout,
)
from jax.sharding import PartitionSpec as P

from jaxpar.inference.generation import generate
from jaxpar.model.attention import (
    blockwise_attention,
    dense_attention,
    empty_statistics,
    fold_keys,
    group,
)
from jaxpar.model.fused import splash_attention
from jaxpar.model.mask import AttentionMask, with_window
from jaxpar.model.transformer import create_model, layer_is_local
from jaxpar.parallel.context import context_attention, ring_forward, zigzag_order
from jaxpar.parallel.ulysses import ulysses_attention

B, D = 2, 16
qkv = functools.partial(random_qkv, batch=B, dim=D, seed=3)


def reference(q, k, v, window: int | None, cap: float, segments=None):
    """Attention in storage order with the rule written out: key t visible from query s iff
    t <= s, s - t < window and both in one document; scores capped as cap tanh(x / cap)."""
    s, groups = q.shape[1], q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    scores = jnp.einsum("bshd,bthd->bhst", q, k) / np.sqrt(q.shape[-1])
    if cap:
        scores = cap * jnp.tanh(scores / cap)
    i = np.arange(s)
    allowed = np.broadcast_to(i[:, None] >= i[None, :], (q.shape[0], s, s))
    if window is not None:
        allowed = allowed & (i[:, None] - i[None, :] < window)
    if segments is not None:
        allowed = allowed & (segments[:, :, None] == segments[:, None, :])
    scores = jnp.where(allowed[:, None], scores, -jnp.inf)
    return jnp.einsum("bhst,bthd->bshd", jax.nn.softmax(scores, -1), v)


def check(ours, theirs, q, k, v, tol: float = 2e-5) -> None:
    """Outputs and the gradients of a random projection of them agree."""
    weights = jax.random.normal(jax.random.key(1), q.shape)

    def grads(fn):
        return jax.grad(lambda *a: jnp.sum(fn(*a) * weights), argnums=(0, 1, 2))(q, k, v)

    np.testing.assert_allclose(ours(q, k, v), theirs(q, k, v), atol=tol, rtol=tol)
    for got, want in zip(grads(ours), grads(theirs), strict=True):
        np.testing.assert_allclose(got, want, atol=tol, rtol=tol)


def segments_of(rows: list[list[int]]) -> np.ndarray:
    return np.stack([np.repeat(np.arange(len(r)), r) for r in rows]).astype(np.int32)


CASES = {  # window, soft cap, documents (None: one per row)
    "window": (12, 0.0, None),
    "softcap": (None, 1.5, None),
    "window+softcap+documents": (9, 2.0, [[10, 20, 2, 32], [64]]),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("impl,block,zigzag", [("dense", None, False), ("dense", None, True),
                                               ("blockwise", 8, False), ("blockwise", 16, True)])
def test_kernels_match_the_written_out_rule(case, impl, block, zigzag):
    window, cap, docs = CASES[case]
    q, k, v = qkv(8, 2, 64)
    order = zigzag_order(64, 2) if zigzag else np.arange(64)
    segments = None if docs is None else segments_of(docs)
    mask = with_window(AttentionMask(
        jnp.asarray(np.broadcast_to(order, (B, 64)), jnp.int32),
        None if segments is None else jnp.asarray(segments[:, order])), window, cap)
    attend = dense_attention if impl == "dense" else blockwise_attention(block)
    inverse = np.argsort(order)

    def theirs(q, k, v):  # in storage order, scattered back to ``order``
        return reference(q[:, inverse], k[:, inverse], v[:, inverse], window, cap,
                         segments)[:, order]

    check(lambda q, k, v: attend(q, k, v, mask), theirs, *(x[:, order] for x in (q, k, v)))


@pytest.mark.parametrize("impl", ["ring", "allgather", "ulysses", "hybrid"])
def test_context_attention_keeps_the_window_and_the_cap(impl):
    """context=4, zigzag: each device's queries against the keys passing round the ring (or
    gathered, or all of them for its heads after Ulysses' all-to-all; the hybrid: 2 x 2),
    window and soft cap included."""
    n, seq, window, cap = 4, 64, 11, 1.5
    q, k, v = qkv(4, 2, seq)
    order = zigzag_order(seq, n)
    positions = jnp.asarray(np.broadcast_to(order, (B, seq)), jnp.int32)
    mask = with_window(positions, window, cap)
    mesh = jax.make_mesh((n,), ("context",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:n])
    attention = (ulysses_attention(n, n if impl == "ulysses" else 2, True, block=4)
                 if impl in ("ulysses", "hybrid") else context_attention(impl, n, True, block=4))
    inverse = np.argsort(order)
    with jax.set_mesh(mesh):
        check(jax.jit(lambda q, k, v: attention(q, k, v, mask)),
              lambda q, k, v: reference(q[:, inverse], k[:, inverse], v[:, inverse], window,
                                        cap)[:, order],
              *(x[:, order] for x in (q, k, v)))


@pytest.mark.parametrize("window,cap,docs", [(100, 2.0, None), (50, 0.0, [[100, 28, 128], [256]])],
                         ids=["window+cap", "window+documents"])
def test_splash_kernel_with_a_window_and_a_cap(window, cap, docs):
    """The TPU kernel's LocalMask, attn_logits_soft_cap and SegmentIds, in Pallas'
    interpreter."""
    q, k, v = qkv(4, 2, 256)
    positions = jnp.broadcast_to(jnp.arange(256, dtype=jnp.int32), (B, 256))
    segments = None if docs is None else segments_of(docs)
    mask = with_window(AttentionMask(positions, None if docs is None else jnp.asarray(segments)),
                       window, cap)
    attend = splash_attention(128, interpret=True, window=window)
    check(lambda q, k, v: attend(q, k, v, mask),
          lambda q, k, v: reference(q, k, v, window, cap, segments), q, k, v, tol=1e-4)


# --------------------------------------------------------------------------------------------
# Blocks computed: 256 tokens in blocks of 32, a window of 64. Query block i sees key blocks
# i-2 (in part), i-1 (whole) and i (the diagonal): 1 + 2 + 3 x 6 = 21 of the causal 36.

WINDOWED_BLOCKS, CAUSAL_BLOCKS = 21, 36


def test_blockwise_skips_the_blocks_outside_the_window():
    q, k, v = qkv(4, 2, 256)
    order = jnp.broadcast_to(jnp.arange(256, dtype=jnp.int32), (B, 256))
    qg = group(q, 2)

    def count(m):
        return int(jax.jit(lambda q, k, v: fold_keys(empty_statistics(q), q, k, v, m, m, 32,
                                                     count=True)[1])(qg, k, v))

    assert count(AttentionMask(order)) == CAUSAL_BLOCKS
    assert count(with_window(order, 64)) == WINDOWED_BLOCKS
    assert count(with_window(order, 2**30)) == CAUSAL_BLOCKS  # a global layer's window


def test_ring_skips_the_blocks_outside_the_window_on_each_device():
    """context=4, zigzag: every (query chunk, key chunk) pair is computed on exactly one
    device, so the devices' counts add up to the single-device count."""
    n, seq = 4, 256
    order = zigzag_order(seq, n)
    q, k, v = (x[:, order] for x in qkv(4, 2, seq))
    positions = jnp.asarray(np.broadcast_to(order, (B, seq)), jnp.int32)
    mesh = jax.make_mesh((n,), ("context",), devices=jax.devices()[:n],
                         axis_types=(jax.sharding.AxisType.Auto,))

    def counts(m):
        def local(q, k, v, m):
            return ring_forward(group(q, 2), k, v, m, m, n, 32, count=True)[2][None]
        seq4 = P(None, "context", None, None)
        fn = jax.shard_map(local, mesh=mesh, in_specs=(seq4, seq4, seq4, P(None, "context")),
                           out_specs=P("context"))
        return np.asarray(jax.jit(fn)(q, k, v, m)).tolist()

    assert counts(AttentionMask(positions)) == [9, 9, 9, 9]
    windowed = counts(with_window(positions, 64))
    assert sum(windowed) == WINDOWED_BLOCKS and max(windowed) < 9, windowed


# --------------------------------------------------------------------------------------------
# A tiny model with alternating windows on several layouts against one device

# 4 layers, global_every=3: layers 1, 2 and 4 local (window 8 of 32 tokens), layer 3 global:
# an interleaved pipeline stores them out of order, which the flags must follow. The cap is
# small enough to bend the tiny model's scores (about 0.03 at initialisation).
WINDOWED = ("model.n_layers=4", "model.sliding_window=8", "model.global_every=3",
            "model.attn_softcap=0.05", "model.rope_local_theta=500")
REFERENCE = ("mesh.data=1", *WINDOWED)
LAYOUTS = {
    "blockwise": ("mesh.data=1", "model.attention=blockwise", "model.attention_block=8"),
    "data=2,fsdp=2,tensor=2": ("mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"),
    "context=4,ring": ("mesh.data=1", "mesh.context=4"),
    "data=2,context=4,allgather": ("mesh.data=2", "mesh.context=4",
                                   "parallel.context_impl=allgather"),
    # Ulysses: the window and cap on the whole sequence, back in natural order, 2 heads each.
    "data=2,context=4,ulysses": ("mesh.data=2", "mesh.context=4",
                                 "parallel.context_impl=ulysses"),
    "context=8,hybrid=4x2": ("mesh.data=1", "mesh.context=8", "parallel.context_impl=hybrid",
                             "parallel.ulysses_size=2"),
    # Ring attention on each stage's piece of the sequence (split by hand, no shard_map).
    "1f1b,pipe=2,context=2,ring": ("mesh.pipe=2", "mesh.data=1", "mesh.context=2",
                                   "train.microbatches=2", "parallel.pipeline_schedule=1f1b"),
    "interleaved,pipe=2,tensor=2": ("mesh.pipe=2", "mesh.data=1", "mesh.tensor=2",
                                    "train.microbatches=4",
                                    "parallel.pipeline_schedule=interleaved",
                                    "parallel.virtual_stages=2"),
}


def in_model_order(result: dict) -> tuple[dict, dict]:
    order = result["trainer"].layer_order
    if order is None:
        return result["grads"], result["params"]
    back = np.argsort(order)
    return tuple(dict(t, layers=jax.tree.map(lambda a: a[back], t["layers"]))
                 for t in (result["grads"], result["params"]))


def test_layer_kinds_follow_global_every():
    assert layer_is_local(create_model_cfg(*WINDOWED)).tolist() == [1, 1, 0, 1]
    ref = run_layout(REFERENCE)
    assert np.asarray(ref["state"].buffers["layers"]["attn"]["local"]).tolist() == [1, 1, 0, 1]
    # The window and the cap change the gradients: the test below has teeth. (A freshly
    # initialised model's loss hardly depends on the context.)
    plain = run_layout(("mesh.data=1", "model.n_layers=4"))
    assert max(max_relative_error(plain["grads"], ref["grads"]).values()) > 1e-2


def test_flags_of_blocks_grouped_with_a_mixture_of_experts():
    """Units of (dense, MoE) blocks: block i of unit u is layer 2u + i + 1 (from 1)."""
    from jaxpar.config import ModelConfig, MoEConfig
    from jaxpar.model.transformer import complete_buffers

    cfg = ModelConfig(n_layers=6, sliding_window=4, global_every=3,
                      moe=MoEConfig(num_experts=4, top_k=2, every=2))
    layers = nnx.to_pure_dict(nnx.split(create_model(cfg, 0), nnx.Param, ...)[2])["layers"]
    flags = [np.asarray(layers[f"block_{i}"]["attn"]["local"]).tolist() for i in (0, 1)]
    assert flags == [[1, 0, 1], [1, 1, 0]]  # layers 1, 3, 5 and 2, 4, 6: 3 and 6 global
    fresh = complete_buffers(cfg, {})["layers"]
    assert [np.asarray(fresh[f"block_{i}"]["attn"]["local"]).tolist() for i in (0, 1)] == flags


def test_flags_of_dense_first_blocks_and_of_the_mixtures():
    """DeepSeek's ``moe.first_dense`` blocks are the model's first layers: layer 1 is the
    ``dense_layers`` stack's, layers 2..5 are ``layers``'s (global: 2 and 4)."""
    from jaxpar.config import ModelConfig, MoEConfig
    from jaxpar.model.transformer import complete_buffers, initial_buffers

    cfg = ModelConfig(n_layers=5, sliding_window=4, global_every=2,
                      moe=MoEConfig(num_experts=4, top_k=2, first_dense=1))
    assert layer_is_local(cfg).tolist() == [1, 0, 1, 0, 1]
    buffers = nnx.to_pure_dict(nnx.split(create_model(cfg, 0), nnx.Param, ...)[2])

    def flags(tree):
        return [np.asarray(tree[s]["attn"]["local"]).tolist() for s in ("dense_layers", "layers")]
    assert flags(buffers) == [[1], [0, 1, 0, 1]]
    assert flags(complete_buffers(cfg, {})) == flags(buffers)
    assert flags(initial_buffers(cfg, buffers)) == flags(buffers)


def create_model_cfg(*overrides: str):
    from jaxpar.config import load_config
    return load_config("tiny", [*LAYOUT_BASE, *overrides]).model


# The default suite runs every layout but the ring inside pipeline stages (the same kernel as
# context=4's, on the piece the executor splits by hand): `pytest -m slow` runs it.
SLOW = {"1f1b,pipe=2,context=2,ring"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n
                                  for n in LAYOUTS])
def test_windowed_model_matches_one_device_on_layout(name):
    ref = run_layout(REFERENCE)
    got = run_layout((*LAYOUTS[name], *WINDOWED))
    assert abs(got["loss"] - ref["loss"]) / ref["loss"] < 1e-5
    grads, params = in_model_order(got)
    assert_grads_and_params_match({"grads": grads, "params": params}, ref)
    assert abs(got["last_loss"] - ref["last_loss"]) / ref["last_loss"] < 1e-5


# --------------------------------------------------------------------------------------------
# Generation with prompts longer than the window

GEN = dataclasses.replace(GENERATION_MODEL, sliding_window=6, global_every=2, attn_softcap=5.0,
                          attention_block=16)
PROMPTS = [[0, 200, *range(3, 19), 42], [0, 7, 9]]  # 19 tokens: past the window, two blocks


@functools.cache
def windowed_model():
    return create_model(GEN, seed=0)


def test_cached_generation_with_a_window_equals_the_uncached_forward():
    want = [greedy_by_full_forward(windowed_model(), p, 16) for p in PROMPTS]
    assert all(len(set(w)) > 4 for w in want), want
    assert generate(windowed_model(), PROMPTS, max_tokens=16) == want
