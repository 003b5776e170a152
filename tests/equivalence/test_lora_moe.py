"""LoRA on mixture-of-experts models and LoRA dropout (docs/lora.md).

moe-tiny with adapters on every target: ``gate``, ``up``, ``down`` adapt each routed expert
(``A [layers, experts, in, r]``, ``B [layers, experts, r, out]``, split over ``expert``), applied
in the expert computation to the rows routed to each expert. A fresh ``B`` is zero, so the cheap
tests start from random ``B`` (helpers.lora_loss_and_grads): the adapters then change the first
step's loss and every adapter gets a gradient. On ``data=2 expert=2 tensor=2`` the loss and the
adapters' gradients are the one-device ones, in both dispatch modes; the merged weights
(``merged_weights``, the export) give the adapted model's loss, on a model with dense blocks and
shared experts too. Dropout: the same masks on every layout, none in eval.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from helpers import (
    MOE_LAYOUT_BASE,
    assert_grads_and_params_match,
    emulated_ragged_all_to_all,
    max_relative_error,
    run_layout,
)
from helpers import lora_loss_and_grads as uncached_loss_and_grads

import jaxpar.parallel.expert as expert_module
import jaxpar.platform as workarounds
from jaxpar.model.lora import adapter_part, base_part, merged_weights
from jaxpar.train.step import with_positions
from jaxpar.train.validation_loss import forward_loss_fn

LORA = ("train.lora.rank=4", "train.lora.alpha=8")
EXPERT_MESH = ("mesh.data=2", "mesh.expert=2", "mesh.tensor=2")
DENSE_MESH = ("mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2")
MOE_BASE = tuple(MOE_LAYOUT_BASE)
# No slot dropped at capacity_factor = experts / top_k (C = T): every layout computes the same.
DROPPING = ("model.moe.dispatch=dropping", "model.moe.capacity_factor=2.0")
# A dense first block (dense_layers), then one (dense, MoE) group, with a shared expert.
DENSE_BLOCKS = ("model.n_layers=3", "model.moe.first_dense=1", "model.moe.every=2",
                "model.moe.num_shared_experts=1")


# One build per layout and file (tests/conftest.py clears module caches after each file).
lora_loss_and_grads = functools.cache(uncached_loss_and_grads)


def moe_run(*overrides: str) -> dict:
    return lora_loss_and_grads((*LORA, *overrides), preset="moe-tiny", base=MOE_BASE)


def assert_loss_and_grads_match(got: dict, ref: dict) -> None:
    assert abs(got["loss"] - ref["loss"]) <= 1e-5 * abs(ref["loss"]), (got["loss"], ref["loss"])
    errors = max_relative_error(got["grads"], ref["grads"])
    assert max(errors.values()) < 1e-4, errors


def expert_grads(run: dict) -> dict:
    """The gradients of every routed expert's adapter (each ``[layers, experts, ...]``)."""
    return {name: g for name, g in jax.tree_util.tree_leaves_with_path(run["grads"])
            if "'moe'" in jax.tree_util.keystr(name)
            and "shared" not in jax.tree_util.keystr(name)}


@pytest.mark.parametrize(("dispatch", "exchange"), [
    pytest.param((), "padded", id="dropless-padded"),
    pytest.param((), "ragged", id="dropless-ragged", marks=pytest.mark.slow),
    pytest.param(DROPPING, "capacity", id="dropping", marks=pytest.mark.slow)])
