"""The remat policies beyond none, full and dots (``jaxpar/model/remat.py``): ``attention``
(q, k, v, the attention output and the attention branch kept by name; the MLP recomputed),
``offload_dots`` (dots in host memory) and ``train.remat_every`` (the policy in one layer of
every k). Each gives the one-device loss, gradients and parameters on ``data=2 fsdp=2
tensor=2``; the compiled step keeps what the policy says and recomputes what the plan counts.
"""

from __future__ import annotations

import pytest
from helpers import assert_grads_and_params_match, run_layout
from helpers import tiny_8x32 as tiny

from jaxpar.cost.estimate import estimate

MESH = ("mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2")
POLICIES = {
    "attention,sp": ("train.remat=attention", "parallel.sequence_parallel=true"),
    "offload_dots": ("train.remat=offload_dots",),
    "full,every=2": ("train.remat=full", "train.remat_every=2"),
}


@pytest.mark.parametrize("name", POLICIES)
def test_remat_policy_gives_the_one_device_loss_gradients_and_parameters(name):
    ref = run_layout(())
    got = run_layout((*POLICIES[name], *MESH))
    assert abs(got["loss"] - ref["loss"]) <= 1e-5 * abs(ref["loss"])
    assert_grads_and_params_match(got, ref)


def test_attention_policy_recomputes_the_mlp_and_keeps_the_attention():
    """The compiled step runs the forward matmuls of the MLP twice and those of attention once:
    its matmul flops are the plan's (which counts the MLP's gate and up again, and dense
    attention's scores), and fall between dots' and full's."""
    from jaxpar.inspect.hlo.flops import dot_flops
    from jaxpar.mesh import make_mesh
    from jaxpar.train.step import build_trainer

    flops = {}
    for remat in ("dots", "attention", "full"):
        cfg = tiny("mesh.data=8", f"train.remat={remat}")
        text = build_trainer(cfg, make_mesh(cfg)).compile_step().as_text()
        flops[remat] = dot_flops(text)
        planned = estimate(cfg).flops.executed
        assert abs(flops[remat] - planned) <= 0.10 * flops[remat], (remat, flops[remat], planned)
    assert flops["dots"] < flops["attention"] < flops["full"], flops
