"""Context parallelism on its own: ring / all-gather / Ulysses / hybrid attention against dense
attention, and the memory it saves; Ulysses and the hybrid in whole train steps against one
device, and their collectives. The load-balanced schedule is in
tests/unit/test_context_schedule.py, the command line in tests/integration/test_context_cli.py,
the ring's full-model equivalence and HLO collectives in test_parallel_layouts.py."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    assert_grads_and_params_match,
    compiled_temp_bytes,
    in_model_order,
    run_layout,
)
from jax.sharding import PartitionSpec as P

from jaxpar.config import load_config, validate
from jaxpar.mesh import make_mesh
from jaxpar.parallel.context import context_attention, zigzag_order
from jaxpar.parallel.ulysses import local_ulysses_attention, ulysses_attention
from jaxpar.train.step import build_trainer

B, S, D = 2, 32, 8


def dense_causal_attention(q, k, v):
    """Plain softmax(QK^T)V over the whole sequence, kv heads repeated for GQA."""
    groups = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    scores = jnp.einsum("bshd,bthd->bhst", q, k) / np.sqrt(q.shape[-1])
    scores = jnp.where(np.tril(np.ones((q.shape[1],) * 2, bool)), scores, -jnp.inf)
    return jnp.einsum("bhst,bthd->bshd", jax.nn.softmax(scores, -1), v)


@pytest.mark.parametrize("impl", ["ring", "allgather"])
@pytest.mark.parametrize("n,heads,kv_heads,zigzag", [
    (2, 4, 4, True), (4, 4, 2, True), (8, 4, 1, True), (4, 4, 4, False), (8, 8, 2, False)],
    ids=["n2-mha", "n4-gqa", "n8-mqa", "n4-mha-contiguous", "n8-gqa-contiguous"])
def test_context_attention_matches_dense_causal_attention_and_gradients(impl, n, heads,
                                                                        kv_heads, zigzag):
    rng = np.random.default_rng(n * 10 + heads + kv_heads)
    q = rng.normal(size=(B, S, heads, D)).astype(np.float32)
    k = rng.normal(size=(B, S, kv_heads, D)).astype(np.float32)
    v = rng.normal(size=(B, S, kv_heads, D)).astype(np.float32)
    weights = rng.normal(size=(B, S, heads, D)).astype(np.float32)  # a loss that differs per token
    order = zigzag_order(S, n) if zigzag else np.arange(S)
    positions = np.broadcast_to(order, (B, S)).astype(np.int32)
    mesh = jax.make_mesh((n,), ("context",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:n])
    attention = context_attention(impl, n, zigzag)

    def loss(q, k, v):
        return jnp.sum(attention(q, k, v, positions) * weights[:, order])

    def dense_loss(q, k, v):
        return jnp.sum(dense_causal_attention(q, k, v) * weights)

    with jax.set_mesh(mesh):
        out = jax.jit(attention)(q[:, order], k[:, order], v[:, order], positions)
        grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q[:, order], k[:, order], v[:, order])
    np.testing.assert_allclose(out, np.asarray(dense_causal_attention(q, k, v))[:, order],
                               atol=1e-5, rtol=0)
    dense_grads = jax.grad(dense_loss, argnums=(0, 1, 2))(q, k, v)
    for got, want in zip(grads, dense_grads, strict=True):
        np.testing.assert_allclose(got, np.asarray(want)[:, order], atol=1e-5, rtol=0)


def attention_matches_dense(attention, mesh, n, heads, kv_heads, zigzag, seed, shard=None,
                            S=S):  # noqa: N803 (the module's S)
    """``attention`` (over ``context`` of ``mesh``) against dense causal attention, output and
    gradients, tokens in the layout's order; ``shard``: how q, k, v are laid out on ``mesh``."""
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(B, S, heads, D)).astype(np.float32)
    k = rng.normal(size=(B, S, kv_heads, D)).astype(np.float32)
    v = rng.normal(size=(B, S, kv_heads, D)).astype(np.float32)
    weights = rng.normal(size=(B, S, heads, D)).astype(np.float32)
    order = zigzag_order(S, n) if zigzag else np.arange(S)
    positions = np.broadcast_to(order, (B, S)).astype(np.int32)
    inputs = [a[:, order] for a in (q, k, v)]
    if shard is not None:
        inputs = [jax.device_put(a, jax.sharding.NamedSharding(mesh, shard)) for a in inputs]

    def loss(q, k, v):
        return jnp.sum(attention(q, k, v, positions) * weights[:, order])

    def dense_loss(q, k, v):
        return jnp.sum(dense_causal_attention(q, k, v) * weights)

    with jax.set_mesh(mesh):
        out = jax.jit(attention)(*inputs, positions)
        grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*inputs)
    np.testing.assert_allclose(out, np.asarray(dense_causal_attention(q, k, v))[:, order],
                               atol=1e-5, rtol=0)
    for got, want in zip(grads, jax.grad(dense_loss, argnums=(0, 1, 2))(q, k, v), strict=True):
        np.testing.assert_allclose(got, np.asarray(want)[:, order], atol=1e-5, rtol=0)


