"""The dtype of the gradient sums (``parallel.reduce_dtype``), read from the train step compiled
by the TPU compiler for a tpu-v5e:2x4 slice (``jaxpar inspect --target`` in a subprocess):
XLA:CPU cannot compile bf16 gradient sums (train/step.py: check_reduce_dtype)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import needs_libtpu, run_inspect

from jaxpar.inspect.hlo.collectives import parse_collectives


def gradient_sum_dtypes(tmp_path: Path, *overrides: str) -> dict[tuple, set[str]]:
    """The tiny preset's (or the preset named first) train step compiled by the TPU compiler for
    tpu-v5e:2x4: the dtypes of its all-reduces and reduce-scatters, by (kind, mesh axes);
    scalars (the loss, token counts) left out."""
    preset = "tiny"
    if overrides and "=" not in overrides[0]:
        preset, *overrides = overrides
    hlo = tmp_path / "step.hlo"
    result = run_inspect(preset, *overrides, "--target", "tpu-v5e:2x4", "--json", "-",
                         "--hlo", str(hlo), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    mesh = json.loads(result.stdout)["mesh"]
    out: dict[tuple, set[str]] = {}
    for c in parse_collectives(hlo.read_text(), mesh):
        if c.kind in ("all-reduce", "reduce-scatter") and c.bytes > 64:
            out.setdefault((c.kind, c.axes), set()).update(c.dtype.split("+"))
    return out


@pytest.mark.parametrize("overrides, expected", [
    # The partitioner would sum bf16 matmul gradients in bf16: the default sums by hand in f32.
    (["mesh.data=8", "train.dtype=bfloat16"], {("all-reduce", ("data",)): {"f32"}}),
    (["mesh.data=8", "train.dtype=bfloat16", "parallel.reduce_dtype=bfloat16"],
     {("all-reduce", ("data",)): {"bf16"}}),
    (["mesh.data=8", "parallel.reduce_dtype=bfloat16"], {("all-reduce", ("data",)): {"bf16"}}),
    (["mesh.data=2", "mesh.fsdp=2", "mesh.pipe=2", "train.microbatches=2"],
     {("reduce-scatter", ("fsdp",)): {"f32"}, ("all-reduce", ("data",)): {"f32"}}),
    (["mesh.data=2", "mesh.fsdp=2", "mesh.pipe=2", "train.microbatches=2",
      "parallel.reduce_dtype=bfloat16"],
     {("reduce-scatter", ("fsdp",)): {"bf16"}, ("all-reduce", ("data",)): {"bf16"}}),
    # Sums the partitioner takes (FSDP's reduce-scatter, the weight gradients' sum over
    # context): bf16 matmuls produce f32 weight gradients for them (projection.project_all).
    (["mesh.data=1", "mesh.fsdp=8", "train.dtype=bfloat16"],
     {("reduce-scatter", ("fsdp",)): {"f32"}}),
    (["mesh.data=1", "mesh.fsdp=8", "train.dtype=bfloat16", "parallel.reduce_dtype=bfloat16"],
     {("reduce-scatter", ("fsdp",)): {"bf16", "f32"}}),  # f32: norm scales and lm_head
    (["mesh.data=1", "mesh.fsdp=4", "mesh.context=2", "train.dtype=bfloat16"],
     {("reduce-scatter", ("fsdp",)): {"f32"}, ("all-reduce", ("context",)): {"f32"}}),
    # The q/k/v biases' sums over the tokens' devices (projection.add_bias: bf16 before).
    (["mesh.data=1", "mesh.fsdp=4", "mesh.context=2", "train.dtype=bfloat16",
      "model.qkv_bias=true"], {("all-reduce", ("fsdp", "context")): {"f32"}}),
    # The experts' weights, gathered in bf16 inside the expert-parallel shard_map: their
    # reduce-scatter over fsdp and sum over context (expert.used_expert_weight: bf16 before),
    # with the one all-gather (the default's rings send these sums as permutes); the other
    # weights' reduce-scatter over fsdp x expert.
    (["moe-tiny", "mesh.data=1", "mesh.expert=2", "mesh.context=2", "mesh.fsdp=2",
      "train.dtype=bfloat16", "parallel.fsdp_gather=all_gather"],
     {("reduce-scatter", ("fsdp",)): {"f32"}, ("all-reduce", ("context",)): {"f32"},
      ("reduce-scatter", ("fsdp", "expert")): {"f32"}}),
], ids=["data8-bf16-compute-default", "data8-bf16-compute-reduce-bf16", "data8-reduce-bf16",
        "pipe2-data2-fsdp2-default", "pipe2-data2-fsdp2-reduce-bf16", "fsdp8-bf16-default",
        "fsdp8-bf16-reduce-bf16", "fsdp4-context2-bf16-default", "qkv-bias-fsdp4-context2-bf16",
        "moe-expert2-context2-fsdp2-bf16"])
def test_reduce_dtype_is_the_dtype_of_the_gradient_sums_on_tpu(tmp_path, overrides, expected):
    needs_libtpu()
    found = gradient_sum_dtypes(tmp_path, *overrides)
    print(f"\n{' '.join(overrides)}: {found}")
    for key, dtypes in expected.items():
        assert found.get(key) == dtypes, found
