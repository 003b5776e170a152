"""``parallel.pipeline_fsdp``: the plan's bytes and memory for both values against hand
arithmetic (nothing compiled), and the layouts the option refuses. Against compiled steps:
tests/equivalence/test_cost_vs_compiled.py and test_pipeline_fsdp.py.
"""

from __future__ import annotations

import pytest
from helpers import assert_one_line_config_error
from helpers import tiny_8x32 as tiny

from jaxpar.config import ConfigError, load_config, validate
from jaxpar.cost.estimate import estimate

# tiny with 8 layers on pipe=2 fsdp=2 tensor=2: a stage holds 4 layers. One layer's weights,
# gathered over fsdp and still split over tensor (the matrices; the two norm scales whole):
# (q 64x64 + k, v 64x32 + o 64x64 + gate, up, down 64x128) / 2 + 2 x 64 = 18,560 float32.
LAYER = 18_560 * 4
STAGE = 4 * LAYER
# The embedding and lm_head [256, 64] split over tensor, and the final norm: gathered once.
OTHER = (2 * 256 * 64 // 2 + 64) * 4


def layout(fsdp: str, *more: str):
    return tiny("mesh.pipe=2", "mesh.data=1", "mesh.fsdp=2", "mesh.tensor=2", "model.n_layers=8",
                "train.microbatches=4", f"parallel.pipeline_fsdp={fsdp}", *more)


def fsdp_bytes(report, kind: str) -> int:
    return sum(r["bytes"] for r in report.collective_rows()
               if r["kind"] == kind and tuple(r["axes"]) == ("fsdp",))


@pytest.mark.parametrize("schedule, v, accum, slots", [
    # forward + backward rounds of the step's one schedule: 1F1B at p=2 over m=4 microbatches
    # runs 5 rounds with a forward slot and 5 with a backward one; interleaved (2 chunks of 2
    # layers a stage) 9 and 9. grad_accum=2 folds in: one schedule over 8 microbatches, 9 and
    # 9 (17 and 17 interleaved), not twice 5 and 5.
    ("1f1b", 1, 1, 5 + 5), ("interleaved", 2, 1, 9 + 9),
    ("1f1b", 1, 2, 9 + 9), ("interleaved", 2, 2, 17 + 17)])
def test_per_layer_gathers_every_layer_in_every_slot(schedule, v, accum, slots):
    more = (f"parallel.pipeline_schedule={schedule}", f"parallel.virtual_stages={v}",
            f"train.grad_accum={accum}", f"train.batch_size={8 * accum}")
    per_step, per_layer = estimate(layout("per_step", *more)), estimate(layout("per_layer", *more))
    assert fsdp_bytes(per_step, "all-gather") == STAGE + OTHER
    assert fsdp_bytes(per_step, "reduce-scatter") == STAGE + OTHER  # float32, once per step
    # Each slot gathers its chunk (STAGE / v) layer by layer, and a backward slot
    # reduce-scatters the chunk's gradients (float32): half of the slots.
    assert fsdp_bytes(per_layer, "all-gather") == slots * STAGE // v + OTHER
    assert fsdp_bytes(per_layer, "reduce-scatter") == slots // 2 * STAGE // v + OTHER


def test_per_layer_holds_one_layer_whole_and_sums_in_shards():
    per_step, per_layer = estimate(layout("per_step")).memory, estimate(layout("per_layer")).memory
    # Weights as read: per_step the stage's layers and the running one again; per_layer one
    # layer gathered and as its matmuls read it. The rest (vocabulary pieces, norm) the same.
    assert per_step.weight_copies - per_layer.weight_copies == (4 + 1 - 2) * LAYER
    # The layers' float32 gradient sums: whole over fsdp, or in their fsdp=2 shards.
    assert per_step.gradient_sums - per_layer.gradient_sums == STAGE - STAGE // 2
    assert per_layer.peak < per_step.peak


@pytest.mark.parametrize("overrides, needle", [
    (("mesh.pipe=2", "mesh.data=4", "train.microbatches=2"),
     "needs mesh.pipe > 1 and mesh.fsdp > 1"),
    (("mesh.pipe=1", "mesh.fsdp=8"), "needs mesh.pipe > 1 and mesh.fsdp > 1"),
    (("mesh.pipe=2", "mesh.data=1", "mesh.fsdp=4", "train.microbatches=2", "train.lora.rank=4"),
     "not with train.lora"),
])
def test_per_layer_refuses_layouts_it_would_change_nothing_in_or_lora(overrides, needle):
    assert_one_line_config_error([*overrides, "parallel.pipeline_fsdp=per_layer"], needle,
                                 "parallel.pipeline_fsdp")


def test_an_unknown_pipeline_fsdp_value_names_the_allowed_ones():
    with pytest.raises(ConfigError, match="per_step.*per_layer|per_layer.*per_step"):
        validate(load_config("tiny", ["parallel.pipeline_fsdp=per_microbatch"]), 8)
