"""``jaxpar plan``'s bounds: the MFU bound never passes 100%, and the latency per collective keeps
layouts of tiny shards from ranking first on bandwidth alone (docs/plan.md)."""

from __future__ import annotations

import dataclasses

import pytest

from jaxpar.config import load_config, validate
from jaxpar.cost.estimate import estimate
from jaxpar.cost.plan import search
from jaxpar.hardware import get_profile
from jaxpar.model.flop_formula import (
    causal_attention_flops_per_token,
    matmul_params,
    train_flops_per_token,
)

DEFAULT_PROFILE = "h100"  # `jaxpar plan --hardware`'s default


@pytest.mark.parametrize("devices", [8, 64])
def test_no_layout_of_llama_1b_has_an_mfu_bound_above_100_percent(devices):
    candidates = [c for c in search(load_config("llama-1b"), devices, DEFAULT_PROFILE)
                  if c.report is not None]
    assert len(candidates) > 20
    for c in candidates:
        flops, time = c.report.flops, c.report.time
        assert flops.attention_extra > 0, c.layout  # every kernel computes beyond the half
        assert flops.executed > flops.model, c.layout
        assert 0 < time.mfu <= 1.0, (c.layout, time.mfu)


def test_useful_attention_is_the_causal_half_of_the_square():
    m = load_config("llama-1b").model
    # 16 layers x 32 heads x 64 dims x 2,048 tokens: the whole square costs 4 x that forward
    # and 8 x backward; half of the 12 x is useful.
    assert causal_attention_flops_per_token(m, 2048) == 6 * 16 * 32 * 64 * 2048
    assert train_flops_per_token(m, 2048) == 6 * matmul_params(m) + 6 * 16 * 32 * 64 * 2048


def test_doubling_the_latency_adds_one_latency_per_collective():
    """context=8 on one node: ring attention's K/V hops are hundreds of small collectives."""
    cfg = validate(load_config("llama-1b", ["mesh.fsdp=1", "mesh.context=8"]), 8)
    h100 = get_profile(DEFAULT_PROFILE)
    doubled = dataclasses.replace(h100, fast_latency_s=2 * h100.fast_latency_s)
    base, slow = estimate(cfg, h100), estimate(cfg, doubled)
    launches = sum(c.count for c in base.collectives)
    assert launches > 500  # 16 layers x (14 forward + 14 backward + 16 dK/dV hops) and more
    assert slow.time.step - base.time.step == pytest.approx(launches * h100.fast_latency_s)
    assert base.time.latency == pytest.approx(launches * h100.fast_latency_s)
    assert slow.time.compute == base.time.compute


def test_context_8_at_2k_tokens_is_not_ranked_first_for_llama_1b():
    """Without latency, context=8's ring hops hide behind compute and it ranks first (29.5 ms);
    with NVLink's 10 us per collective its ~700 hops cost 7 ms and data=8 (a handful of
    gradient all-reduces) is fastest: 30.0 ms against 36.7 ms."""
    h100 = get_profile(DEFAULT_PROFILE)
    no_latency = dataclasses.replace(h100, fast_latency_s=0.0, slow_latency_s=0.0)
    assert search(load_config("llama-1b"), 8, no_latency)[0].layout == "context=8 ring zero=3"
    ranked = [c for c in search(load_config("llama-1b"), 8, h100) if c.fits]
    assert ranked[0].layout == "data=8 zero=3"
    context8 = next(c for c in ranked if c.layout == "context=8 ring zero=3")
    assert context8.rank > 5
