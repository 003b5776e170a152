"""Mixture of experts and expert parallelism.

Layer level (small jitted functions): the MoE layer against the per-token definition, dropping
against a hand count, degenerate routings, the aux-loss-free bias, the ragged exchange against an
emulation of ``ragged_all_to_all``. Trainer level (each layout compiled once, shared): every
expert-parallel layout against the single-device run, the all-to-alls in the compiled step, and
``jaxpar plan`` against the compiled step. Inputs differ per position, so a misrouted token or a
misplaced row cannot pass by symmetry. The plan by hand and the layer stack, without a compile:
``tests/unit/test_moe_plan.py``.
"""

from __future__ import annotations

import functools
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import MOE_LAYOUT_BASE as BASE
from helpers import (
    assert_grads_and_params_match,
    assert_params_moved,
    emulated_ragged_all_to_all,
    make_batches,
)

import jaxpar.parallel.expert as expert_module
from jaxpar.config import MoEConfig, load_config, validate
from jaxpar.cost.estimate import estimate
from jaxpar.inspect.compare import compare_with_plan
from jaxpar.inspect.report import build_report
from jaxpar.mesh import make_mesh
from jaxpar.model.annotate import layout_with
from jaxpar.model.moe import MoE, update_router_bias
from jaxpar.parallel.expert import expert_parallel
from jaxpar.parallel.rules import logical_rules
from jaxpar.train.compiled import CompiledStep
from jaxpar.train.step import build_trainer

# --------------------------------------------------------------------------------------------
# Layer level

B, S = 4, 8  # 32 tokens: divisible over 4 expert-parallel devices


def make_layer(*overrides: str, seed: int = 0) -> tuple[MoE, MoEConfig]:
    """A MoE layer of moe-tiny (4 experts, top-2, d_model 64, d_ff_expert 64), with weights
    large enough (init_std 0.3) that outputs and gradients are O(1)."""
    cfg = load_config("moe-tiny", ["model.init_std=0.3", *overrides]).model
    with nnx.use_eager_sharding(False):
        return MoE(cfg, nnx.Rngs(params=seed)), cfg.moe


def split(layer: MoE):
    graphdef, params, buffers = nnx.split(layer, nnx.Param, ...)
    return graphdef, nnx.to_pure_dict(params), nnx.to_pure_dict(buffers)


def tokens(seed: int = 1, batch: int = B) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(batch, S, 64)).astype(np.float32)


def expert_mesh(groups: int, ragged: bool = False):
    """A mesh of ``groups`` devices on the ``expert`` axis, and the expert-parallel hook for it
    (as the train step builds it; ``ragged`` picks the ragged_all_to_all exchange)."""
    cfg = validate(load_config("moe-tiny", [f"mesh.expert={groups}", "mesh.data=1"]), groups)
    hook = expert_parallel(cfg.mesh_shape, logical_rules(cfg), ragged=ragged)
    return make_mesh(cfg, devices=jax.devices()[:groups]), hook


def run_layer(layer: MoE, x: np.ndarray, weights: np.ndarray | None = None, *, mesh=None,
              hook=None):
    """(y, aux, grads of sum(y * weights) wrt params and x), on one device or through ``hook``
    on ``mesh``."""
    graphdef, params, buffers = split(layer)
    weights = np.ones_like(x) if weights is None else weights

    def loss(params, x):
        y, aux = nnx.merge(graphdef, params, buffers)(x)
        return jnp.sum(y * weights), (y, aux)

    fn = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))
    if mesh is None:
        grads, (y, aux) = fn(params, x)
    else:
        with jax.set_mesh(mesh), layout_with(experts=hook):
            grads, (y, aux) = fn(params, x)
    return np.asarray(y), jax.tree.map(np.asarray, aux), jax.tree.map(np.asarray, grads)


def router_scores(params: dict, x: np.ndarray, router: str, bias=None) -> np.ndarray:
    logits = x.reshape(-1, x.shape[-1]).astype(np.float64) @ np.asarray(params["router"])
    if router == "softmax":
        e = np.exp(logits - logits.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)
    scores = 1 / (1 + np.exp(-logits))
    return scores if bias is None else scores + np.asarray(bias)


