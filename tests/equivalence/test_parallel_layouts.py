"""Every sharding layout against the single-device run, and the collectives each must compile to.

Each layout is built once per test process (``helpers.run_layout``): one compile of the gradient
function, one of the train step, whose optimized HLO the collective tests read. Inputs differ per
position and some targets are masked out, so a misordered shard or a wrong normalisation cannot
pass by symmetry.
"""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest
from helpers import LAYOUT_BASE as BASE
from helpers import (
    assert_grads_and_params_match,
    assert_params_moved,
    per_step_bytes,
    run_layout,
)

from jaxpar.config import load_config, validate
from jaxpar.inspect.hlo.collectives import summarize_collectives

# BASE (helpers.LAYOUT_BASE): 3 steps of 8 x 32 tokens, eps=1e-6 (why: see there). Each layout
# runs through helpers.run_layout, cached for the test process.

# Sequence parallelism splits each device's 2 rows over tensor (whole sequences, see rules.py)
# ... and with 1 row per device and micro-step (grad_accum=2), the sequence (Megatron's layout).
SP = ["mesh.data=4", "mesh.tensor=2", "parallel.sequence_parallel=true"]
LAYOUTS = {
    "data=8": ["mesh.data=8"],
    "fsdp=8": ["mesh.data=1", "mesh.fsdp=8"],
    "data=2,tensor=4": ["mesh.data=2", "mesh.tensor=4"],
    "data=4,tensor=2": ["mesh.data=4", "mesh.tensor=2"],
    "data=2,fsdp=2,tensor=2": ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"],
    "data=4,tensor=2,sp": SP,
    "data=4,tensor=2,sp,grad_accum=2": [*SP, "train.grad_accum=2"],
    "data=4,zero1": ["mesh.data=4", "parallel.zero=1"],
    "data=2,grad_accum=4": ["mesh.data=2", "train.grad_accum=4"],
    "context=4": ["mesh.data=1", "mesh.context=4"],
    "context=4,contiguous": ["mesh.data=1", "mesh.context=4", "parallel.zigzag=false"],
    "data=2,context=2,tensor=2": ["mesh.data=2", "mesh.context=2", "mesh.tensor=2"],
    "data=2,context=4,allgather": ["mesh.data=2", "mesh.context=4",
                                   "parallel.context_impl=allgather"],
    # Blockwise attention (4 x 4 blocks of 8 tokens) with the heads split over tensor, against
    # the reference's dense attention.
    "data=2,tensor=2,blockwise": ["mesh.data=2", "mesh.tensor=2", "model.attention=blockwise",
                                  "model.attention_block=8"],
    # The loss in 4 strided pieces of the sequence, each device's context shard kept local.
    "data=2,context=2,tensor=2,loss_pieces=4": ["mesh.data=2", "mesh.context=2", "mesh.tensor=2",
                                                "train.loss_pieces=4"],
}
REFERENCE = ["mesh.data=1"]


def layout(name: str) -> dict:
    return run_layout(tuple(LAYOUTS[name]))


def reference() -> dict:
    return run_layout(tuple(REFERENCE))


def param_bytes(name: str) -> int:
    return sum(a.nbytes for a in jax.tree.leaves(layout(name)["params"]))


def collectives(name: str, kind: str, axes: tuple[str, ...]):
    return [c for c in layout(name)["collectives"] if c.kind == kind and c.axes == axes]


# Ring attention with a contiguous split is also checked against dense attention in
# tests/equivalence/test_context.py; its whole train step runs with `pytest -m slow`.
SLOW = {"context=4,contiguous"}


@pytest.mark.parametrize("name", [n if n not in SLOW else pytest.param(n, marks=pytest.mark.slow)
                                  for n in LAYOUTS])
def test_layout_matches_single_device_loss_grads_and_params(name):
    got, ref = layout(name), reference()
    assert abs(got["loss"] - ref["loss"]) / ref["loss"] < 1e-5
    assert_grads_and_params_match(got, ref)
    assert abs(got["last_loss"] - ref["last_loss"]) / ref["last_loss"] < 1e-5


