"""LoRA (``train.lora``) on a latent-attention model (``model.mla``, docs/lora.md): adapters on
the latent projections (``q_a``, ``q_b``, ``kv_a``, ``kv_b``), ``o`` and the MLP.

The tiny preset with test_mla_layouts.py's latent attention (8 heads over a 16-wide latent,
queries through a 24-wide one), ``helpers.LAYOUT_BASE`` (3 steps), float32. Against one device:
the loss (relative 1e-5), the adapters' gradients and their values after the steps (1e-4), the
base weights unchanged; and the merged weights compute what the adapted model computes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_grads_and_params_match, max_relative_error, run_layout

from jaxpar.model.lora import adapter_part, base_part

MLA = ("model.mla.q_lora_rank=24", "model.mla.kv_lora_rank=16", "model.mla.qk_nope_head_dim=8",
       "model.mla.qk_rope_head_dim=8", "model.mla.v_head_dim=12", "model.mla.rope_interleave=true")
LORA = ("train.lora.rank=4", "train.lora.alpha=8",
        "train.lora.targets=[q_a,q_b,kv_a,kv_b,o,gate,up,down]")


def test_lora_on_mla_over_data_fsdp_tensor_matches_one_device() -> None:
    ref = run_layout((*MLA, *LORA, "mesh.data=1"))
    got = run_layout((*MLA, *LORA, "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"))
    assert abs(got["loss"] - ref["loss"]) <= 1e-5 * abs(ref["loss"])
    assert set(got["grads"]["layers"]["attn"]) == {"lora_q_a", "lora_q_b", "lora_kv_a",
                                                   "lora_kv_b", "lora_o"}
    assert not base_part(got["grads"])
    assert_grads_and_params_match(got, ref)
    init = jax.tree.map(np.asarray, ref["trainer"].init().params)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(base_part(got["params"])),
                                                    jax.tree.leaves(base_part(init)),
                                                    strict=True))
    moved = max_relative_error(adapter_part(ref["params"]), adapter_part(init))
    assert min(moved.values()) > 1e-4, moved


@pytest.mark.slow
def test_lora_on_mla_in_a_1f1b_pipeline_over_tensor_matches_one_device() -> None:
    """The latent projections' adapters split over ``pipe`` with their layers, ``q_b``'s and
    ``kv_b``'s over ``tensor`` by heads."""
    ref = run_layout((*MLA, *LORA, "mesh.data=1"))
    got = run_layout((*MLA, *LORA, "mesh.pipe=2", "mesh.tensor=2", "mesh.data=1",
                      "train.microbatches=2", "parallel.pipeline_schedule=1f1b"))
    assert abs(got["loss"] - ref["loss"]) <= 1e-5 * abs(ref["loss"])
    assert not base_part(got["grads"])
    assert_grads_and_params_match(got, ref)


def test_merged_mla_adapters_compute_the_adapted_model() -> None:
    """``merged_weights`` (the HF export's and the Generator's model) folds every latent
    projection's adapter into its weight: the plain MLA model with the merged weights gives the
    adapted model's logits (adapters' B made non-zero, so each adapter changes them)."""
    from flax import nnx

    from jaxpar.config import load_config, validate
    from jaxpar.model.lora import merged_weights
    from jaxpar.model.transformer import create_model

    cfg = validate(load_config("tiny", [*MLA, *LORA, "mesh.data=1"]), 1)
    lora = cfg.train.lora
    adapted = create_model(cfg.model, 0, lora)
    graph, params, rest = nnx.split(adapted, nnx.Param, ...)
    params = nnx.to_pure_dict(params)
    keys = iter(jax.random.split(jax.random.key(7), 64))
    params = jax.tree_util.tree_map_with_path(
        lambda path, a: jax.random.normal(next(keys), a.shape) * 0.05
        if path[-1].key == "b" else a, params)
    tokens = jax.random.randint(jax.random.key(3), (2, 16), 0, cfg.model.vocab_size)
    positions = jnp.broadcast_to(jnp.arange(16), (2, 16))
    want, _ = nnx.merge(graph, params, rest)(tokens, positions)
    plain = create_model(cfg.model, 0)
    plain_graph, plain_params, plain_rest = nnx.split(plain, nnx.Param, ...)
    merged = merged_weights(jax.tree.map(np.asarray, params), lora)
    assert jax.tree.structure(merged) == jax.tree.structure(nnx.to_pure_dict(plain_params))
    got, _ = nnx.merge(plain_graph, merged, plain_rest)(tokens, positions)
    base, _ = nnx.merge(plain_graph, base_part(params), plain_rest)(tokens, positions)
    assert float(jnp.max(jnp.abs(want - base))) > 1e-2
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
