"""The analytic cost model and ``jaxpar plan`` against hand arithmetic (nothing compiled).

The same model against compiled steps: ``tests/equivalence/test_cost_vs_compiled.py``.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
from helpers import tiny_8x32 as tiny
from rich.console import Console

from jaxpar.config import ConfigError, load_config, validate
from jaxpar.cost.estimate import estimate, wire_bytes
from jaxpar.cost.plan import format_search, layouts, plan_main, search
from jaxpar.hardware import GB, PROFILES, get_profile, peak_flops

DEVICES = 8

# --------------------------------------------------------------------------------------------
# Per layer


@pytest.mark.parametrize("remat, passes", [("none", 2), ("dots", 2)])
def test_layer_collectives_are_counted_per_layer_per_step(remat, passes):
    """Two more layers add two layers' FSDP gathers, twice each: forward, and backward (remat
    gathers them again; without remat the layers reshard after the forward pass)."""
    two, four = (estimate(tiny("mesh.data=1", "mesh.fsdp=8", f"model.n_layers={n}",
                               f"train.remat={remat}")) for n in (2, 4))
    gathers = [next(r for r in rep.collective_rows() if r["kind"] == "all-gather")["bytes"]
               for rep in (two, four)]
    assert gathers[1] - gathers[0] == 2 * passes * 147_968  # one layer's weights: 147,968 B


# --------------------------------------------------------------------------------------------
# Hand-checked numbers for tiny (d_model 64, 2 layers, 8 heads / 4 kv heads of 8, d_ff 128,
# vocab 256, batch 8 x 32 tokens, float32)


def test_tiny_fsdp8_bytes_and_flops_by_hand():
    report = estimate(tiny("mesh.data=1", "mesh.fsdp=8"), "h100")
    # One layer: wq 64*8*8 + wk, wv 64*4*8 each + wo 64*8*8 = 12,288; mlp 3*64*128 = 24,576;
    # two norms 2*64: 36,992 floats = 147,968 B. Whole model: 2 layers + embedding 256*64 +
    # lm_head 64*256 + final norm 64 = 106,816 floats = 427,264 B; 1/8 on each device.
    assert sum(p.bytes_per_device for p in report.params) == 427_264 // 8 == 53_408
    assert report.memory.optimizer == 2 * 53_408 + 8  # mu, nu and two int32 counts
    rows = {(r["kind"], tuple(r["axes"])): r for r in report.collective_rows()}
    # Weight gathers: each layer's twice (forward, and backward: reshard after forward),
    # 4 * 147,968 = 591,872, plus the embedding, lm_head (65,536 each) and final norm (256)
    # once: 723,200 B; a ring sends 7/8 of it.
    assert rows["all-gather", ("fsdp",)]["bytes"] == 723_200
    assert rows["all-gather", ("fsdp",)]["wire_bytes"] == 723_200 * 7 // 8
    # Gradients: all 427,264 B reduce-scattered once (one micro-step).
    assert rows["reduce-scatter", ("fsdp",)]["bytes"] == 427_264
    # Flops per token: 6 * matmul params (2 * 36,864 + 64*256 = 90,112) + causal attention
    # (half the square) 6 * 2 layers * 8 heads * 8 * 32 = 540,672 + 24,576 = 565,248; 256
    # tokens over 8 devices.
    assert report.flops.model == 565_248 * 256 / 8
    # The weight gradient's one-hot matmul; the forward gathers rows.
    assert report.flops.embedding_one_hot == 2 * 256 * 64 * 256 / 8
    # Exposed (the overlap rule): the layers' gathers and reduce-scatters and the embedding's
    # reduce-scatter are collective matmuls, hidden but for 1 of the ring's 8 steps; the
    # gathers outside the layer loop (embedding, lm_head, final norm: 131,328 B) and lm_head's
    # and the final norm's reduce-scatter (65,792 B) are exposed.
    rings = 591_872 + 2 * 147_968 + 65_536
    assert sum(r["exposed_bytes"] for r in rows.values()) == round(
        rings / 8 + 131_328 + 65_792)
    # Time on an H100 (NVLink: 450 GB/s each way; fsdp=8 fits one node): ring traffic, 7/8 of
    # the payload, overlapped where hidden and blocking where exposed; 1 MB of it takes longer
    # than 21 MFLOP at 989 TFLOP/s; each collective launched adds NVLink's 10 us.
    overlapped = 7 / 8 * rings * 7 / 8 / (450 * GB)
    blocking = (1 / 8 * rings + 131_328 + 65_792) * 7 / 8 / (450 * GB)
    launches = sum(c.count for c in report.collectives)
    assert report.time.overlapped_comm == pytest.approx(overlapped)
    assert report.time.blocking_comm == pytest.approx(blocking)
    assert report.time.latency == pytest.approx(launches * 10e-6)
    assert report.time.step == pytest.approx(blocking + max(overlapped, report.time.compute)
                                              + launches * 10e-6)


def test_tiny_tensor_parallel_all_reduces_by_hand():
    report = estimate(tiny("mesh.data=2", "mesh.tensor=4"))
    rows = {(r["kind"], tuple(r["axes"])): r for r in report.collective_rows()}
    # A = 4 sequences x 32 tokens x 64 x 4 B = 32,768 B. Per layer 2 forward (attention, MLP
    # outputs) + 3 backward (input gradients of q, of k+v and of gate+up: tiny's attention is
    # grouped-query, so q and k/v are two matmuls); embedding and lm_head 1 each; loss
    # 2 x 4 * 32 floats: 2 * 5 * 32,768 + 2 * 32,768 + 2 * 512 = 394,240 B.
    assert rows["all-reduce", ("tensor",)]["bytes"] == 394_240
    assert rows["all-reduce", ("tensor",)]["count"] == 2 * 5 + 2 + 2
    # The TPU compiler sums the q, k, v (and gate, up) input gradients before reducing: 2 per
    # layer backward instead of 5, i.e. 2 * 4 * 32,768 + 2 * 32,768 + 2 * 512 = 328,704 B.
    tpu = {(r["kind"], tuple(r["axes"])): r for r in estimate(
        tiny("mesh.data=2", "mesh.tensor=4"), "tpu-v5e").collective_rows()}
    assert tpu["all-reduce", ("tensor",)]["bytes"] == 328_704
    # Gradients over data: each device's tensor shard, 4 * (2 * (36,864/4 + 128) + 2 * 4,096
    # + 64) = 107,776 B; a 2-way ring all-reduce sends 2 * 1/2 of it.
    assert rows["all-reduce", ("data",)]["bytes"] == 107_776
    assert rows["all-reduce", ("data",)]["wire_bytes"] == 107_776


def test_data_gradients_travel_in_parallel_reduce_dtype():
    # float32 by default, bf16 matmuls or not: on an accelerator the sum goes by hand
    # (parallel/zero.py: data_summed_by_hand); XLA:CPU's partitioner sums in float32 anyway.
    # Every gradient: layer weights 2 * 36,864, embedding and lm_head 16,384 each, norm scales
    # 2 * 2 * 64 + 64, in 4 bytes.
    cfg = tiny("mesh.data=8", "train.dtype=bfloat16")
    whole = (2 * 36_864 + 2 * 16_384 + 2 * 2 * 64 + 64) * 4
    (tpu,) = estimate(cfg, "tpu-v5e").collective_rows()
    (cpu,) = estimate(cfg).collective_rows()
    assert tpu["bytes"] == cpu["bytes"] == whole == 427_264
    # parallel.reduce_dtype=bfloat16 halves all of it (the TPU compile agrees:
    # tests/equivalence/test_mixed_precision.py checks its all-reduce dtypes).
    (tpu,) = estimate(tiny("mesh.data=8", "parallel.reduce_dtype=bfloat16"),
                      "tpu-v5e").collective_rows()
    assert tpu["bytes"] == whole // 2


def test_bfloat16_parameters_halve_parameter_and_gradient_memory_not_the_moments():
    full = estimate(tiny("mesh.data=8")).memory
    half = estimate(tiny("mesh.data=8", "train.param_dtype=bfloat16")).memory
    norms = (2 * 2 * 64 + 64) * 4  # float32 whatever train.param_dtype (layers.FULL_PRECISION)
    assert half.params == (full.params - norms) // 2 + norms
    assert half.gradients == half.params
    assert half.optimizer == full.optimizer


def test_ring_attention_blocks_by_hand():
    report = estimate(tiny("mesh.data=4", "mesh.context=2"))
    permutes = [c for c in report.collectives if c.kind == "collective-permute"]
    # A K (or V) block: 2 sequences x 16 tokens x 4 kv heads x 8 x 4 B = 4,096 B. Per layer:
    # K, V forward (c-1 = 1 hop), again backward, and dK, dV over c = 2 hops: 8 blocks.
    assert sum(c.bytes for c in permutes) == 2 * 8 * 4_096
    assert all(c.hidden == 1 for c in permutes)
    # Zigzag: each device computes 2c+1 = 5 of its 4c = 8 chunk pairs, with a flash-style
    # backward (7/6 of dense attention's flops), so attention costs 5/8 * 7/6 of the whole
    # square's, of which the causal half is useful (flop_formula.py's attention term).
    square = 12 * 2 * 8 * 8 * 32 * 256 / 8  # forward and backward over the whole square
    assert report.flops.attention_extra == pytest.approx(square * (5 / 8 * 7 / 6 - 1 / 2))


def test_wire_bytes_follow_ring_algorithms():
    assert wire_bytes("all-reduce", 800, 8) == 1400  # 2 (N-1)/N
    assert wire_bytes("all-gather", 800, 8) == 700  # (N-1)/N
    assert wire_bytes("reduce-scatter", 800, 8) == 700
    assert wire_bytes("collective-permute", 800, 2) == 800
    assert wire_bytes("all-reduce", 800, 1) == 0


def test_remat_trades_saved_activations_for_recompute():
    reports = {r: estimate(tiny("mesh.data=8", f"train.remat={r}")) for r in ("none", "dots",
                                                                            "full")}
    saved = [reports[r].memory.activations for r in ("none", "dots", "full")]
    recompute = [reports[r].flops.recompute for r in ("none", "dots", "full")]
    assert saved[0] > saved[1] > saved[2] > 0
    assert recompute[0] == 0 < recompute[1] < recompute[2]


def test_attention_policy_saves_and_recomputes_between_dots_and_full():
    reports = {r: estimate(tiny("mesh.data=8", f"train.remat={r}"), "tpu-v5p")
               for r in ("dots", "attention", "full")}
    saved = [reports[r].memory.activations for r in ("dots", "attention", "full")]
    recompute = [reports[r].flops.recompute for r in ("dots", "attention", "full")]
    assert saved[0] > saved[1] > saved[2]
    assert recompute[0] < recompute[1] < recompute[2]


def test_remat_every_interpolates_between_none_and_the_policy():
    """remat_every=2: half the layers under the policy, half keeping everything."""
    def report(*overrides):
        return estimate(tiny("mesh.data=8", "model.n_layers=4", *overrides))
    none, full = report("train.remat=none"), report("train.remat=full")
    half = report("train.remat=full", "train.remat_every=2")
    expected = (none.memory.activations + full.memory.activations) / 2
    assert abs(half.memory.activations - expected) <= 4
    assert half.flops.recompute == pytest.approx(full.flops.recompute / 2)


def test_offload_dots_keeps_the_dots_in_host_memory_on_an_accelerator():
    """On a GPU/TPU compiler the matmul outputs dots keeps go to host memory (the device keeps
    each layer's input, as under full); XLA:CPU, one memory, compiles dots' program."""
    def report(remat, hardware):
        return estimate(tiny("mesh.data=8", f"train.remat={remat}"), hardware).memory
    dots, full = report("dots", "tpu-v5p"), report("full", "tpu-v5p")
    offload = report("offload_dots", "tpu-v5p")
    assert offload.activations == full.activations
    assert offload.host_activations == dots.activations - full.activations > 0
    assert offload.host == offload.host_activations and offload.host_state == 0
    on_cpu = report("offload_dots", None)
    assert on_cpu.activations == report("dots", None).activations and on_cpu.host == 0


def test_estimate_needs_a_validated_config():
    with pytest.raises(ConfigError, match="validated"):
        estimate(load_config("tiny"))


# --------------------------------------------------------------------------------------------
# Hardware profiles


def test_profile_peaks_are_the_trainers_mfu_peaks():
    kinds = {"h100": "NVIDIA H100 80GB HBM3", "h200": "NVIDIA H200", "a100": "NVIDIA A100-SXM4",
             "tpu-v4": "TPU v4", "tpu-v5e": "TPU v5 lite", "tpu-v5p": "TPU v5p",
             "tpu-v6e": "TPU v6 lite"}
    assert set(kinds) | {"cpu"} == set(PROFILES)
    for name, device_kind in kinds.items():
        assert PROFILES[name].peak_flops == peak_flops(device_kind)
    assert PROFILES["cpu"].nominal and not PROFILES["h100"].nominal


def test_gpu_axes_inside_a_node_use_nvlink_and_the_rest_the_network():
    h100 = get_profile("h100")
    mesh = {"pipe": 1, "data": 2, "fsdp": 2, "expert": 1, "context": 1, "tensor": 4}  # 2 nodes
    assert h100.axis_link(mesh, "tensor") == ("NVLink", 450 * GB)
    assert h100.axis_link(mesh, "fsdp") == ("NVLink", 450 * GB)  # spans 2 x 4 = 8 GPUs
    assert h100.axis_link(mesh, "data") == ("network", 50 * GB)  # spans 16: crosses nodes
    assert get_profile("tpu-v5e").axis_link(mesh, "data") == ("ICI", 100 * GB)
    with pytest.raises(ConfigError, match="allowed values: h100"):
        get_profile("h1000")


# --------------------------------------------------------------------------------------------
# plan --search


def test_search_tries_every_layout_and_ranks_the_valid_ones_by_step_time():
    candidates = search(load_config("tiny"), DEVICES, "h100", keep=None)
    assert len(candidates) == len(list(layouts(load_config("tiny"), DEVICES)))
    assert not any(c.pruned for c in candidates)  # keep=None: every layout expanded
    ranked = [c for c in candidates if c.fits]
    assert [c.rank for c in ranked] == list(range(1, len(ranked) + 1))
    steps = [c.report.time.step for c in ranked]
    assert steps == sorted(steps)
    assert candidates[: len(ranked)] == ranked  # rejected ones come last
    tensor8 = [c for c in candidates if c.tensor == 8]
    assert tensor8 and all(not c.fits and "n_kv_heads=4 is not divisible by mesh.tensor=8"
                           in c.reason for c in tensor8)
    # Every ranked layout is one jaxpar accepts as it stands.
    for c in ranked:
        validate(load_config("tiny", c.overrides()), DEVICES)


def test_search_never_ranks_a_layout_that_replicates_the_gradients_when_they_do_not_fit():
    """llama-1b with one kv head (no tensor parallelism possible) on 8 x TPU v5e (16 GiB): a
    layout that does not split the parameters (FSDP) holds float32 parameters and gradients
    whole on every device, 8.8 GB before activations. ZeRO-1 does too: the TPU compiler
    reduce-scatters its gradients to the moments' layout after the layer loop, so they are
    whole at the end of the backward pass (compiled for tpu-v5e:2x4 at data=8 ZeRO-1 with the
    config's remat=dots: a peak of 15.6 GiB of the chip's 15.75, beyond the plan's margin).
    Unpipelined, only FSDP layouts rank first (the five fastest); without FSDP only ZeRO-1
    saving less than dots (remat=full: 13.5 GiB planned) fits, behind them."""
    cfg = load_config("llama-1b", ["model.n_kv_heads=1", "model.attention=dense"])
    candidates = search(cfg, DEVICES, "tpu-v5e", keep=None)
    # A pipeline splits the layers over its stages instead: only unpipelined layouts count.
    ranked = [c for c in candidates if c.fits and c.pipe == 1]
    assert ranked and all(c.fsdp > 1 and c.zero == 3 for c in ranked[:5])
    assert ranked[0].zero == 3
    for c in candidates:
        if c.fsdp == 1 and c.pipe == 1:
            if c.fits:
                # saving less than dots does (full, or what the lead's policies offload)
                assert c.zero == 1 and c.remat not in ("none", "dots"), c.layout
                continue
            assert ("HBM" in c.reason and c.reason.startswith("needs ")
                    or "not divisible by mesh.tensor" in c.reason), c.reason


def test_llama_1b_search_on_8_h100_prints_a_ranked_table():
    console = Console(record=True, width=200)
    assert plan_main(load_config("llama-1b"), "h100", True, DEVICES, console) == 0
    text = console.export_text()
    assert "layouts, fastest first" in text and "Fastest:" in text
    assert "1,104.2M params" in text
    candidates = search(load_config("llama-1b"), DEVICES, "h100")
    assert candidates[0].rank == 1 and candidates[0].report.time.mfu > 0
    Console(record=True).print(format_search(candidates))


def test_plan_for_one_layout_prints_memory_collectives_and_time():
    console = Console(record=True, width=200)
    assert plan_main(load_config("demo-5d"), "h100", False, None, console) == 0
    text = console.export_text()
    for part in ("memory per device", "collectives per device", "step", "MFU", "fits"):
        assert part in text
    with pytest.raises(ConfigError, match="--devices"):
        plan_main(load_config("llama-1b"), "h100", False, None, console)


def test_plan_says_when_a_layout_does_not_fit():
    console = Console(record=True, width=200)
    cfg = load_config("llama-1b", ["mesh.data=8", "mesh.fsdp=1"])
    assert plan_main(cfg, "tpu-v5e", False, DEVICES, console) == 0
    assert "does not fit" in console.export_text()
    report = estimate(validate(cfg, DEVICES), "tpu-v5e")
    assert report.memory.peak > PROFILES["tpu-v5e"].hbm_bytes
    assert math.isclose(report.memory.state, 4 * (1 + 2) * 1_104_218_112 + 12)


def test_windowed_layers_count_the_band_of_blocks_and_pairs_their_window_touches():
    from jaxpar.cost.shapes import windowed_share
    from jaxpar.model.flop_formula import causal_attention_flops_per_token
    from jaxpar.parallel.context import zigzag_order

    # 256 tokens in blocks of 32, window 64: 21 of 64 block pairs (the kernels' own count in
    # equivalence/test_sliding_window.py); an unlimited window is the causal n(n+1)/2 of n^2,
    # and under zigzag context parallelism (2c+1)/(4c).
    assert windowed_share(256, 1, 32, 64) == 21 / 64
    assert windowed_share(256, 1, 32, 10**9) == 36 / 64
    for c in (2, 4):
        assert windowed_share(256, c, 256 // c // 2, 10**9, zigzag_order(256, c)) == (
            (2 * c + 1) / (4 * c))
    cfg = load_config("tiny", []).model
    full = causal_attention_flops_per_token(cfg, 1024)
    local = causal_attention_flops_per_token(dataclasses.replace(cfg, sliding_window=128), 1024)
    # Per query 512 keys on average without the window, 512 - 896^2 / 2048 = 120 with it.
    assert local / full == pytest.approx(120 / 512)