@pytest.mark.parametrize("overrides, pieces", [
    (("mesh.data=2", "mesh.context=2", "mesh.fsdp=2"), (8, 8)),
    (("mesh.data=2", "mesh.context=2", "mesh.fsdp=2", "train.grad_accum=2"), (4, 4)),  # by hand
    (("mesh.data=2", "mesh.context=2", "mesh.tensor=2"), (8, 8)),  # the vocab split over tensor
    # A pipeline's head and embedding gradient, each stage's vocabulary piece split over tensor.
    # (slow: about 25 s; test_pipeline.py's zero_bubble layout with loss_pieces=4 is default)
    pytest.param(("mesh.data=1", "mesh.context=2", "mesh.pipe=2", "mesh.tensor=2",
                  "train.microbatches=2", "parallel.pipeline_schedule=1f1b"), (8, 4),
                 marks=pytest.mark.slow),
], ids=["fsdp", "fsdp,grad_accum=2", "tensor", "pipe,tensor"])
def test_loss_pieces_and_embedding_gradient_slices_match_one_device(monkeypatch, overrides,
                                                                    pieces):
    """At scale the loss runs in pieces of the sequence and the embedding's gradient in slices
    of the vocabulary (``Config.loss_pieces``, ``embedding_grad_pieces``); a 4 KiB budget
    makes the tiny model do both (8 pieces, 8 slices; with 2 micro-steps 4 and 4; in a
    pipeline, 4 slices of each stage's piece) under context x fsdp, tensor or pipe, against the
    reference in one piece and one slice. With the vocab split over tensor the strided slices
    are each device's own rows: nothing but the usual collectives moves them."""
    from jaxpar.config import schema

    ref = reference()  # built (or cached) under the default budget: one piece, one slice
    monkeypatch.setattr(schema, "LOSS_PIECE_BYTES", 4096)
    cfg = validate(load_config("tiny", [*BASE, *overrides]), 8)
    assert (cfg.loss_pieces(), cfg.embedding_grad_pieces()) == pieces
    got = run_layout.__wrapped__(overrides)  # not cached: the budget differs
    assert abs(got["loss"] - ref["loss"]) / ref["loss"] < 1e-5
    assert_grads_and_params_match(got, ref)
    moved = [c for c in got["collectives"] if c.axes == ("tensor",)
             and c.kind in ("all-to-all", "collective-permute", "all-gather")]
    assert not moved, moved


def test_reference_params_actually_change_over_three_steps():
    # Guards the equivalence test against comparing two untouched initialisations.
    assert_params_moved(reference())


def test_data_parallel_all_reduces_gradients_and_gathers_no_weights():
    grads = collectives("data=8", "all-reduce", ("data",))
    # Every gradient once, plus a few scalars (loss, valid-token count).
    assert per_step_bytes(grads) == pytest.approx(param_bytes("data=8"), rel=0.01)
    assert not [c for c in layout("data=8")["collectives"] if c.kind == "all-gather"]
    assert not [c for c in layout("data=8")["collectives"] if c.kind == "reduce-scatter"]


def test_fsdp_gathers_weights_and_reduce_scatters_gradients():
    params = param_bytes("fsdp=8")
    gathers = collectives("fsdp=8", "all-gather", ("fsdp",))
    scatters = collectives("fsdp=8", "reduce-scatter", ("fsdp",))
    # Weights are gathered for the forward pass and again for the backward pass; each gradient is
    # reduce-scattered once.
    assert params * 0.95 <= per_step_bytes(gathers) <= params * 2.05
    assert per_step_bytes(scatters) == pytest.approx(params, rel=0.01)
    # Whatever is still all-reduced over fsdp is scalars (loss, norms), not gradients.
    leftover = collectives("fsdp=8", "all-reduce", ("fsdp",))
    assert per_step_bytes(leftover) < 1024, leftover


def test_fsdp_stores_one_eighth_of_parameters_per_device():
    state = layout("fsdp=8")["state"]
    total = sum(p.nbytes for p in jax.tree.leaves(state.params))
    per_device = sum(p.addressable_shards[0].data.nbytes for p in jax.tree.leaves(state.params))
    assert per_device == pytest.approx(total / 8, rel=0.01)
    moments = sum(m.addressable_shards[0].data.nbytes for m in jax.tree.leaves(state.opt_state)
                  if m.ndim > 0)
    assert moments == pytest.approx(2 * total / 8, rel=0.01)  # Adam's mu and nu


@pytest.mark.parametrize("name", ["data=2,tensor=4", "data=4,tensor=2"])
def test_tensor_parallel_all_reduces_activations_over_tensor(name):
    cfg = layout(name)["cfg"]
    activation = cfg.train.batch_size // cfg.mesh.data * cfg.train.seq_len * cfg.model.d_model * 4
    big = [c for c in collectives(name, "all-reduce", ("tensor",)) if c.bytes >= activation]
    # Attention and MLP outputs forward, their input gradients backward, in every layer.
    assert sum(c.executions for c in big) >= 4 * cfg.model.n_layers, big
    assert not [c for c in layout(name)["collectives"] if "tensor" in c.axes
                and c.kind in ("all-gather", "reduce-scatter")]
    # Each device's share of every gradient is summed over data once: the embedding's gradient
    # is its vocabulary shard's rows only, not the whole table's.
    stored = sum(a.addressable_shards[0].data.nbytes
                 for a in jax.tree.leaves(layout(name)["state"].params))
    grads = per_step_bytes(collectives(name, "all-reduce", ("data",)))
    assert grads == pytest.approx(stored, rel=0.01), (grads, stored)


