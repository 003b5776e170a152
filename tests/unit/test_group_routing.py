"""DeepSeek-V3's router (group-limited top-k over sigmoid scores plus the correction bias,
renormalised and scaled gates) against transformers' own DeepseekV3TopkRouter, and the first
dense blocks as a stack of their own."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.config import ModelConfig, MoEConfig
from jaxpar.model.moe import limit_groups, route
from jaxpar.model.transformer import abstract_model, dense_units, layer_units

torch = pytest.importorskip("torch")
tr = pytest.importorskip("transformers")


@pytest.mark.parametrize(("n_group", "topk_group", "norm"), [(4, 2, True), (2, 1, False),
                                                             (1, 1, True)])
def test_route_is_transformers_deepseek_v3_router(n_group, topk_group, norm):
    x, e, k = 16, 32, 3
    cfg = tr.DeepseekV3Config(hidden_size=e, n_routed_experts=x, num_experts_per_tok=k,
                              n_group=n_group, topk_group=topk_group, norm_topk_prob=norm,
                              routed_scaling_factor=2.5)
    router = tr.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter(cfg)
    torch.manual_seed(0)
    with torch.no_grad():
        router.weight.normal_(0, 1)
        router.e_score_correction_bias.normal_(0, 0.3)
    hidden = torch.randn(64, e)
    logits, want_gates, want_ids = (t.detach().numpy() for t in router(hidden))
    moe = MoEConfig(num_experts=x, top_k=k, router="sigmoid_bias", n_group=n_group,
                    topk_group=topk_group, norm_topk=norm, routed_scaling_factor=2.5)
    ids, gates, _ = route(jnp.asarray(logits), moe,
                          jnp.asarray(router.e_score_correction_bias.numpy()))
    # transformers' top-k is unsorted: compare each token's (expert, gate) pairs as sets
    order_want, order_got = np.argsort(want_ids, -1), np.argsort(np.asarray(ids), -1)
    np.testing.assert_array_equal(np.take_along_axis(want_ids, order_want, -1),
                                  np.take_along_axis(np.asarray(ids), order_got, -1))
    np.testing.assert_allclose(np.take_along_axis(np.asarray(gates), order_got, -1),
                               np.take_along_axis(want_gates, order_want, -1), rtol=1e-6)


def test_limit_groups_keeps_the_groups_of_the_best_two():
    # groups of 2: sums of their two 1.0, 0.3+0.3=0.6, 0.9+0.0=0.9 -> keep groups 1 and 2
    choice = jnp.asarray([[0.5, 0.5, 0.3, 0.3, 0.9, 0.0]])
    kept = limit_groups(choice, 3, 2)
    assert np.isinf(np.asarray(kept)[0, 2:4]).all()
    np.testing.assert_allclose(np.asarray(kept)[0, [0, 1, 4, 5]], [0.5, 0.5, 0.9, 0.0])


def test_first_dense_blocks_are_a_stack_of_their_own():
    m = ModelConfig(n_layers=3, moe=MoEConfig(num_experts=4, top_k=2, first_dense=1))
    model = abstract_model(m)
    assert (dense_units(m), layer_units(m), m.n_moe_layers) == (1, 2, 2)
    assert model.dense_layers.mlp.w_gate.shape == (1, 64, 128)
    assert model.layers.moe.w_gate.shape == (2, 4, 64, 128)


MOE = ["model.n_layers=4", "model.moe.num_experts=8", "model.moe.top_k=2"]


@pytest.mark.parametrize(("overrides", "needle"), [
    (["model.moe.n_group=3"], "model.moe.n_group=3: must be >= 1 and divide"),
    (["model.moe.n_group=2", "model.moe.topk_group=3"], "model.moe.topk_group=3"),
    (["model.moe.n_group=8"], "needs >= 2 (has 1)"),
    (["model.moe.n_group=4", "model.moe.top_k=3"], "model.moe.top_k=3: more than the 2"),
    (["model.moe.routed_scaling_factor=0"], "model.moe.routed_scaling_factor=0"),
    (["model.moe.first_dense=4"], "model.moe.first_dense=4: must be in [0, model.n_layers=4)"),
    (["model.moe.first_dense=1", "model.moe.every=2"], "less model.moe.first_dense=1"),
    (["model.moe.first_dense=1", "mesh.pipe=2", "mesh.data=4", "train.microbatches=2"],
     "model.n_layers=4 (less model.moe.first_dense=1) is not divisible by mesh.pipe"),
    (["model.moe.first_dense=2", "mesh.pipe=2", "mesh.data=4", "train.microbatches=2",
      "model.sliding_window=8"], "model.moe.first_dense=2 with mesh.pipe=2 and "
     "model.sliding_window=8: not supported yet"),
    (["model.rope_scaling.type=yarn"], "model.rope_scaling.type=yarn: only with multi-head"),
])
def test_deepseek_moe_config_errors_are_one_line(overrides, needle):
    from jaxpar.config import ConfigError, load_config, validate

    with pytest.raises(ConfigError) as info:
        validate(load_config("tiny", [*MOE, *overrides]), 8)
    assert needle in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_dense_first_blocks_validate_with_pipeline_stages_of_the_mixture_layers():
    # The dense blocks run before the stages: only the mixture layers must split into chunks.
    from jaxpar.config import load_config, validate

    validate(load_config("tiny", [*MOE, "model.moe.first_dense=2", "mesh.pipe=2", "mesh.data=4",
                                  "train.microbatches=2"]), 8)
