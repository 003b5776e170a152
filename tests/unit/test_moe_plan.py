"""Mixture of experts without compiling a model or a step: the plan's all-to-all bytes by hand,
the layer stack of ``model.moe.every`` (abstract shapes), and the flops of the active experts.
The layers and layouts themselves: ``tests/equivalence/test_moe.py``."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from helpers import MOE_LAYOUT_BASE as BASE

from jaxpar.config import load_config, validate
from jaxpar.cost.estimate import estimate
from jaxpar.model.transformer import abstract_model, create_model
from jaxpar.parallel.rules import param_name


def test_plan_all_to_all_bytes_by_hand():
    """expert=4 of moe-tiny: each device routes T = 2 rows x 32 = 64 tokens, k = 2 slots each,
    d_model 64, float32. Ideal traffic per MoE layer: T k E x 4 B x 2 (dispatch, combine) x 2
    (forward, backward) = 128 KiB, (4-1)/4 of it over the wire. XLA:CPU's padded exchange sends
    each of the 4 devices a worst-case block of T x min(k, X/G = 1) = 64 rows: 256 rows, twice
    the 128 real ones, plus their int32 expert ids forward."""
    cfg = validate(load_config("moe-tiny", [*BASE, "mesh.data=1", "mesh.expert=4"]), 4)
    layers = cfg.model.n_moe_layers
    ideal = 64 * 2 * 64 * 4 * 2 * 2
    assert ideal == 128 * 1024
    rows = {(r["kind"], tuple(r["axes"])): r for r in estimate(cfg).collective_rows()}
    padded = layers * (2 * ideal + 256 * 4)
    assert rows["all-to-all", ("expert",)]["bytes"] == padded
    assert rows["all-to-all", ("expert",)]["wire_bytes"] == pytest.approx(padded * 3 / 4, abs=8)
    # On a GPU profile the dropless exchange is ragged: only the real rows travel.
    gpu = {(r["kind"], tuple(r["axes"])): r for r in estimate(cfg, "h100").collective_rows()}
    assert gpu["ragged-all-to-all", ("expert",)]["bytes"] == layers * ideal
    # Dropping: a capacity buffer of X x C rows, C = ceil(1.25 x 64 x 2 / 4) = 40.
    dropping = validate(load_config("moe-tiny", [*BASE, "mesh.data=1", "mesh.expert=4",
                                                 "model.moe.dispatch=dropping"]), 4)
    rows = {(r["kind"], tuple(r["axes"])): r for r in estimate(dropping).collective_rows()}
    assert rows["all-to-all", ("expert",)]["bytes"] == layers * 4 * 4 * 40 * 64 * 4


def test_moe_every_2_stacks_dense_moe_pairs():
    cfg = load_config("moe-tiny", ["model.n_layers=4", "model.moe.every=2"]).model
    model = abstract_model(cfg)
    shapes = {param_name(p): x.shape for p, x in jax.tree_util.tree_flatten_with_path(
        nnx.to_pure_dict(nnx.state(model, nnx.Param)))[0]}
    assert shapes["layers/block_0/mlp/w_gate"] == (2, 64, 128)  # 2 groups of (dense, MoE)
    assert shapes["layers/block_1/moe/w_gate"] == (2, 4, 64, 64)
    assert not [n for n in shapes if n.startswith("layers/block_0/moe")]
    tokens = jnp.zeros((2, 8), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(8), (2, 8))
    _, aux = jax.eval_shape(lambda: create_model(cfg, seed=0)(tokens, positions))
    assert aux["layer_expert_tokens"].shape == (2, 4)  # one row per MoE layer
    assert aux["aux_loss"].shape == ()


def test_moe_flops_count_active_experts_only():
    from jaxpar.model.flop_formula import matmul_params, param_count

    cfg = load_config("moe-tiny").model
    dense = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, num_experts=0))
    per_layer_router, expert = 64 * 4, 3 * 64 * 64
    swiglu = 3 * 64 * 128
    # top-2 of 4 experts active, the router too; all 4 experts counted as parameters.
    assert matmul_params(cfg) - matmul_params(dense) == 2 * (per_layer_router + 2 * expert
                                                             - swiglu)
    assert param_count(cfg) - param_count(dense) == 2 * (per_layer_router + 4 * expert - swiglu)
