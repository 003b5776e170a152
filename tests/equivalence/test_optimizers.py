"""Each ``train.optimizer`` on a sharded layout against the one-device run, and the bfloat16
optimizer state (``train.opt_state_dtype``) through real steps.

The tiny preset (2 layers, ``helpers.LAYOUT_BASE``: 3 steps), float32. Muon's Newton-Schulz
iterations run on each matrix's momentum gathered whole (docs/optimizers.md), and their slices
of the result must give the one-device parameters.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    MOE_LAYOUT_BASE,
    assert_grads_and_params_match,
    assert_params_moved,
    make_batches,
    max_relative_error,
    run_layout,
)

from jaxpar.config import load_config, validate
from jaxpar.mesh import make_mesh
from jaxpar.train.optimizers import per_parameter
from jaxpar.train.step import build_trainer

MESH = ("mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2")


@pytest.mark.parametrize("optimizer", ["adafactor", "lion", "muon"])
def test_optimizer_on_data_fsdp_tensor_matches_one_device(optimizer: str) -> None:
    """adamw is the default every layout test in test_parallel_layouts.py already runs."""
    chosen = (f"train.optimizer={optimizer}",)
    ref = run_layout(chosen)
    assert_params_moved(ref)
    got = run_layout((*chosen, *MESH))
    assert_grads_and_params_match(got, ref)


def test_bfloat16_state_stores_bfloat16_moments() -> None:
    """Every per-parameter array of AdamW's state is bfloat16 after the steps (the counters
    stay int32), and the steps moved every parameter. (The update's float32 arithmetic on the
    widened moments: unit/test_optimizer_setup.py.)"""
    got = run_layout(("train.opt_state_dtype=bfloat16",))
    leaves = jax.tree_util.tree_flatten_with_path(got["state"].opt_state)[0]
    moments = [a for path, a in leaves if per_parameter(path)]
    assert moments and all(a.dtype == jnp.bfloat16 for a in moments)
    assert all(a.dtype == jnp.int32 for path, a in leaves if not per_parameter(path))
    assert_params_moved(got)


# The interleaved schedule stores the stacked layers out of model order, the optimizer state's
# too (Trainer.to_model_order): each optimizer's state must follow the layers it belongs to.
PIPELINE = ("mesh.pipe=2", "mesh.data=1", "train.microbatches=4",
            "parallel.pipeline_schedule=interleaved", "parallel.virtual_stages=2",
            "model.n_layers=4")


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["adafactor", "lion", "muon"])
def test_optimizer_in_interleaved_pipeline_matches_one_device(optimizer: str) -> None:
    chosen = (f"train.optimizer={optimizer}",)
    ref = run_layout((*chosen, "model.n_layers=4"))
    got = run_layout((*chosen, *PIPELINE))
    back = np.argsort(got["trainer"].layer_order)
    params = dict(got["params"], layers=jax.tree.map(lambda a: a[back], got["params"]["layers"]))
    errors = max_relative_error(params, ref["params"])
    assert max(errors.values()) < 1e-4, errors


def _moe_params_after_steps(overrides: tuple[str, ...]) -> tuple[dict, dict]:
    """moe-tiny (helpers.MOE_LAYOUT_BASE) with ``overrides``: the parameters before and after
    the steps."""
    cfg = load_config("moe-tiny", [*MOE_LAYOUT_BASE, *overrides])
    n = math.prod(int(o.split("=")[1]) for o in overrides if o.startswith("mesh."))
    cfg = validate(cfg, n)
    trainer = build_trainer(cfg, make_mesh(cfg, devices=jax.devices()[:n]))
    state, step = trainer.init(), trainer.compile_step()
    init = jax.tree.map(np.asarray, state.params)
    for batch in make_batches(cfg):
        state, _ = step(state, trainer.put_batch(batch))
    return init, jax.tree.map(np.asarray, state.params)


@pytest.mark.slow
def test_muon_on_experts_with_expert_parallelism_matches_one_device() -> None:
    """Muon orthogonalises each routed expert's matrices ([L, E, in, out]: L x E matrices) with
    the experts split over ``expert``, as on one device."""
    init, ref = _moe_params_after_steps(("train.optimizer=muon", "mesh.data=1"))
    _, got = _moe_params_after_steps(("train.optimizer=muon", "mesh.data=2", "mesh.expert=2",
                                      "mesh.tensor=2"))
    moved = max_relative_error(ref, init)
    assert min(moved.values()) > 1e-4, moved
    errors = max_relative_error(got, ref)
    assert max(errors.values()) < 1e-4, errors


@pytest.mark.parametrize(("shape", "dims", "spec"), [
    # wq-like [layers, embed, heads, head_dim]: 4 layers over 4 owners, 2 (padded), 5 (c=2)
    ((4, 64, 8, 8), ((1,), (2, 3)), (None, "fsdp", "tensor", None)),
    ((2, 64, 8, 8), ((1,), (2, 3)), (None, "fsdp", "tensor", None)),
    ((5, 64, 8, 8), ((1,), (2, 3)), (None, "fsdp", "tensor", None)),
    # wo-like [layers, heads, head_dim, embed]: inputs first, embed last
    ((2, 8, 8, 64), ((1, 2), (3,)), (None, "tensor", None, "fsdp")),
    # experts-like [layers, experts, embed, mlp], the experts split over another axis
    ((2, 4, 32, 64), ((2,), (3,)), (None, "data", "fsdp", "tensor")),
])
def test_owner_computes_newton_schulz_is_the_one_device_orthogonalisation(shape, dims, spec):
    """Muon's owner-computes exchange (two all-to-alls over fsdp x tensor, zero matrices as
    padding) gives each device's piece of optax's orthogonalisation of every matrix."""
    from jax.sharding import NamedSharding, PartitionSpec
    from optax.contrib import MuonDimensionNumbers
    from optax.contrib._muon import orthogonalize_via_newton_schulz

    from jaxpar.parallel.optimizer_state import MuonLayout
    from jaxpar.train.optimizers import _owner_newton_schulz

    d = MuonDimensionNumbers(reduction_axis=dims[0], output_axis=dims[1])
    coeffs = jnp.asarray((3.4445, -4.775, 2.0315))
    x = jax.random.normal(jax.random.key(0), shape, jnp.float32)
    want = orthogonalize_via_newton_schulz(x, coeffs, 5, "frobenius", 1e-8, d)
    mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"))
    layout = MuonLayout((), PartitionSpec(*spec), ("fsdp", "tensor"))
    with jax.set_mesh(mesh):
        got = jax.jit(lambda a: _owner_newton_schulz(a, d, layout, coeffs, 1e-8))(
            jax.device_put(x, NamedSharding(mesh, PartitionSpec(*spec))))
    assert max(max_relative_error({"x": np.asarray(got)}, {"x": np.asarray(want)}).values()) < 1e-5
