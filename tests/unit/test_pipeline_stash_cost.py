"""``parallel.pipeline_stash``: the layouts it refuses, the plan's memory, flops and bytes for
``inputs`` against hand arithmetic (nothing compiled), and ``plan --search`` trying it as a
lever. Against compiled steps: tests/equivalence/test_pipeline_stash.py and
test_cost_vs_compiled.py.
"""

from __future__ import annotations

import dataclasses

import pytest
from helpers import assert_one_line_config_error
from helpers import tiny_8x32 as tiny

from jaxpar.config import ConfigError, load_config
from jaxpar.cost.estimate import estimate
from jaxpar.cost.search import MeshLayout, _expand, _try, layouts
from jaxpar.hardware import get_profile
from jaxpar.model.flop_formula import matmul_params
from jaxpar.parallel.pipeline.executor import describe

# tiny with 8 layers on pipe=2 data=2 tensor=2, 1F1B over 4 microbatches: a stage holds 4
# layers, and its first stage 2p - 1 = 3 microbatches between a forward and its backward (and
# a spare slot).
PIPE = ("mesh.pipe=2", "mesh.data=2", "mesh.tensor=2", "model.n_layers=8",
        "train.microbatches=4", "parallel.pipeline_schedule=1f1b")
# One microbatch's residual stream on a device: 1 row x 32 tokens x 64, float32 (whole over
# tensor without sequence parallelism)
ACT = 1 * 32 * 64 * 4


def both(*more: str):
    return [estimate(tiny(*PIPE, *more, f"parallel.pipeline_stash={stash}"))
            for stash in ("residuals", "inputs")]


@pytest.mark.parametrize("overrides, needle", [
    (("mesh.pipe=1", "mesh.data=8"), "needs mesh.pipe > 1"),
    (("mesh.pipe=2", "mesh.data=4", "train.microbatches=4",
      "parallel.pipeline_schedule=zero_bubble"),
     "not with parallel.pipeline_schedule=zero_bubble"),
    (("mesh.pipe=2", "mesh.data=4", "train.microbatches=4", "model.n_layers=4",
      "parallel.pipeline_schedule=dualpipe_v"), "not with parallel.pipeline_schedule=dualpipe_v"),
])
def test_inputs_refuses_layouts_without_stages_or_with_the_backward_split(overrides, needle):
    assert_one_line_config_error([*overrides, "parallel.pipeline_stash=inputs"], needle,
                                 "parallel.pipeline_stash")


def test_an_unknown_value_names_the_key_and_the_values():
    with pytest.raises(ConfigError, match="parallel.pipeline_stash") as err:
        load_config("tiny", ["parallel.pipeline_stash=everything"])
    assert "residuals" in str(err.value) and "inputs" in str(err.value)


def test_a_slot_holds_the_chunks_input_and_the_backward_makes_the_chunk_again():
    residuals, inputs = (r.memory for r in both("train.remat=full"))
    # remat=full keeps each layer's input: a slot holds 4 of them, or the chunk's input alone.
    slots = 3 + 1
    assert residuals.stash - inputs.stash == slots * (4 - 1) * ACT
    # The backward slot makes the chunk's 4 layer inputs again, beside its working set.
    assert inputs.working - residuals.working == 4 * ACT
    assert inputs.peak < residuals.peak


def test_the_chunks_forward_runs_again_in_every_backward_slot():
    residuals, inputs = both()
    cfg = tiny(*PIPE)
    info = describe("1f1b", 2, 4)
    m = cfg.model
    # Per token: the layers' matmuls (2 flops a weight) and attention's scores and values.
    forward = (2 * (matmul_params(m) - m.d_model * m.vocab_size)
               + 4 * m.n_layers * m.n_heads * (m.d_model // m.n_heads) * cfg.train.seq_len)
    tokens = cfg.train.batch_size * cfg.train.seq_len / 8
    runs = info["backward_steps"] / info["microbatches"]  # per useful chunk run
    extra = inputs.flops.recompute - residuals.flops.recompute
    assert extra == pytest.approx(runs * forward * tokens)
    timed = [estimate(tiny(*PIPE, f"parallel.pipeline_stash={stash}"), get_profile("tpu-v5p"))
             for stash in ("residuals", "inputs")]
    assert timed[1].time.step > timed[0].time.step


def test_sequence_parallel_gathers_and_scatters_once_more_per_backward_slot():
    sp = ("parallel.sequence_parallel=true",)
    residuals, inputs = (estimate(tiny(*PIPE, *sp, f"parallel.pipeline_stash={stash}"))
                         for stash in ("residuals", "inputs"))
    info = describe("1f1b", 2, 4)
    layers = 4  # a stage's

    def count(report, kind):
        return sum(r["count"] for r in report.collective_rows()
                   if r["kind"] == kind and tuple(r["axes"]) == ("tensor",))
    # Each backward slot (masked ones too) gathers the attention and MLP inputs and scatters
    # their outputs again, for each layer of its chunk.
    again = info["backward_steps"] * layers * 2
    assert count(inputs, "all-gather") - count(residuals, "all-gather") == again
    assert count(inputs, "reduce-scatter") - count(residuals, "reduce-scatter") == again


def test_per_layer_fsdp_gathers_each_layer_once_more_per_backward_slot():
    fsdp = ("mesh.data=1", "mesh.fsdp=2", "mesh.tensor=2", "parallel.pipeline_fsdp=per_layer")
    residuals, inputs = (estimate(tiny(*PIPE, *fsdp, f"parallel.pipeline_stash={stash}"))
                         for stash in ("residuals", "inputs"))

    def gathered(report):
        return sum(r["bytes"] for r in report.collective_rows()
                   if r["kind"] == "all-gather" and tuple(r["axes"]) == ("fsdp",))
    # A stage's 4 layers gathered over fsdp, still split over tensor (float32): one layer's
    # matrices (q 64x64 + k, v 64x32 + o 64x64 + gate, up, down 64x128) / 2 and two norm
    # scales (tests/unit/test_pipeline_fsdp_cost.py).
    stage = 4 * 18_560 * 4
    backward_steps = describe("1f1b", 2, 4)["backward_steps"]
    # (F + B) gathers of the stage's layers become F + 2B.
    assert gathered(inputs) - gathered(residuals) == backward_steps * stage


def test_the_search_tries_inputs_as_a_lever_where_the_backward_runs_whole():
    cfg = tiny(*PIPE)
    piped = [lay for lay in layouts(cfg, 8) if lay.pipe > 1]
    assert {lay.pipeline_stash for lay in piped} == {"residuals"}  # probed: nothing rerun
    # llama3-70b on 128 chips of 16 GiB (tpu-v5e): this 1F1B layout fits only with the
    # chunks' inputs stashed (`plan --search` ranks it 13th there).
    big = load_config("llama3-70b", [])
    layout = MeshLayout(data=1, fsdp=4, context=1, tensor=8, pipe=4, schedule="1f1b",
                    microbatches=16, pipeline_fsdp="per_layer", pipeline_stash="residuals")
    hw = get_profile("tpu-v5e")
    probe = _try(big, layout, "none", False, 128, hw)
    best = _expand(big, probe, 128, hw)
    assert best.fits and best.pipeline_stash == "inputs", best.reason
    assert "parallel.pipeline_stash=inputs" in best.overrides()
    assert "stash inputs" in best.layout
    kept = _expand(big, dataclasses.replace(probe, layout_=dataclasses.replace(
        layout, schedule="zero_bubble")), 128, hw)
    assert kept.pipeline_stash == "residuals"  # zero bubble refuses it: never tried
