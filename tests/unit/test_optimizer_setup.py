"""Optimizers, schedules and the optimizer state's dtype (train/optimizers.py), without
compiling a step: the schedules' values against hand formulas, the cost model's state bytes
against the state ``optax`` builds (shapes only), and the update on bfloat16 state."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.config import TrainConfig, load_config, validate
from jaxpar.cost.params import param_costs
from jaxpar.mesh import make_mesh
from jaxpar.parallel.optimizer_state import state_counters
from jaxpar.train.optimizers import (
    learning_rate_schedule,
    make_optimizer,
    muon_dimensions,
    per_parameter,
    wsd_value,
)
from jaxpar.train.step import resolve_shardings

OPTIMIZERS = ["adamw", "adafactor", "lion", "muon"]


def _lrs(t: TrainConfig) -> list[float]:
    """The learning rate of optimizer steps 1..steps (the schedule at counts 0..steps-1)."""
    schedule = learning_rate_schedule(t)
    return [float(schedule(count)) for count in range(t.steps)]


def test_wsd_schedule_matches_hand_formula() -> None:
    """10 steps, 2 of warm-up, the last 30% (3 steps) decaying linearly to 0.1: by hand."""
    t = TrainConfig(steps=10, warmup_steps=2, lr=1.0, min_lr_ratio=0.1, lr_schedule="wsd",
                    decay_fraction=0.3)
    want = [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.7, 0.4, 0.1]
    np.testing.assert_allclose(_lrs(t), want, rtol=1e-6)
    np.testing.assert_allclose([wsd_value(t, s) for s in range(1, 11)], want, rtol=1e-12)
    # decay_fraction=1: decay right after the warm-up; no warm-up: lr from the first step.
    t = dataclasses.replace(t, decay_fraction=1.0, warmup_steps=0, steps=4)
    np.testing.assert_allclose(_lrs(t), [1 - 0.9 / 4 * s for s in range(1, 5)], rtol=1e-6)


def test_constant_and_cosine_schedules() -> None:
    t = TrainConfig(steps=6, warmup_steps=4, lr=2.0, lr_schedule="constant")
    np.testing.assert_allclose(_lrs(t), [0.5, 1.0, 1.5, 2.0, 2.0, 2.0], rtol=1e-6)
    t = TrainConfig(steps=10, warmup_steps=2, lr=1.0, min_lr_ratio=0.1)  # cosine, the default
    want = [0.5, 1.0] + [0.1 + 0.45 * (1 + math.cos(math.pi * (s - 2) / 8))
                         for s in range(3, 11)]
    np.testing.assert_allclose(_lrs(t), want, rtol=1e-5)


def test_muon_takes_the_stacked_matrices_per_layer_and_expert() -> None:
    d = muon_dimensions("layers/attn/wq", ("layers", "embed", "heads", "head_dim"))
    assert (d.reduction_axis, d.output_axis) == ((1,), (2, 3))
    d = muon_dimensions("layers/attn/wo", ("layers", "heads", "head_dim", "embed"))
    assert (d.reduction_axis, d.output_axis) == ((1, 2), (3,))
    d = muon_dimensions("layers/moe/w_down", ("layers", "experts", "mlp", "embed"))
    assert (d.reduction_axis, d.output_axis) == ((2,), (3,))
    for name, names in (("embedding", ("vocab", "embed")), ("lm_head", ("embed", "vocab")),
                        ("layers/attn_norm/scale", ("layers", "embed")),
                        ("layers/moe/router", ("layers", "embed", None))):
        assert muon_dimensions(name, names) is None, name


# d_model 128 and d_ff 256: Adafactor factors most weights (dims >= 128) and keeps full second
# moments for the rest; ZeRO-1 splits the state's embed dimension further.
STATE_LAYOUTS = {
    "one-device": ["model.d_model=128", "model.d_ff=256"],
    "data2-fsdp2-tensor2": ["model.d_model=128", "model.d_ff=256", "mesh.data=2", "mesh.fsdp=2",
                            "mesh.tensor=2"],
    "zero1-data4-tensor2-no-decay": ["model.d_model=128", "model.d_ff=256", "mesh.data=4",
                                     "mesh.tensor=2", "parallel.zero=1",
                                     "train.weight_decay=0"],
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("layout", list(STATE_LAYOUTS))
def test_plan_counts_the_state_the_step_lays_out(layout: str, optimizer: str, dtype: str) -> None:
    """The cost model's optimizer bytes per device equal those of the state's arrays as
    ``resolve_shardings`` lays them out (shapes and shardings only: nothing is compiled)."""
    overrides = [*STATE_LAYOUTS[layout], f"train.optimizer={optimizer}",
                 f"train.opt_state_dtype={dtype}"]
    n = math.prod(int(o.split("=")[1]) for o in overrides if o.startswith("mesh.")) or 1
    cfg = validate(load_config("tiny", overrides), n)
    mesh = make_mesh(cfg, devices=jax.devices()[:n])
    from jaxpar.model.transformer import abstract_model  # noqa: PLC0415
    from jaxpar.parallel.rules import param_logical_axes  # noqa: PLC0415
    tx = make_optimizer(cfg.train, param_logical_axes(abstract_model(cfg.model)))
    state = resolve_shardings(cfg, mesh, tx).abstract_state.opt_state
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    laid_out = sum(math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize
                   for _, a in leaves)
    planned = (sum(p.state_bytes_per_device for p in param_costs(cfg))
               + state_counters(optimizer, cfg.train.weight_decay))
    assert planned == laid_out
    stored = {a.dtype for path, a in leaves if per_parameter(path)}
    assert stored == {jnp.dtype(dtype)}


def test_bfloat16_state_update_is_float32_arithmetic_rounded() -> None:
    """One AdamW update on bfloat16 moments: the float32 update of the widened moments, and the
    new moments are its float32 moments rounded to bfloat16."""
    params = {"w": jnp.linspace(-1.0, 1.0, 12, dtype=jnp.float32).reshape(3, 4)}
    grads = {"w": jnp.linspace(0.3, -0.7, 12, dtype=jnp.float32).reshape(3, 4)}
    t32 = TrainConfig(warmup_steps=0, grad_clip=0.0, weight_decay=0.0)
    t16 = dataclasses.replace(t32, opt_state_dtype="bfloat16")
    tx32, tx16 = make_optimizer(t32), make_optimizer(t16)
    s32, s16 = tx32.init(params), tx16.init(params)
    for _ in range(2):
        u32, s32 = tx32.update(grads, s32, params)
        u16, s16 = tx16.update(grads, s16, params)
    assert u16["w"].dtype == jnp.float32
    moments = lambda s: [a for p, a in jax.tree_util.tree_flatten_with_path(s)[0]  # noqa: E731
                         if per_parameter(p)]
    for m16, m32 in zip(moments(s16), moments(s32), strict=True):
        assert m16.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(m16, np.float32), np.asarray(m32), rtol=1e-2)
    np.testing.assert_allclose(np.asarray(u16["w"]), np.asarray(u32["w"]), rtol=2e-2)


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_weight_decay_is_decoupled_lr_times_weight_decay(optimizer: str) -> None:
    """With a zero gradient the update is the decay alone: -lr x weight_decay x parameter for
    every optimizer (optax's adafactor alone would subtract weight_decay x parameter)."""
    params = {"layers": {"mlp": {"w_up": jnp.full((2, 4, 8), 2.0)}}}
    axes = {"layers": {"mlp": {"w_up": ("layers", "embed", "mlp")}}}
    t = TrainConfig(optimizer=optimizer, lr_schedule="constant", warmup_steps=0, lr=0.01,
                    weight_decay=0.1, grad_clip=0.0)
    tx = make_optimizer(t, axes)
    zeros = jax.tree.map(jnp.zeros_like, params)
    updates, _ = tx.update(zeros, tx.init(params), params)
    np.testing.assert_allclose(np.asarray(updates["layers"]["mlp"]["w_up"]), -0.01 * 0.1 * 2.0,
                               rtol=1e-5)


def _ns(m: int, n: int) -> int:
    """Newton-Schulz matmul flops of one m x n matrix, m <= n: 5 x (4 m^2 n + 2 m^3)."""
    return 5 * (4 * m * m * n + 2 * m ** 3)


# tiny: 2 layers of wq, wo (64 x 64), wk, wv (32 x 64 as iterated) and the MLP's 64 x 128.
TINY_MUON_FLOPS = 2 * _ns(64, 64) + 2 * _ns(32, 64) + 3 * _ns(64, 128)  # one layer
TINY_MUON_BYTES = 4 * (64 * 64 * 2 + 64 * 32 * 2 + 64 * 128 * 3)  # one layer, float32


def _muon_plan(*overrides: str) -> tuple[dict, float]:
    from jaxpar.cost.estimate import estimate  # noqa: PLC0415

    cfg = validate(load_config("tiny", [*overrides, "train.optimizer=muon"]), 8)
    report = estimate(cfg)
    return {(r["kind"], tuple(r["axes"])): r for r in report.collective_rows()}, \
        report.flops.optimizer


def test_plan_counts_muons_owner_exchanges_and_newton_schulz_flops_by_hand() -> None:
    """tiny at data=2 fsdp=2 tensor=2 (ZeRO-3): each of the 7 stacked matrices' 2 layers,
    padded to the 4 devices of fsdp x tensor, go one to a device (an all-to-all of twice the
    quarter each device holds) and back; each device iterates on one layer's matrices."""
    rows, flops = _muon_plan("mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2")
    exchange = rows[("all-to-all", ("fsdp", "tensor"))]
    assert (exchange["count"], exchange["bytes"]) == (14, 2 * 2 * (2 * TINY_MUON_BYTES // 4))
    assert flops == TINY_MUON_FLOPS


def test_plan_counts_muons_gathers_under_zero1_by_hand() -> None:
    """ZeRO-1 (moments split over data x fsdp): the momentum gathered over data x fsdp (half
    of each matrix, still split over tensor), then over tensor (all of it); every device
    iterates on both layers; ZeRO-1's final gather leaves the matrices out."""
    rows, flops = _muon_plan("mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "parallel.zero=1")
    assert rows[("all-gather", ("tensor",))]["bytes"] == 2 * TINY_MUON_BYTES
    assert flops == 2 * TINY_MUON_FLOPS
    adamw = validate(load_config("tiny", ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2",
                                          "parallel.zero=1"]), 8)
    from jaxpar.cost.estimate import estimate  # noqa: PLC0415
    zero1 = {(r["kind"], tuple(r["axes"])): r for r in estimate(adamw).collective_rows()}
    gathered = rows[("all-gather", ("data", "fsdp"))]["bytes"]
    # Muon's gather of its matrices (less their tensor split) in place of ZeRO-1's of them.
    assert gathered == zero1[("all-gather", ("data", "fsdp"))]["bytes"]