def choose(params: dict, x: np.ndarray, moe, bias=None) -> np.ndarray:
    """[T, k] experts per token, by numpy: highest score first, ties to the lower index."""
    scores = router_scores(params, x, moe.router, bias)
    return np.argsort(-scores, axis=-1, kind="stable")[:, :moe.top_k]


def naive_moe(params: dict, x, chosen: np.ndarray, moe, keep: np.ndarray | None = None):
    """The definition for one token, y = sum_j gate_j * SwiGLU_{e_j}(x) (+ shared experts),
    applied token by token (``vmap`` over the tokens: the same per-token program, compiled
    once). ``chosen`` [T, k] is fixed (selection has no gradient); ``keep`` masks dropped slots.
    """
    keep = np.ones(chosen.shape, bool) if keep is None else keep

    def one_token(xt, experts, kept):
        logits = xt @ params["router"]
        if moe.router == "softmax":
            gates = jax.nn.softmax(logits)[experts]
        else:
            s = jax.nn.sigmoid(logits)[experts]
            gates = s / jnp.sum(s)
        y = jnp.zeros_like(xt)
        for j in range(experts.shape[0]):  # the token's k experts, one after the other
            w_gate, w_up = params["w_gate"][experts[j]], params["w_up"][experts[j]]
            hidden = jax.nn.silu(xt @ w_gate) * (xt @ w_up)
            y = y + jnp.where(kept[j], gates[j], 0.0) * (hidden @ params["w_down"][experts[j]])
        if "shared" in params:
            sh = params["shared"]
            y = y + (jax.nn.silu(xt @ sh["w_gate"]) * (xt @ sh["w_up"])) @ sh["w_down"]
        return y

    flat = x.reshape(-1, x.shape[-1])
    return jax.vmap(one_token)(flat, jnp.asarray(chosen), jnp.asarray(keep)).reshape(x.shape)


def naive_grads(params, x, weights, chosen, moe, keep=None):
    def loss(params, x):
        return jnp.sum(naive_moe(params, x, chosen, moe, keep) * weights)

    return jax.tree.map(np.asarray, jax.jit(jax.grad(loss, argnums=(0, 1)))(params, x))


def assert_close(got, want, tol: float = 1e-5):
    """Max absolute error within ``tol`` of the reference's largest magnitude, leaf by leaf."""
    def check(path, a, b):
        scale = max(float(np.max(np.abs(b))), 1e-6)
        err = float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
        assert err <= tol * scale, (jax.tree_util.keystr(path), err, scale)

    jax.tree_util.tree_map_with_path(check, got, want)


@pytest.mark.parametrize("overrides", [
    [],
    ["model.moe.router=sigmoid_bias", "model.moe.num_shared_experts=1"],
], ids=["softmax", "sigmoid_bias+shared"])
def test_dropless_layer_matches_naive_per_token_reference(overrides):
    layer, moe = make_layer(*overrides)
    if moe.router == "sigmoid_bias":  # a bias that changes some choices, as training would
        layer.router_bias[...] = jnp.asarray([0.3, -0.2, 0.1, 0.0], jnp.float32)
    _, params, buffers = split(layer)
    bias = buffers.get("router_bias")
    x = tokens()
    w = np.random.default_rng(2).normal(size=x.shape).astype(np.float32)
    y, aux, grads = run_layer(layer, x, w)
    chosen = choose(params, x, moe, bias)
    if bias is not None:  # the bias moved at least one choice away from the plain top-k
        assert (chosen != choose(params, x, moe)).any()
    assert_close(y, naive_moe(params, x, chosen, moe))
    assert_close(grads, naive_grads(params, x, w, chosen, moe))
    # Statistics by hand: slots per expert, the Switch balance loss and the z-loss.
    counts = np.bincount(chosen.ravel(), minlength=4)
    np.testing.assert_array_equal(aux["layer_expert_tokens"], counts)
    scores = router_scores(params, x, moe.router)
    probs = scores / scores.sum(-1, keepdims=True)
    balance = 4 * np.sum(counts / chosen.size * probs.mean(0))
    assert aux["aux_loss"] == pytest.approx(balance, rel=1e-5)
    logits = x.reshape(-1, 64).astype(np.float64) @ np.asarray(params["router"])
    lse = np.log(np.exp(logits).sum(-1))
    assert aux["z_loss"] == pytest.approx(np.mean(lse**2), rel=1e-5)
    assert aux["dropped"] == 0 and aux["routed"] == chosen.size