# As many kv heads as query heads: q, k and v have one shape and are projected by one matmul
# where heads are split (tiny's grouped-query attention stacks only k and v).
EQUAL_HEADS = ("model.n_kv_heads=8",)


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
def test_stacked_qkv_and_gate_up_match_one_device_and_reduce_each_input_gradient_once(sp):
    got = run_layout((*EQUAL_HEADS, "mesh.data=2", "mesh.tensor=4",
                      f"parallel.sequence_parallel={str(sp).lower()}"))
    ref = run_layout((*EQUAL_HEADS, "mesh.data=1"))
    assert abs(got["loss"] - ref["loss"]) / ref["loss"] < 1e-5
    assert_grads_and_params_match(got, ref)
    cfg = got["cfg"]
    activation = cfg.train.batch_size // cfg.mesh.data * cfg.train.seq_len * cfg.model.d_model * 4
    kind = "reduce-scatter" if sp else "all-reduce"
    big = [c for c in got["collectives"]
           if c.kind == kind and c.axes == ("tensor",) and c.bytes >= activation]
    # Per layer: the attention and MLP outputs forward, and backward one input gradient each
    # for q+k+v and gate+up (not five); plus the embedding's output and the head's input grad.
    layers = cfg.model.n_layers
    assert sum(c.executions for c in big) == 4 * layers + 2, big
    if sp:
        gathers = [c for c in got["collectives"]
                   if c.kind == "all-gather" and c.axes == ("tensor",) and c.bytes >= activation]
        # Entering attention and MLP forward, their output gradients backward, and each of
        # the two stacked matmuls' inputs again for its weight gradient (Megatron-SP keeps
        # each device's slice, not the gathered sequence); the head's input, the embedding's
        # output gradient.
        assert sum(c.executions for c in gathers) == 4 * layers + 2 * layers + 2, gathers


def test_sequence_parallel_replaces_tensor_all_reduce_by_reduce_scatter_and_all_gather():
    sp, tp = "data=4,tensor=2,sp", "data=4,tensor=2"
    cfg = layout(sp)["cfg"]
    activation = cfg.train.batch_size // cfg.mesh.data * cfg.train.seq_len * cfg.model.d_model * 4
    scatters = [c for c in collectives(sp, "reduce-scatter", ("tensor",))
                if c.bytes >= activation]
    gathers = [c for c in collectives(sp, "all-gather", ("tensor",))
               if c.bytes >= activation]
    layers = cfg.model.n_layers
    assert sum(c.executions for c in scatters) >= 4 * layers, scatters
    assert sum(c.executions for c in gathers) >= 4 * layers, gathers
    # Only small all-reduces (norm-scale gradients, the vocab-parallel loss) remain over tensor.
    sp_all_reduce = per_step_bytes(collectives(sp, "all-reduce", ("tensor",)))
    tp_all_reduce = per_step_bytes(collectives(tp, "all-reduce", ("tensor",)))
    assert sp_all_reduce < activation < tp_all_reduce


def activation_gathers(name: str) -> list[str]:
    """The HLO all-gathers of [rows, seq, d_model] activations (the tiny model's d_model: 64)."""
    return re.findall(r"= f32\[\d+,\d+,64\]\{([\d,]+)\} all-gather\(.*dimensions=\{(\d)\}",
                      layout(name)["hlo"])


@pytest.mark.parametrize(("name", "dimension"), [("data=4,tensor=2,sp", "0"),
                                                 ("data=4,tensor=2,sp,grad_accum=2", "1")])
def test_sequence_parallelism_gathers_whole_rows_where_each_devices_rows_divide(name, dimension):
    # Rows: each device's piece is contiguous, gathered straight into the row-major layout the
    # matmuls read. The sequence (one row per device): a strided piece of the row, which XLA
    # gathers sequence-major ({2,0,1}) and copies back.
    gathers = activation_gathers(name)
    assert len(gathers) >= 4 * layout(name)["cfg"].model.n_layers, gathers
    assert {d for _, d in gathers} == {dimension}
    if dimension == "0":
        assert {lay for lay, _ in gathers} == {"2,1,0"}