def context_mesh(n: int, tensor: int = 1):
    return jax.make_mesh((n, tensor), ("context", "tensor"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 2,
                         devices=jax.devices()[:n * tensor])


@pytest.mark.parametrize("impl,n,size,heads,kv_heads,zigzag", [
    ("ulysses", 2, 2, 4, 4, True), ("ulysses", 4, 4, 4, 2, True), ("ulysses", 4, 4, 8, 1, False),
    ("ulysses", 8, 8, 8, 2, True), ("hybrid", 8, 2, 4, 2, True), ("hybrid", 8, 4, 8, 2, True),
    ("hybrid", 4, 2, 4, 4, False)],
    ids=["ulysses-n2-mha", "ulysses-n4-gqa-repeated", "ulysses-n4-mqa-contiguous",
         "ulysses-n8-gqa", "hybrid-n8-inner2", "hybrid-n8-inner4", "hybrid-n4-contiguous"])
def test_ulysses_and_hybrid_match_dense_causal_attention_and_gradients(impl, n, size, heads,
                                                                       kv_heads, zigzag):
    attention = ulysses_attention(n, size, zigzag)
    attention_matches_dense(attention, context_mesh(n), n, heads, kv_heads, zigzag,
                            seed=n * 10 + heads + kv_heads)


@pytest.mark.parametrize("impl", ["ulysses", "hybrid"])
@pytest.mark.parametrize("heads_by", ["manual", "reshaped"])
def test_ulysses_splits_heads_over_tensor_and_context(impl, heads_by):
    """Heads split over ``tensor`` and ``context`` (the all-to-all): 8 query heads, 2 kv heads,
    tensor=2, context=4 (hybrid: 2 x 2), so each tensor shard's one kv head is repeated to the
    exchange's size. ``manual``: tensor manual in the shard_map (the train step's way);
    ``reshaped``: tensor automatic, the head axis reshaped so that each device exchanges its
    own tensor shard's heads (a TPU pipeline stage's way: no nested shard_map)."""
    n = 4
    size = n if impl == "ulysses" else 2
    spec = jax.sharding.PartitionSpec(None, "context", "tensor", None)
    if heads_by == "manual":
        attention = ulysses_attention(n, size, True, head_axes=("tensor",))
    else:
        local = local_ulysses_attention(n, size, True, head_split=2)
        seq4 = jax.sharding.PartitionSpec(None, "context", None, None)
        attention = jax.shard_map(local, in_specs=(seq4,) * 3 + (P(None, "context"),),
                                  out_specs=seq4, axis_names=frozenset({"context"}))
    attention_matches_dense(attention, context_mesh(n, 2), n, 8, 2, True, seed=3, shard=spec)


def test_ulysses_runs_a_one_device_kernel_on_the_whole_sequence():
    """A Pallas kernel (splash, in its interpreter) as Ulysses' kernel: every mesh axis is
    manual around it (``one_device_kernel``), here ``data`` too, which the layout would leave
    automatic; 256 tokens (its 128-token tiles) in zigzag order over context=2."""
    from jaxpar.model.fused import splash_attention

    n = 2
    attention = ulysses_attention(n, n, True, kernel=splash_attention(128, interpret=True),
                                  one_device_kernel=True)
    mesh = jax.make_mesh((2, n), ("data", "context"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 2, devices=jax.devices()[:4])
    attention_matches_dense(attention, mesh, n, 4, 2, True, seed=5, S=256)


def long_sequence_temp_bytes(*overrides: str, devices: int) -> int:
    cfg = load_config("tiny", ["train.batch_size=1", "train.seq_len=2048", *overrides])
    return compiled_temp_bytes(validate(cfg, devices), devices)


def test_context_parallelism_cuts_activation_memory_of_a_long_sequence():
    single = long_sequence_temp_bytes("mesh.data=1", devices=1)
    ring = long_sequence_temp_bytes("mesh.data=1", "mesh.context=4", devices=4)
    assert ring <= 0.4 * single, (ring, single)


@pytest.mark.parametrize("overrides,devices", [
    (["mesh.data=1"], 1),
    (["mesh.data=1", "mesh.context=4"], 4),
    (["mesh.data=1", "mesh.context=4", "parallel.context_impl=allgather"], 4),
], ids=["one-device", "ring", "allgather"])
def test_step_memory_grows_linearly_with_the_sequence(overrides, devices):
    """One sequence, remat=none: 4x the tokens costs at most 5x the temp memory (linear would
    be 4, an S x S score matrix 16). Measured 2.2 (blockwise), 3.9 (ring), 3.9 (all-gather)."""
    short, long = (long_sequence_temp_bytes(f"train.seq_len={s}", "train.remat=none",
                                            *overrides, devices=devices) for s in (2048, 8192))
    assert long / short <= 5, (short, long)


def one_step_loss_and_grads(*overrides: str, devices: int):
    cfg = load_config("tiny", ["train.batch_size=4", "train.seq_len=32", *overrides])
    cfg = validate(cfg, devices)
    trainer = build_trainer(cfg, make_mesh(cfg, devices=jax.devices()[:devices]))
    rng = np.random.default_rng(7)
    shape = (4, 32)
    batch = trainer.put_batch({
        "inputs": rng.integers(0, 256, shape, dtype=np.int32),
        "targets": rng.integers(0, 256, shape, dtype=np.int32),
        "mask": np.ones(shape, np.float32)})
    loss, grads = trainer.loss_and_grads(trainer.init(), batch)
    return float(loss), jax.tree.map(np.asarray, grads)


@pytest.mark.parametrize("remat", ["full", "dots"])
def test_ring_attention_under_remat_matches_the_single_device_run(remat):
    ref_loss, ref_grads = one_step_loss_and_grads("mesh.data=1", devices=1)
    loss, grads = one_step_loss_and_grads("mesh.data=1", "mesh.context=2",
                                          f"train.remat={remat}", devices=2)
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
                 grads, ref_grads)


def test_ring_attention_in_bfloat16_stays_close_to_float32():
    ref_loss, _ = one_step_loss_and_grads("mesh.data=1", devices=1)
    loss, grads = one_step_loss_and_grads("mesh.data=1", "mesh.context=4", "train.dtype=bfloat16",
                                          devices=4)
    assert loss == pytest.approx(ref_loss, rel=1e-2)
    assert all(np.isfinite(g).all() for g in jax.tree.leaves(grads))


    # The gradient reduction over data x context is one all-reduce in the plan; XLA:CPU splits it
    # into one over context and one over data, which --compare shows as rows on one side only.


def test_ppermute_in_order_delivers_each_array_and_chains_the_sends():
    """Two sends over one axis in opposite directions arrive where their permutations say, and
    lowered step ties the second to the first with a barrier (parallel/point_to_point.py: XLA
    removes it after scheduling, so only the lowered program shows it)."""
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    from jaxpar.parallel.point_to_point import ppermute_in_order

    n = 4
    mesh = Mesh(np.array(jax.devices()[:n]), ("x",))
    up, down = [(i, (i + 1) % n) for i in range(n)], [(i, (i - 1) % n) for i in range(n)]
    step = jax.jit(jax.shard_map(lambda a, b: tuple(ppermute_in_order([a, b], "x", [up, down])),
                                 mesh=mesh, in_specs=(P("x"), P("x")), out_specs=(P("x"), P("x"))))
    a = jnp.arange(n, dtype=jnp.float32)
    b = 10 * jnp.arange(n, dtype=jnp.float32)
    got_a, got_b = step(a, b)
    np.testing.assert_array_equal(got_a, np.roll(np.asarray(a), 1))
    np.testing.assert_array_equal(got_b, np.roll(np.asarray(b), -1))
    assert "optimization_barrier" in step.lower(a, b).as_text()


# --------------------------------------------------------------------------------------------
# Ulysses and the hybrid in the whole train step, against one device (helpers.run_layout:
# 3 steps of 8 x 32 tokens of tiny, 8 query heads, 4 kv heads)

ULYSSES = "parallel.context_impl=ulysses"
HYBRID = ("parallel.context_impl=hybrid", "parallel.ulysses_size=4")
WHOLE_STEP = {
    "context=2,ulysses": ("mesh.data=1", "mesh.context=2", ULYSSES),
    "data=2,context=4,ulysses": ("mesh.data=2", "mesh.context=4", ULYSSES),
    # 8 heads over tensor x context = 2 x 2; each tensor shard's 2 kv heads split 2 ways.
    "data=2,context=2,tensor=2,ulysses": ("mesh.data=2", "mesh.context=2", "mesh.tensor=2",
                                          ULYSSES),
    # ... and with the layers in pipeline stages, where context is manual already.
    "1f1b,pipe=2,context=2,tensor=2,ulysses": (
        "mesh.pipe=2", "mesh.data=1", "mesh.context=2", "mesh.tensor=2", ULYSSES,
        "train.microbatches=2", "parallel.pipeline_schedule=1f1b"),
    # Ulysses in groups of 4 consecutive context devices, the ring over the 2 groups.
    "context=8,hybrid=4x2": ("mesh.data=1", "mesh.context=8", *HYBRID),
}
SLOW_WHOLE_STEP = {
    "mla,context=4,ulysses": ("mesh.data=1", "mesh.context=4", ULYSSES),
    "mla,context=4,hybrid=2x2": ("mesh.data=1", "mesh.context=4",
                                 "parallel.context_impl=hybrid", "parallel.ulysses_size=2"),
}


def whole_step(name: str) -> dict:
    return run_layout(tuple(WHOLE_STEP[name]))


@pytest.mark.parametrize("name", list(WHOLE_STEP))
def test_ulysses_and_hybrid_train_steps_match_one_device(name):
    got, ref = whole_step(name), run_layout(("mesh.data=1",))
    assert abs(got["loss"] - ref["loss"]) / ref["loss"] < 1e-5
    grads, params = in_model_order(got)
    assert_grads_and_params_match({"grads": grads, "params": params}, ref)
    assert abs(got["last_loss"] - ref["last_loss"]) / ref["last_loss"] < 1e-5


def context_collectives(result: dict, kind: str) -> list:
    return [c for c in result["collectives"] if c.kind == kind and c.axes == ("context",)]


@pytest.mark.parametrize("name", ["data=2,context=4,ulysses", "data=2,context=2,tensor=2,ulysses"])
def test_ulysses_exchanges_heads_by_all_to_all_and_never_gathers_or_rotates_kv(name):
    result = whole_step(name)
    cfg = result["cfg"]
    exchanges = context_collectives(result, "all-to-all")
    # q, k, v and the output, forward and backward, in every layer.
    assert sum(c.executions for c in exchanges) >= 8 * cfg.model.n_layers, exchanges
    assert {c.group_size for c in exchanges} == {cfg.mesh.context}
    assert not context_collectives(result, "collective-permute")
    # Only the masks' int32 positions are gathered over context, never K or V.
    gathers = context_collectives(result, "all-gather")
    assert {c.dtype for c in gathers} <= {"s32"}, gathers
    # Heads split over tensor too: the exchange moves no heads between tensor shards.
    assert not [c for c in result["collectives"] if "tensor" in c.axes
                and c.kind in ("all-to-all", "all-gather", "collective-permute")]


def test_hybrid_all_to_alls_in_groups_and_rings_between_them():
    """context=8, ulysses_size=4: the all-to-alls' replica groups are the two runs of 4
    consecutive devices, the collective-permutes step by 4 (device i -> i + 4 mod 8)."""
    result = whole_step("context=8,hybrid=4x2")
    layers = result["cfg"].model.n_layers
    exchanges = context_collectives(result, "all-to-all")
    assert sum(c.executions for c in exchanges) >= 8 * layers, exchanges
    assert {c.group_size for c in exchanges} == {4}
    permutes = context_collectives(result, "collective-permute")
    # K, V and the mask hop once forward; K, V, the mask, dK and dV twice backward.
    assert sum(c.executions for c in permutes) >= 2 * 3 * layers, permutes
    assert {c.group_size for c in permutes} == {2}
    hlo = result["hlo"]
    groups = {m for line in hlo.splitlines() if "all-to-all(" in line
              for m in re.findall(r"replica_groups=(\S+?),? ", line)}
    assert groups and groups <= {"{{0,1,2,3},{4,5,6,7}}", "[2,4]<=[8]"}, groups
    pairs = [tuple(map(int, p)) for line in hlo.splitlines() if "collective-permute" in line
             and "source_target_pairs" in line
             for p in re.findall(r"\{(\d+),(\d+)\}", line.split("source_target_pairs=")[1])]
    assert pairs and all((b - a) % 8 == 4 for a, b in pairs), pairs
    assert not [c for c in context_collectives(result, "all-gather") if c.dtype != "s32"]


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [
    ("mesh.data=1", "mesh.fsdp=2", "mesh.context=2", "mesh.tensor=2",
     "parallel.sequence_parallel=true", ULYSSES),
    ("mesh.data=1", "mesh.context=4", "mesh.tensor=2", "parallel.context_impl=hybrid",
     "parallel.ulysses_size=2", "train.remat=full"),
    ("mesh.data=2", "mesh.context=4", ULYSSES, "parallel.zigzag=false", "train.loss_pieces=4"),
], ids=["fsdp,tensor,sp", "hybrid,tensor,remat=full", "contiguous,loss_pieces"])
def test_ulysses_and_hybrid_in_more_compositions_match_one_device(overrides):
    got, ref = run_layout(overrides), run_layout(("mesh.data=1",))
    assert abs(got["loss"] - ref["loss"]) / ref["loss"] < 1e-5
    grads, params = in_model_order(got)
    assert_grads_and_params_match({"grads": grads, "params": params}, ref)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SLOW_WHOLE_STEP))