def skewed_tokens(fraction: float, seed: int = 3, batch: int = B) -> np.ndarray:
    """Tokens whose feature 0 is +2 for ``fraction`` of them, -2 for the rest, in a shuffled
    order; with :func:`skew_router`, the +2 ones prefer its expert."""
    x = tokens(seed, batch)
    rng = np.random.default_rng(seed)
    n = batch * S
    x[..., 0] = np.where(rng.permutation(n) < fraction * n, 2.0, -2.0).reshape(batch, S)
    return x


def skew_router(layer: MoE, expert: int, strength: float, noise: float = 0.1) -> None:
    """Feature 0 (+-2, see skewed_tokens) adds +-2 x ``strength`` to ``expert``'s logit; the
    other features' weights are scaled by ``noise``, so the preference is clear but the gates
    stay away from saturation (where float32 gradients lose their relative precision)."""
    router = np.array(layer.router[...]) * noise
    router[0, :] = 0.0
    router[0, expert] = strength
    layer.router[...] = jnp.asarray(router)


def hand_dropping(chosen: np.ndarray, capacity: int, experts: int) -> np.ndarray:
    """Which slots fit: first choices of all tokens in token order, then second choices..."""
    keep = np.zeros(chosen.shape, bool)
    used = np.zeros(experts, int)
    for j in range(chosen.shape[1]):
        for t in range(chosen.shape[0]):
            if used[chosen[t, j]] < capacity:
                keep[t, j] = True
                used[chosen[t, j]] += 1
    return keep


@pytest.mark.parametrize("top_k,groups", [(1, 1), (2, 2)], ids=["top1-one-device",
                                                                  "top2-expert=2"])
def test_dropping_reports_the_hand_counted_drops_and_dropped_tokens_pass_through(top_k, groups):
    layer, moe = make_layer("model.moe.dispatch=dropping", "model.moe.capacity_factor=1.0",
                            f"model.moe.top_k={top_k}")
    skew_router(layer, expert=0, strength=2.0)
    _, params, _ = split(layer)
    x = skewed_tokens(0.75)
    chosen = choose(params, x, moe)
    # Each device routes its own rows (T = 32 / groups tokens) with its own capacity.
    per_device = B * S // groups
    capacity = moe.capacity(per_device)
    assert capacity == math.ceil(per_device * top_k / 4)
    keep = np.concatenate([hand_dropping(chosen[d * per_device:(d + 1) * per_device],
                                         capacity, 4) for d in range(groups)])
    assert (~keep).sum() >= per_device // 4  # the skew really overflows expert 0
    if groups == 1:
        y, aux, grads = run_layer(layer, x)
    else:
        mesh, hook = expert_mesh(groups)
        y, aux, grads = run_layer(layer, x, mesh=mesh, hook=hook)
    assert aux["dropped"] == (~keep).sum()
    assert_close(y, naive_moe(params, x, chosen, moe, keep))
    assert_close(grads, naive_grads(params, x, np.ones_like(x), chosen, moe, keep))
    # A token none of whose slots fit gets exactly zero from the layer: the block's residual
    # connection passes it through unchanged. (Top-1 makes such tokens certain here.)
    gone = ~keep.any(axis=1)
    assert gone.sum() > 0 or top_k > 1
    assert np.all(y.reshape(-1, 64)[gone] == 0.0)
    assert np.all(y.reshape(-1, 64)[~gone].any(axis=1))


