"""LoRA (``train.lora``) inside pipelines (docs/lora.md): only the adapters train.

The tiny preset with 4 layers (so that the interleaved schedule's 2 stages x 2 chunks divide
it), ``helpers.LAYOUT_BASE`` (3 steps), float32, adapters on every target. Against one device:
the loss (relative 1e-5), the adapters' gradients and their values after the steps (1e-4); the
base weights come out bit for bit as they went in, and the compiled step sums no base-weight
gradient over the batch axes.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from helpers import (
    assert_grads_and_params_match,
    in_model_order,
    max_relative_error,
    per_step_bytes,
    run_layout,
)

from jaxpar.model.lora import adapter_part, base_part

LORA = ("train.lora.rank=4", "train.lora.alpha=8", "model.n_layers=4")
REFERENCE = (*LORA, "mesh.data=1")


def lora_pipeline(schedule: str, *mesh: str) -> tuple[str, ...]:
    v = ("parallel.virtual_stages=2",) if schedule in ("interleaved", "dualpipe_v") else ()
    m = 4 if schedule == "dualpipe_v" else 2  # DualPipe's m >= 2p
    return (*LORA, "mesh.pipe=2", *mesh, f"train.microbatches={m}",
            f"parallel.pipeline_schedule={schedule}", *v)


def assert_lora_run_matches_one_device(got: dict, ref: dict) -> None:
    """The loss, adapter-only gradients, parameters after the steps (in model order) against
    one device; the base weights as initialised, and the adapters moved (so the comparison is
    not of two untouched initialisations)."""
    assert abs(got["loss"] - ref["loss"]) <= 1e-5 * abs(ref["loss"])
    assert abs(got["last_loss"] - ref["last_loss"]) <= 1e-5 * abs(ref["last_loss"])
    grads, params = in_model_order(got)
    assert grads and not base_part(grads)
    assert_grads_and_params_match({"grads": grads, "params": params}, ref)
    init = jax.tree.map(np.asarray, ref["trainer"].init().params)
    base_after, base_before = base_part(params), base_part(init)
    assert jax.tree.structure(base_after) == jax.tree.structure(base_before)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(base_after),
                                                    jax.tree.leaves(base_before), strict=True))
    moved = max_relative_error(adapter_part(params), adapter_part(init))
    assert min(moved.values()) > 1e-4, moved


def test_lora_in_a_1f1b_pipeline_on_pipe_data_matches_one_device() -> None:
    got = run_layout(lora_pipeline("1f1b", "mesh.data=2"))
    assert_lora_run_matches_one_device(got, run_layout(REFERENCE))
    # The optimizer state: the adapters' two AdamW moments, nothing of the base weights.
    adapters = sum(a.size for a in jax.tree.leaves(adapter_part(got["params"])))
    state = [a for a in jax.tree.leaves(got["state"].opt_state) if a.ndim > 0]
    assert sum(a.size for a in state) == 2 * adapters


def test_lora_pipeline_sums_only_adapter_gradients() -> None:
    """Over ``data`` the step's sums move at most the adapters' bytes (and the loss), far below
    the base weights'; over ``pipe`` no parameter gradient is summed (the frozen embedding and
    head's pieces were, without LoRA: 128 KiB here): what remains are the hand-overs, each at
    most one microbatch's ``[rows, seq, d_model]`` float32 activation and its ``[rows, seq]``
    loss statistics (which XLA may combine into one all-reduce), and the gradient norm's
    per-adapter partial sums."""
    got = run_layout(lora_pipeline("1f1b", "mesh.data=2"))
    adapters = sum(a.nbytes for a in jax.tree.leaves(adapter_part(got["params"])))
    weights = sum(a.nbytes for a in jax.tree.leaves(base_part(got["params"])))
    assert weights / 8 > adapters + 1024  # the bound below can fail
    sums = [c for c in got["collectives"] if c.kind in ("all-reduce", "reduce-scatter")]
    over_data = per_step_bytes([c for c in sums if "data" in c.axes])
    assert 0 < over_data <= adapters + 1024, (over_data, adapters)
    cfg = got["cfg"]
    rows = cfg.train.batch_size // (cfg.train.microbatches * cfg.mesh.data)
    hand_over = rows * cfg.train.seq_len * (cfg.model.d_model + 1) * 4
    over_pipe = [c for c in sums if c.axes == ("pipe",)]
    # (In a round XLA unrolls, it may add two hand-overs in one all-reduce: the embedding's
    # and the last stage's output, both made before either is read.)
    assert over_pipe and all(c.bytes <= 2 * hand_over for c in over_pipe), over_pipe


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "interleaved", "zero_bubble", "dualpipe_v"])
def test_lora_in_other_pipeline_schedules_matches_one_device(schedule: str) -> None:
    # (zero bubble and DualPipe-V: the adapters' I and W cut from the backward's equations;
    # the frozen base weights are constants of both)
    assert_lora_run_matches_one_device(run_layout(lora_pipeline(schedule, "mesh.data=2")),
                                       run_layout(REFERENCE))


@pytest.mark.slow
def test_lora_with_grad_accum_folded_into_the_pipeline_matches_one_device() -> None:
    """``train.grad_accum=2`` micro-steps of 2 microbatches, one schedule of 4."""
    got = run_layout((*lora_pipeline("1f1b", "mesh.data=2"), "train.grad_accum=2"))
    assert_lora_run_matches_one_device(got, run_layout(REFERENCE))


@pytest.mark.slow
def test_lora_in_a_pipeline_with_fsdp_and_tensor_matches_one_device() -> None:
    """pipe x fsdp x tensor: the adapters gathered over ``fsdp`` once per step and their
    gradients reduce-scattered back, ``o``/``down``'s ``(x A)`` summed over ``tensor``."""
    got = run_layout(lora_pipeline("1f1b", "mesh.fsdp=2", "mesh.tensor=2"))
    assert_lora_run_matches_one_device(got, run_layout(REFERENCE))


# A mixture of experts in the stages: the objective's MoE aux losses are per microbatch, so the
# reference is the one-device run with as many micro-steps (as tests/equivalence/test_pipeline.py).
MOE = ("model.n_layers=4", "model.moe.num_experts=4", "model.moe.top_k=2",
       "model.moe.router=sigmoid_bias", *LORA[:2])


@pytest.mark.slow
def test_expert_adapters_in_a_pipeline_with_expert_parallelism_match_one_device() -> None:
    """Every target, the routed experts' own adapters among them, in a 1F1B pipeline whose
    stages split the experts over ``expert`` (the dispatch's shard_map nested in the
    executor's)."""
    ref = run_layout(("mesh.data=1", "train.grad_accum=2", *MOE))
    got = run_layout(("mesh.pipe=2", "mesh.expert=2", "mesh.data=1", "train.microbatches=2",
                      "parallel.pipeline_schedule=1f1b", *MOE))
    assert_lora_run_matches_one_device(got, ref)
    experts = [a for path, a in jax.tree_util.tree_leaves_with_path(adapter_part(got["grads"]))
               if "'moe'" in jax.tree_util.keystr(path)]
    assert len(experts) == 6 and all(a.shape[1] == 4 for a in experts)  # per expert
