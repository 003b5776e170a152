"""LoRA (``train.lora``, docs/lora.md): only the adapters train.

The tiny preset (2 layers, ``helpers.LAYOUT_BASE``: 3 steps), float32, adapters on every target.
On ``data=2 fsdp=2 tensor=2`` the loss, the adapters' gradients and their values after the steps
are the one-device ones; the base weights come out bit for bit as they went in; the optimizer
state holds adapter-shaped arrays only; and the compiled step sums no base-weight gradient.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from helpers import (
    MOE_LAYOUT_BASE,
    assert_grads_and_params_match,
    max_relative_error,
    per_step_bytes,
    run_layout,
)

from jaxpar.model.lora import adapter_part, base_part

LORA = ("train.lora.rank=4", "train.lora.alpha=8")
MESH = ("mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2")


def test_lora_on_data_fsdp_tensor_matches_one_device() -> None:
    ref = run_layout(LORA)
    got = run_layout((*LORA, *MESH))
    assert abs(got["loss"] - ref["loss"]) <= 1e-5 * abs(ref["loss"])
    # Only adapters have gradients; B starts at zero, so A's first gradient is zero: the
    # parameters after 3 steps compare A's training too.
    assert got["grads"] and not base_part(got["grads"])
    assert_grads_and_params_match(got, ref)
    moved = max_relative_error(adapter_part(ref["params"]),
                               adapter_part(jax.tree.map(np.asarray,
                                                         ref["trainer"].init().params)))
    assert min(moved.values()) > 1e-4, moved


def test_lora_freezes_base_and_keeps_adapter_state_only() -> None:
    got = run_layout((*LORA, *MESH))
    init = jax.tree.map(np.asarray, got["trainer"].init().params)
    base_after, base_before = base_part(got["params"]), base_part(init)
    assert jax.tree.structure(base_after) == jax.tree.structure(base_before)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(base_after),
                                                    jax.tree.leaves(base_before), strict=True))
    adapter_shapes = {a.shape for a in jax.tree.leaves(adapter_part(init))}
    state = [a for a in jax.tree.leaves(got["state"].opt_state) if a.ndim > 0]
    assert state and all(a.shape in adapter_shapes for a in state)
    adapter_count = sum(a.size for a in jax.tree.leaves(adapter_part(init)))
    assert sum(a.size for a in state) == 2 * adapter_count  # AdamW's two moments


def test_lora_step_sums_no_base_weight_gradient() -> None:
    """The gradient sums (all-reduces and reduce-scatters over ``data`` or ``fsdp``; those over
    ``tensor`` alone are the activations') of the LoRA step move at most the adapters' bytes,
    where the full run's move at least an eighth of the weights' (each split over the mesh)."""
    full = run_layout(MESH)
    lora = run_layout((*LORA, *MESH))

    def summed(run) -> int:
        return per_step_bytes([c for c in run["collectives"]
                               if c.kind in ("all-reduce", "reduce-scatter")
                               and {"data", "fsdp"} & set(c.axes)])

    weights = sum(a.nbytes for a in jax.tree.leaves(base_part(lora["params"])))
    adapters = sum(a.nbytes for a in jax.tree.leaves(adapter_part(lora["params"])))
    assert summed(full) >= weights / 8, (summed(full), weights)
    assert summed(lora) <= adapters + 1024, (summed(lora), adapters)
    assert summed(lora) < summed(full) / 10, (summed(lora), summed(full))


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [MESH, ("mesh.data=2", "mesh.context=2", "mesh.tensor=2"),
                                  ("mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2",
                                   "parallel.zero=1")])
def test_lora_with_micro_steps_matches_one_device(mesh: tuple[str, ...]) -> None:
    """Two micro-steps (summed over data by hand), context parallelism, ZeRO-1."""
    accum = (*LORA, "train.grad_accum=2")
    assert_grads_and_params_match(run_layout((*accum, *mesh)), run_layout(accum))


@pytest.mark.slow
@pytest.mark.parametrize("extra", [("train.remat=full",),
                                   ("train.remat=dots", "parallel.sequence_parallel=true"),
                                   ("train.optimizer=muon",), ("train.optimizer=adafactor",)])
def test_lora_with_remat_sp_and_other_optimizers_matches_one_device(extra: tuple) -> None:
    assert_grads_and_params_match(run_layout((*LORA, *MESH, *extra)),
                                  run_layout((*LORA, *extra)))


MOE_LORA = (*LORA, "train.lora.targets=[q,k,v,o]")


def moe_run(overrides: tuple[str, ...]) -> dict:
    """moe-tiny (helpers.MOE_LAYOUT_BASE: 3 steps) with LoRA on its attention and ``overrides``."""
    return run_layout((*MOE_LORA, *overrides), preset="moe-tiny", base=tuple(MOE_LAYOUT_BASE))


@pytest.mark.slow
def test_lora_on_a_moe_model_with_experts_matches_one_device() -> None:
    """Adapters on the attention of moe-tiny (the routed experts stay frozen) under
    ``data=2 expert=2 tensor=2``: the one-device loss, adapter gradients and parameters."""
    ref = moe_run(("mesh.data=1",))
    got = moe_run(("mesh.data=2", "mesh.expert=2", "mesh.tensor=2"))
    assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    assert not base_part(got["grads"])
    assert_grads_and_params_match(got, ref)