@pytest.mark.parametrize("exchange", ["padded", "ragged"])
def test_expert_parallel_dropless_layer_matches_the_reference(exchange, monkeypatch):
    """Experts over 2 devices (two each), rows exchanged with the padded all-to-all, or with
    ``ragged_all_to_all``'s offsets computed as on GPU/TPU and the collective emulated."""
    layer, moe = make_layer("model.moe.num_shared_experts=1")
    _, params, _ = split(layer)
    x = tokens(5)
    w = np.random.default_rng(6).normal(size=x.shape).astype(np.float32)
    mesh, hook = expert_mesh(2, ragged=exchange == "ragged")
    if exchange == "ragged":
        monkeypatch.setattr(expert_module, "ragged_all_to_all", emulated_ragged_all_to_all(2))
    y, aux, grads = run_layer(layer, x, w, mesh=mesh, hook=hook)
    chosen = choose(params, x, moe)
    assert_close(y, naive_moe(params, x, chosen, moe))
    assert_close(grads, naive_grads(params, x, w, chosen, moe))
    slots = B * S * moe.top_k
    if exchange == "padded":  # each of 2 devices sends 2 blocks of T x min(k, X/2 = 2) rows
        assert aux["a2a_rows"] == 2 * 2 * (B * S // 2) * 2
        assert aux["a2a_padding"] == aux["a2a_rows"] - slots
    else:
        assert aux["a2a_rows"] == slots and aux["a2a_padding"] == 0


@pytest.mark.parametrize("placement", ["one-device", "expert=4"])
@pytest.mark.parametrize("dispatch,factor", [("dropless", 1.25), ("dropping", 1.25)])
def test_every_token_on_one_expert_and_idle_experts(dispatch, factor, placement):
    """top-1 routing that sends every token to expert 2: experts 0, 1 and 3 get nothing (and
    under expert=4, three devices receive only padding); dropping keeps the first C tokens."""
    layer, moe = make_layer(f"model.moe.dispatch={dispatch}",
                            f"model.moe.capacity_factor={factor}", "model.moe.top_k=1")
    skew_router(layer, expert=2, strength=2.0)
    _, params, _ = split(layer)
    x = skewed_tokens(1.0)
    chosen = choose(params, x, moe)
    assert (chosen == 2).all()
    groups = 1 if placement == "one-device" else 4
    per_device = B * S // groups
    keep = np.ones(chosen.shape, bool)
    if dispatch == "dropping":
        keep = np.concatenate([hand_dropping(chosen[d * per_device:(d + 1) * per_device],
                                             moe.capacity(per_device), 4)
                               for d in range(groups)])
        assert not keep.all()
    if groups == 1:
        y, aux, grads = run_layer(layer, x)
    else:
        mesh, hook = expert_mesh(groups)
        y, aux, grads = run_layer(layer, x, mesh=mesh, hook=hook)
    np.testing.assert_array_equal(aux["layer_expert_tokens"], [0, 0, B * S, 0])
    assert aux["dropped"] == (~keep).sum()
    assert_close(y, naive_moe(params, x, chosen, moe, keep))
    assert_close(grads, naive_grads(params, x, np.ones_like(x), chosen, moe, keep))
    for name in ("w_gate", "w_up", "w_down"):  # idle experts get exactly zero gradient
        assert np.all(grads[0][name][[0, 1, 3]] == 0.0) and np.any(grads[0][name][2] != 0.0)


def load_ratio(counts: np.ndarray) -> float:
    return float(counts.max() / counts.min())


def test_aux_loss_free_bias_update_balances_a_skewed_router():
    """Expert 0 starts with most of the load; nudging the bias by the sign of (mean - load)
    after every step (no loss term, no gradient) evens the load out."""
    layer, moe = make_layer("model.moe.router=sigmoid_bias")
    skew_router(layer, expert=0, strength=1.5)
    graphdef, params, buffers = split(layer)
    x = skewed_tokens(0.9, batch=16)  # 256 tokens, 512 slots: a load fine-grained enough

    @jax.jit
    def load(bias):
        _, aux = nnx.merge(graphdef, params, {"router_bias": bias})(x)
        return aux["layer_expert_tokens"]

    bias = jnp.asarray(buffers["router_bias"])
    ratios = []
    for _ in range(150):
        counts = load(bias)
        ratios.append(load_ratio(np.asarray(counts)))
        bias = update_router_bias(bias[None], counts[None], rate=0.01)[0]
    assert ratios[0] > 2.5, ratios[0]
    assert np.mean(ratios[-20:]) < 1.5, ratios[-20:]
    assert np.mean(ratios[-20:]) < ratios[0] / 2


# --------------------------------------------------------------------------------------------
# Trainer level: expert-parallel layouts against the single-device run

# BASE (helpers.MOE_LAYOUT_BASE): 3 steps of 8 x 32 tokens, eps=1e-6 (see helpers.LAYOUT_BASE),
# the sigmoid router with aux-loss-free balancing, which makes every layout also update (and
# route with) the router biases, which must agree across layouts.
REFERENCE = ("mesh.data=1",)
LAYOUTS = {
    "expert=4": ("mesh.data=1", "mesh.expert=4"),
    # Each device's tokens in two chunks, each dispatched and combined on its own.
    "expert=4,chunks=2": ("mesh.data=1", "mesh.expert=4", "parallel.expert_pieces=2"),
    "data=2,expert=2,tensor=2": ("mesh.data=2", "mesh.expert=2", "mesh.tensor=2"),
    # The experts' weights, and the others (split over tensor too), gathered in rings of sends.
    "fsdp=2,expert=2,tensor=2,ring": ("mesh.data=1", "mesh.fsdp=2", "mesh.expert=2",
                                      "mesh.tensor=2", "parallel.fsdp_gather=ring"),
    "data=2,expert=2,context=2": ("mesh.data=2", "mesh.expert=2", "mesh.context=2"),
    # Dropping with capacity_factor 2 = X/k: C = T, nothing can drop, so it computes the same
    # function as the dropless reference.
    "fsdp=2,expert=2,tensor=2,sp,dropping": (
        "mesh.data=1", "mesh.fsdp=2", "mesh.expert=2", "mesh.tensor=2",
        "parallel.sequence_parallel=true", "model.moe.dispatch=dropping",
        "model.moe.capacity_factor=2.0"),
}


@functools.cache
def run_layout(overrides: tuple[str, ...]) -> dict:
    cfg = load_config("moe-tiny", [*BASE, *overrides])
    n = math.prod(int(o.split("=")[1]) for o in overrides if o.startswith("mesh."))
    cfg = validate(cfg, n)
    trainer = build_trainer(cfg, make_mesh(cfg, devices=jax.devices()[:n]))
    batches = [trainer.put_batch(b) for b in make_batches(cfg)]
    state = trainer.init()
    loss, grads, aux = trainer.loss_grads_and_aux(state, batches[0])
    compiled = trainer.compile_step()
    history, buffers = [], [jax.tree.map(np.asarray, state.buffers)]
    for batch in batches:
        state, metrics = compiled(state, batch)
        history.append(jax.tree.map(np.asarray, metrics))
        buffers.append(jax.tree.map(np.asarray, state.buffers))
    return {"cfg": cfg, "trainer": trainer, "compiled": compiled, "state": state,
            "loss": float(loss), "grads": jax.tree.map(np.asarray, grads),
            "aux": jax.tree.map(np.asarray, aux), "metrics": history, "buffers": buffers,
            "params": jax.tree.map(np.asarray, state.params)}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_expert_parallel_layout_matches_single_device(name):
    got, ref = run_layout(LAYOUTS[name]), run_layout(REFERENCE)
    assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    assert_grads_and_params_match(got, ref)
    for mine, theirs in zip(got["metrics"], ref["metrics"], strict=True):
        for key in ("loss", "moe_aux_loss", "moe_z_loss"):
            assert mine[key] == pytest.approx(theirs[key], rel=1e-5), key
        np.testing.assert_array_equal(mine["expert_tokens"], theirs["expert_tokens"])
        assert mine["dropped_fraction"] == 0.0
    np.testing.assert_array_equal(got["aux"]["layer_expert_tokens"],
                                  ref["aux"]["layer_expert_tokens"])
    for mine, theirs in zip(got["buffers"], ref["buffers"], strict=True):  # router biases
        jax.tree.map(np.testing.assert_array_equal, mine, theirs)


def test_reference_run_routes_and_learns():
    """Guards the equivalence tests: real routing (every expert used, aux losses > 0), moving
    parameters, gradients reaching every expert."""
    ref = run_layout(REFERENCE)
    first = ref["metrics"][0]
    assert first["expert_tokens"].sum() == 8 * 32 * 2 * 2  # tokens x top_k x MoE layers
    assert first["expert_load_min_max"] > 0.5 and first["moe_aux_loss"] > 0.9
    assert_params_moved(ref)
    for name in ("w_gate", "w_up", "w_down"):
        per_expert = np.abs(ref["grads"]["layers"]["moe"][name]).sum(axis=(0, 2, 3))
        assert (per_expert > 0).all()


def all_to_all_lines(name: str) -> list[str]:
    text = run_layout(LAYOUTS[name])["compiled"].as_text()
    return [line for line in text.splitlines() if " all-to-all(" in line]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_all_to_all_over_expert_forward_and_backward(name):
    from jaxpar.cost.estimate import estimate
    from jaxpar.inspect.hlo.collectives import parse_collectives, summarize_collectives

    got = run_layout(LAYOUTS[name])
    cfg = got["cfg"]
    ops = [c for c in parse_collectives(got["compiled"].as_text(), cfg.mesh_shape)
           if c.kind == "all-to-all"]
    assert ops and all(c.axes == ("expert",) for c in ops)
    # Dispatch and combine, forward and backward, in every MoE layer.
    assert sum(c.executions for c in ops) >= 4 * cfg.model.n_moe_layers
    lines = all_to_all_lines(name)
    backward = [line for line in lines if "transpose(jvp" in line]
    assert len(backward) >= 2 and len(lines) - len(backward) >= 2, lines
    # Expert parallelism never gathers the tokens or the experts over `expert`: what is
    # gathered over it (and reduce-scattered) is FSDP's dense weights, split over expert as
    # over fsdp, and the plan, which counts only those, predicts its bytes.
    def over_expert(rows) -> int:
        return sum(r["bytes"] for r in rows if "expert" in r["axes"]
                   and r["kind"] in ("all-gather", "reduce-scatter"))

    compiled = over_expert(summarize_collectives(
        parse_collectives(got["compiled"].as_text(), cfg.mesh_shape)))
    predicted = over_expert(estimate(cfg).collective_rows())
    assert abs(compiled - predicted) <= 0.1 * predicted, (compiled, predicted)


def test_expert_chunks_exchange_each_chunk_on_its_own_with_the_same_bytes():
    """``parallel.expert_pieces=2``: twice the all-to-alls, each over half the tokens, so the
    compiler may run one chunk's exchange beside the other's experts; the bytes stay."""
    from jaxpar.inspect.hlo.collectives import parse_collectives

    def all_to_alls(name: str) -> tuple[int, int]:
        got = run_layout(LAYOUTS[name])
        ops = [c for c in parse_collectives(got["compiled"].as_text(), got["cfg"].mesh_shape)
               if c.kind == "all-to-all"]
        return (sum(c.executions for c in ops),
                sum(c.executions * c.bytes for c in ops))

    (whole, whole_bytes), (chunked, chunked_bytes) = (all_to_alls("expert=4"),
                                                      all_to_alls("expert=4,chunks=2"))
    assert chunked == 2 * whole
    assert chunked_bytes == whole_bytes


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_each_device_holds_one_expert_shard_of_the_expert_weights(name):
    got = run_layout(LAYOUTS[name])
    mesh = got["cfg"].mesh
    for key, leaf in got["state"].params["layers"]["moe"].items():
        if not key.startswith("w_"):
            continue
        shard = leaf.addressable_shards[0].data
        assert shard.shape[1] == 4 // mesh.expert  # [layers, experts, ...]
        others = mesh.tensor * (mesh.fsdp if got["cfg"].parallel.zero == 3 else 1)
        assert shard.nbytes * mesh.expert * others == leaf.nbytes


@pytest.mark.parametrize("name", ["expert=4", "data=2,expert=2,tensor=2",
                                  "fsdp=2,expert=2,tensor=2,sp,dropping"])
def test_plan_predicts_the_all_to_alls_and_expert_memory_that_inspect_compiles(name):
    """`jaxpar inspect --compare` on the compiled step: within 10% on every significant
    collective (the all-to-alls among them) and 5% on the train state (expert shards)."""
    got = run_layout(LAYOUTS[name])
    cfg = got["cfg"]
    report = build_report(CompiledStep(cfg, got["trainer"], got["compiled"], 0.0))
    comparison = compare_with_plan(report, cfg)
    rows = {(r["kind"], tuple(r["axes"])): r for r in comparison["collectives"]}
    a2a = rows["all-to-all", ("expert",)]
    assert 0.9 <= a2a["ratio"] <= 1.1, a2a
    total = sum(r["compiled_bytes"] or 0 for r in comparison["collectives"])
    for key, row in rows.items():  # a significant row on either side must match the other
        if max(row["compiled_bytes"] or 0, row["predicted_bytes"] or 0) >= 0.01 * total:
            assert row["ratio"] is not None and 0.9 <= row["ratio"] <= 1.1, (key, row)
    assert 0.95 <= comparison["memory"]["ratio"] <= 1.05, comparison["memory"]
    # Expert memory: the plan splits every expert weight like the compiled step does.
    plan = {p.name: p.bytes_per_device for p in estimate(cfg).params}
    for row in report["params"]:
        assert plan[row["name"]] == row["bytes_per_device"], row


# --------------------------------------------------------------------------------------------
# Buffers, the training loop's metrics


def test_router_bias_is_a_buffer_updated_by_the_step_not_the_optimizer():
    ref = run_layout(REFERENCE)
    state = ref["state"]
    assert set(state.buffers["layers"]["moe"]) == {"router_bias"}
    assert "router_bias" not in str(jax.tree_util.tree_structure(state.params))
    assert "router_bias" not in str(jax.tree_util.tree_structure(state.opt_state))
    # First step: b += rate * sign(mean load - load), per MoE layer, from the load of batch 0.
    before, after = (b["layers"]["moe"]["router_bias"] for b in ref["buffers"][:2])
    load = ref["aux"]["layer_expert_tokens"]  # [MoE layers, experts]
    np.testing.assert_allclose(after, before + 0.01 * np.sign(load.mean(-1, keepdims=True) - load),
                               rtol=0, atol=1e-7)
    assert (after != before).any()


def test_training_loop_writes_moe_metrics(tmp_path):
    from jaxpar.train.loop import train

    cfg = load_config("moe-tiny", ["mesh.data=2", "mesh.expert=4", "train.steps=3",
                                   "logging.every=1", "logging.progress=false",
                                   "model.moe.router=sigmoid_bias", "data.max_bytes=200000",
                                   f"run_dir={tmp_path}"])
    train(validate(cfg, 8))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert sum(row["expert_tokens"]) == 8 * 32 * 2 * 2  # tokens x top_k x MoE layers
        assert len(row["expert_tokens"]) == 4
        assert 0 < row["expert_load_min_max"] <= 1
        assert row["moe_aux_loss"] > 0 and row["moe_z_loss"] > 0
        assert row["dropped_fraction"] == 0
        # 4 experts on 4 devices, top-2: blocks of T rows to each of 4 devices for 2T slots.
        assert row["a2a_padding_fraction"] == pytest.approx(0.5)