def test_ulysses_and_hybrid_with_latent_attention_match_one_device(name):
    """Multi-head latent attention (v padded to the query head dim) through the exchange."""
    mla = ("model.mla.q_lora_rank=24", "model.mla.kv_lora_rank=16",
           "model.mla.qk_nope_head_dim=8", "model.mla.qk_rope_head_dim=8",
           "model.mla.v_head_dim=12")
    got = run_layout((*SLOW_WHOLE_STEP[name], *mla))
    ref = run_layout(("mesh.data=1", *mla))
    assert abs(got["loss"] - ref["loss"]) / ref["loss"] < 1e-5
    assert_grads_and_params_match(got, ref)


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [
    ("mesh.data=1", "mesh.context=4", ULYSSES),
    ("mesh.data=1", "mesh.context=4", "parallel.context_impl=hybrid", "parallel.ulysses_size=2"),
], ids=["ulysses", "hybrid"])
def test_ulysses_and_hybrid_with_experts_match_one_device(overrides):
    from helpers import MOE_LAYOUT_BASE

    got = run_layout(overrides, "moe-tiny", tuple(MOE_LAYOUT_BASE))
    ref = run_layout(("mesh.data=1",), "moe-tiny", tuple(MOE_LAYOUT_BASE))
    assert abs(got["loss"] - ref["loss"]) / ref["loss"] < 1e-5
    assert_grads_and_params_match(got, ref)
