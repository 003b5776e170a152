"""The deepseek-v3 preset at its real sizes: the cost model's parameter counts (every expert,
and the active ones a token multiplies with) are DeepSeek-V3's, and equal the abstract model's."""

from __future__ import annotations

import math

from jaxpar.config import load_config
from jaxpar.cost.params import model_params
from jaxpar.model.flop_formula import causal_attention_flops_per_token, matmul_params, param_count


def test_deepseek_v3_preset_counts_671b_parameters_37b_active():
    m = load_config("deepseek-v3").model
    total = param_count(m)
    assert total == sum(math.prod(p.shape) for p in model_params(m))  # the model's own
    assert 670e9 < total < 672e9, total
    # active: 3 dense + 58 x (router, 8 routed, 1 shared) + attention + head; with the
    # embedding row DeepSeek's 37B
    active = matmul_params(m)
    assert 36e9 < active < 37e9 and 37e9 < active + m.vocab_size * m.d_model < 38e9, active
    assert m.resolved_head_dim == 192  # the kernels' width: values padded to q/k's 128 + 64


def test_mla_attention_flops_count_the_qk_and_value_widths():
    m = load_config("deepseek-v3").model
    assert causal_attention_flops_per_token(m, 4096) == 3.0 * 61 * 128 * (192 + 128) * 4096