def test_expert_adapters_match_one_device_under_expert_parallelism(
        dispatch: tuple, exchange: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every dispatch: dropless with the padded all-to-all (XLA:CPU's), with
    ``ragged_all_to_all`` (GPU/TPU's; its offsets as there, the collective emulated) and the
    capacity buffer."""
    ref = moe_run(*dispatch)
    if exchange == "ragged":
        monkeypatch.setattr(workarounds, "PADDED_ALL_TO_ALL_PLATFORMS", ())
        emulated, calls = emulated_ragged_all_to_all(2), []

        def counted(*args, **kwargs):
            calls.append(1)
            return emulated(*args, **kwargs)
        monkeypatch.setattr(expert_module, "ragged_all_to_all", counted)
        got = uncached_loss_and_grads((*LORA, *dispatch, *EXPERT_MESH), preset="moe-tiny",
                                      base=MOE_BASE)
        assert calls  # the ragged exchange was traced
    else:
        got = moe_run(*dispatch, *EXPERT_MESH)
    assert_loss_and_grads_match(got, ref)
    assert not base_part(got["grads"])  # only adapters are differentiated
    experts = expert_grads(ref)
    assert len(experts) == 6  # A and B of gate, up, down
    for path, g in experts.items():
        assert g.shape[1] == 4, path  # one adapter per expert
        # every expert's adapter got rows (and so a gradient) of its own
        assert np.all(np.abs(g).reshape(4, -1).max(axis=1) > 0), path


@pytest.mark.slow
def test_merged_expert_and_dense_block_adapters_equal_the_adapted_model() -> None:
    """``merged_weights`` (what ``jaxpar export --format hf`` writes) of a model with a dense
    first block, a (dense, MoE) group and a shared expert: the plain model with those weights
    has the adapted model's loss, which differs from the base model's."""
    adapted = moe_run(*DENSE_BLOCKS)
    adapters = {jax.tree_util.keystr(p).replace("']['", "/").strip("[']")
                for p, _ in jax.tree_util.tree_leaves_with_path(adapter_part(adapted["params"]))}
    for owner in ("dense_layers/mlp", "layers/block_0/mlp", "layers/block_1/moe",
                  "layers/block_1/moe/shared", "dense_layers/attn", "layers/block_1/attn"):
        assert f"{owner}/lora_gate/a" in adapters or f"{owner}/lora_q/a" in adapters, owner
    plain = lora_loss_and_grads(DENSE_BLOCKS, preset="moe-tiny", base=MOE_BASE)
    trainer, state = plain["trainer"], plain["trainer"].init()
    weights = merged_weights(adapted["params"], adapted["cfg"].train.lora)
    assert jax.tree.structure(weights) == jax.tree.structure(state.params)
    params = jax.tree.map(lambda w, a: jax.device_put(w.astype(a.dtype), a.sharding),
                          weights, state.params)
    loss, _ = trainer.loss_and_grads(state._replace(params=params), plain["batch"])
    assert abs(float(loss) - adapted["loss"]) <= 1e-5 * adapted["loss"]
    assert abs(plain["loss"] - adapted["loss"]) > 1e-3


def test_lora_dropout_matches_one_device_and_changes_the_loss() -> None:
    """``train.lora.dropout=0.25`` on tiny: ``data=2 fsdp=2 tensor=2`` draws the one-device
    masks (same loss and gradients); the loss differs from dropout 0's on the same state; and
    the eval forward pass (no dropout) gives dropout 0's loss."""
    dropout = (*LORA, "train.lora.dropout=0.25")
    ref = lora_loss_and_grads(dropout)
    got = lora_loss_and_grads((*dropout, *DENSE_MESH))
    assert_loss_and_grads_match(got, ref)
    plain = lora_loss_and_grads(LORA)
    # 7e-4 relative here: 70 times the tolerance of the match above
    assert abs(plain["loss"] - ref["loss"]) > 1e-4 * plain["loss"], (plain["loss"], ref["loss"])
    grad_errors = max_relative_error(plain["grads"], ref["grads"])
    assert min(grad_errors.values()) > 1e-3, grad_errors  # every adapter's mask mattered
    trainer = ref["trainer"]
    with jax.set_mesh(trainer.mesh):
        summed = jax.jit(forward_loss_fn(trainer))(
            ref["state"], with_positions(ref["batch"], trainer.seq_order))
    valid = float(np.sum(np.asarray(ref["batch"]["mask"])))
    assert abs(float(summed) / valid - plain["loss"]) <= 1e-5 * plain["loss"]


@pytest.mark.slow
@pytest.mark.parametrize("layout", [
    ("train.grad_accum=2", *DENSE_MESH),
    ("mesh.data=2", "mesh.context=2", "mesh.tensor=2")], ids=["micro-steps", "zigzag-context"])
def test_lora_dropout_masks_follow_the_tokens(layout: tuple[str, ...]) -> None:
    """Each token's mask comes from its global number (row x seq_len + position), so two
    micro-steps whose gradients are summed over ``data`` by hand, and a zigzag-reordered
    sequence split over ``context``, give the one-device run's loss and gradients (without
    micro-steps)."""
    dropout = (*LORA, "train.lora.dropout=0.25")
    assert_loss_and_grads_match(lora_loss_and_grads((*dropout, *layout)),
                                lora_loss_and_grads(dropout))


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [EXPERT_MESH, ("mesh.expert=2", "mesh.fsdp=2")])
def test_expert_adapters_train_as_on_one_device(mesh: tuple[str, ...]) -> None:
    """Three steps of moe-tiny with adapters on every target (fresh ``B``): the first loss, the
    adapters' gradients and their values after the steps are the one-device ones; the base
    weights are bit-identical after the steps."""
    ref = run_layout(LORA, preset="moe-tiny", base=MOE_BASE)
    got = run_layout((*LORA, *mesh), preset="moe-tiny", base=MOE_BASE)
    assert abs(got["loss"] - ref["loss"]) <= 1e-5 * abs(ref["loss"])
    assert_grads_and_params_match(got, ref)
    init = jax.tree.map(np.asarray, got["trainer"].init().params)
    assert all(np.array_equal(a, b) for a, b in zip(
        jax.tree.leaves(base_part(got["params"])), jax.tree.leaves(base_part(init)),
        strict=True))
    moved = max_relative_error(adapter_part(ref["params"]), adapter_part(init))
    assert min(moved.values()) > 1e-4, moved


@pytest.mark.slow
def test_dense_block_adapters_match_one_device_under_expert_parallelism() -> None:
    assert_loss_and_grads_match(moe_run(*DENSE_BLOCKS, *EXPERT_MESH), moe_run(*DENSE_BLOCKS))


@pytest.mark.slow
def test_lora_dropout_on_a_moe_models_attention_matches_one_device() -> None:
    """Dropout on moe-tiny's attention adapters (the experts' refuse it) under
    ``data=2 expert=2 tensor=2``: the one-device loss and gradients, other than dropout 0's."""
    attention = ("train.lora.targets=[q,k,v,o]",)
    dropout = (*attention, "train.lora.dropout=0.25")
    ref = moe_run(*dropout)
    assert_loss_and_grads_match(moe_run(*dropout, *EXPERT_MESH), ref)
    plain = moe_run(*attention)
    # The attention adapters move this loss less than tiny's: still 8x the tolerance above.
    assert abs(plain["loss"] - ref["loss"]) > 4e-5 * ref["loss"], (plain["loss"], ref["loss"])
    assert min(max_relative_error(plain["grads"], ref["grads"]).values()) > 1e-3
