"""Every axis inside the pipeline stages: layouts of 16 and 32 virtual devices, each run in a
subprocess of its own (the test processes have 8), against the 1-device run.

These are the layouts that used to hang: an XLA:CPU collective-permute inside a stage's branch
waited for devices that never took it. The executor now runs one program on every stage.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = """
import json, sys
sys.path.insert(0, {tests!r})
from helpers import max_relative_error, run_layout
ref = run_layout({reference!r})
got = run_layout({layout!r})
order = got["trainer"].layer_order  # interleaved stages store the layers permuted
if order is not None:
    import jax, numpy as np
    back = np.argsort(order)
    for tree in (got["grads"], got["params"]):
        tree["layers"] = jax.tree.map(lambda a: a[back], tree["layers"])
print(json.dumps({{
    "loss": abs(got["loss"] - ref["loss"]) / ref["loss"],
    "grads": max(max_relative_error(got["grads"], ref["grads"]).values()),
    "params": max(max_relative_error(got["params"], ref["params"]).values()),
    "last_loss": abs(got["last_loss"] - ref["last_loss"]) / ref["last_loss"],
    "pipe_permutes": sum(c.kind == "collective-permute" and c.axes == ("pipe",)
                         for c in got["collectives"]),
}}))
"""

# MoE, dropless routing: the objective's aux losses are per microbatch, so the reference runs
# as many micro-steps as the pipeline has microbatches.
MOE = ("model.n_layers=4", "model.moe.num_experts=4", "model.moe.top_k=2",
       "model.moe.dispatch=dropless")
REFERENCE = ("mesh.data=1", "train.grad_accum=2", *MOE)
PIPE = ("mesh.pipe=2", "mesh.data=1", "train.microbatches=2", "parallel.pipeline_schedule=1f1b")


def run_in_subprocess(devices: int, layout: tuple[str, ...],
                      reference: tuple[str, ...] = REFERENCE) -> dict:
    tests = str(Path(__file__).resolve().parents[1])  # helpers.py
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=" ".join(
        [*flags, f"--xla_force_host_platform_device_count={devices}"]))
    code = SCRIPT.format(tests=tests, reference=reference, layout=layout)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def check(errors: dict) -> None:
    assert errors["loss"] < 1e-5 and errors["last_loss"] < 1e-5, errors
    assert errors["grads"] < 1e-4, errors
    assert errors["params"] < 1e-4, errors
    assert errors["pipe_permutes"] >= 1, errors


@pytest.mark.slow  # about 35 s; the 8-device MoE pipelines run in the default suite
def test_moe_dropless_inside_stages_with_fsdp_expert_and_tensor_on_16_devices():
    check(run_in_subprocess(16, (*PIPE, "mesh.fsdp=2", "mesh.expert=2", "mesh.tensor=2", *MOE)))


@pytest.mark.slow
def test_all_five_axes_with_ring_attention_on_32_devices():
    check(run_in_subprocess(32, (*PIPE, "mesh.fsdp=2", "mesh.expert=2", "mesh.context=2",
                                 "mesh.tensor=2", "parallel.context_impl=ring", *MOE)))


# Multi-head latent attention (DeepSeek-V3's) in the stages: its latent projections split over
# fsdp, its heads over tensor, its sequence over the ring, under the interleaved schedule and
# with all five axes. The other layouts of MLA are in tests/equivalence/test_mla_layouts.py.
MLA = ("model.mla.q_lora_rank=24", "model.mla.kv_lora_rank=16", "model.mla.qk_nope_head_dim=8",
       "model.mla.qk_rope_head_dim=8", "model.mla.v_head_dim=12", "model.mla.rope_interleave=true",
       "model.moe.router=sigmoid_bias", "model.moe.n_group=2", "model.moe.topk_group=1",
       "model.moe.num_shared_experts=1")
MLA_LAYOUTS = {
    "interleaved,pipe=2,context=2,tensor=2": (
        8, ("mesh.pipe=2", "mesh.data=1", "mesh.context=2", "mesh.tensor=2",
            "train.microbatches=2", "parallel.pipeline_schedule=interleaved",
            "parallel.virtual_stages=2", "parallel.context_impl=ring")),
    "five axes,ring": (
        32, (*PIPE, "mesh.fsdp=2", "mesh.expert=2", "mesh.context=2", "mesh.tensor=2",
             "parallel.context_impl=ring")),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MLA_LAYOUTS))
def test_latent_attention_inside_stages_matches_one_device(name):
    devices, layout = MLA_LAYOUTS[name]
    check(run_in_subprocess(devices, (*layout, *MOE, *MLA), (*REFERENCE, *MLA)))
