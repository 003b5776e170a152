"""Host offload of the optimizer state (``train.offload.optimizer``, docs/memory.md#host-offload):
between steps the state lives in pinned host memory, each step brings it to the device for the
update and sends the new state back. On ``data=2 fsdp=2 tensor=2`` the loss, gradients and
parameters after 3 steps are the one-device ones, the state's arrays are in pinned host memory,
and the compiled step moves them (host memory space annotations in its HLO)."""

from __future__ import annotations

import jax
from helpers import assert_grads_and_params_match, run_layout

MESH = ("mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2")
OFFLOAD = ("train.offload.optimizer=true",)


def test_offloaded_optimizer_state_matches_one_device_and_lives_in_host_memory() -> None:
    ref = run_layout(())
    got = run_layout((*OFFLOAD, *MESH))
    assert abs(got["loss"] - ref["loss"]) <= 1e-5 * abs(ref["loss"])
    assert_grads_and_params_match(got, ref)
    state = got["state"]
    kinds = {leaf.sharding.memory_kind for leaf in jax.tree.leaves(state.opt_state)}
    assert kinds == {"pinned_host"}, kinds
    assert {p.sharding.memory_kind for p in jax.tree.leaves(state.params)} == {"device"}
    assert "S(5)" in got["hlo"]  # XLA's host memory space