def test_zero1_shards_optimizer_state_and_gradients_and_gathers_updated_params():
    state = layout("data=4,zero1")["state"]
    for p in jax.tree.leaves(state.params):
        assert p.addressable_shards[0].data.shape == p.shape  # parameters stay whole
    total = sum(p.nbytes for p in jax.tree.leaves(state.params))
    moments = sum(m.addressable_shards[0].data.nbytes for m in jax.tree.leaves(state.opt_state)
                  if m.ndim > 0)
    assert moments == pytest.approx(2 * total / 4, rel=0.01)
    # Gradients are summed straight into each device's slice of the moments (ZeRO-2): a
    # reduce-scatter of the whole gradient, no all-reduce of it.
    scatters = collectives("data=4,zero1", "reduce-scatter", ("data",))
    assert per_step_bytes(scatters) == pytest.approx(total, rel=0.01)
    assert per_step_bytes(collectives("data=4,zero1", "all-reduce", ("data",))) < 0.01 * total
    gathers = collectives("data=4,zero1", "all-gather", ("data",))  # updated parameter slices
    assert per_step_bytes(gathers) == pytest.approx(total, rel=0.01)


def test_hybrid_layout_uses_each_axis_for_its_own_collective():
    name = "data=2,fsdp=2,tensor=2"
    assert collectives(name, "all-gather", ("fsdp",))
    assert collectives(name, "reduce-scatter", ("fsdp",))
    assert collectives(name, "all-reduce", ("tensor",))
    assert collectives(name, "all-reduce", ("data",))
    kinds = {(row["kind"], tuple(row["axes"]))
             for row in summarize_collectives(layout(name)["collectives"])}
    assert ("all-gather", ("data",)) not in kinds  # no weight gathers over plain data


@pytest.mark.parametrize("name", ["context=4", "data=2,context=2,tensor=2"])
def test_ring_attention_passes_kv_around_the_context_ring_and_never_gathers_it(name):
    cfg = layout(name)["cfg"]
    permutes = collectives(name, "collective-permute", ("context",))
    n = cfg.mesh.context
    # K and V (and their positions) hop n-1 times forward and n times backward, in every layer.
    assert sum(c.executions for c in permutes) >= 2 * (2 * n - 1) * cfg.model.n_layers
    assert not [c for c in layout(name)["collectives"]
                if "context" in c.axes and c.kind == "all-gather"]


def test_allgather_context_attention_gathers_kv_and_reduce_scatters_its_gradient():
    name = "data=2,context=4,allgather"
    layers = layout(name)["cfg"].model.n_layers
    gathers = collectives(name, "all-gather", ("context",))
    scatters = collectives(name, "reduce-scatter", ("context",))
    assert sum(c.executions for c in gathers) >= 2 * layers  # K and V, per layer
    assert sum(c.executions for c in scatters) >= 2 * layers  # dK and dV
    assert not collectives(name, "collective-permute", ("context",))


def data_reduction_bytes(accum: int) -> dict:
    result = run_layout(("mesh.data=4", "mesh.tensor=2", f"train.grad_accum={accum}",
                         f"train.batch_size={8 * accum}"))
    rows: dict = {}
    for c in result["collectives"]:
        if "data" in c.axes:
            rows[(c.kind, c.axes)] = rows.get((c.kind, c.axes), 0) + per_step_bytes([c])
    return rows


def test_gradient_accumulation_sums_over_data_once_per_step():
    # Each data shard sums its micro-steps' gradients locally; one all-reduce per step adds
    # them: the same bytes for 4 micro-steps as for 1 (the gradients' bytes and a few scalars).
    one, four = data_reduction_bytes(1), data_reduction_bytes(4)
    assert one == four, (one, four)
    params = run_layout(("mesh.data=4", "mesh.tensor=2", "train.grad_accum=1",
                         "train.batch_size=8"))["state"].params
    grads = sum(a.addressable_shards[0].data.nbytes for a in jax.tree.leaves(params))
    assert grads <= one[("all-reduce", ("data",))] <= grads + 1024


def test_qkv_biases_match_one_device_over_fsdp_context_and_tensor():
    # Their gradient is a sum over the tokens that projection.add_bias's VJP takes itself (in
    # parallel.reduce_dtype); the compiler completes it over the devices holding the tokens.
    bias = ("model.qkv_bias=true",)
    ref = run_layout(("mesh.data=1", *bias))
    got = run_layout(("mesh.data=1", "mesh.fsdp=2", "mesh.context=2", "mesh.tensor=2", *bias))
    assert abs(got["loss"] - ref["loss"]) / ref["loss"] < 1e-5
    assert_grads_and_params_match(got, ref)
    biases = [k for k in ref["grads"]["layers"]["attn"] if k.endswith("_bias")]
    assert sorted(biases) == ["k_bias", "q_bias", "v_bias"]
    assert all(np.abs(ref["grads"]["layers"]["attn"][k]).max() > 0 for k in biases)
