"""DeepSeek-V3 from Hugging Face: a tiny random ``deepseek_v3`` (multi-head latent attention,
a dense first block, group-limited sigmoid routing with the correction bias, shared experts)
imported against transformers' logits on one device and under tensor and expert parallelism;
block-scaled float8 weights dequantized on import; the export read back by transformers."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hf_models import build_hf_model, hf_logits, jaxpar_logits, tokens, trainer_from_import

from jaxpar.checkpoint.weights_only import read_weights, step_dir
from jaxpar.hf.exporter import export_hf
from jaxpar.hf.importer import import_hf, import_hf_main

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

TOLERANCE = 1e-4
BLOCK = [16, 16]  # scale blocks of the float8 test (DeepSeek's are 128 x 128)


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek")
    build_hf_model("deepseek_v3").save_pretrained(root / "hf")
    ids = tokens(rows=4)
    return root, import_hf(root / "hf", root / "jaxpar"), hf_logits(root / "hf", ids)


@pytest.mark.parametrize(("overrides", "devices"), [
    ([], 1),
    (["mesh.tensor=2", "mesh.expert=2"], 4),
], ids=["one-device", "tensor2-expert2"])
def test_imported_deepseek_logits_match_transformers(deepseek, overrides, devices):
    _, done, expected = deepseek
    trainer, state = trainer_from_import(done.config_yaml, overrides, devices)
    got = jaxpar_logits(trainer, state, tokens(rows=4))
    assert np.abs(expected).max() > 1.0
    diff = np.abs(got - expected).max()
    assert diff <= TOLERANCE, (overrides, diff)


def test_import_maps_the_deepseek_config(deepseek):
    m = deepseek[1].model
    assert (m.mla.q_lora_rank, m.mla.kv_lora_rank, m.mla.v_head_dim, m.mla.rope_interleave) == (
        24, 16, 12, True)
    assert (m.moe.router, m.moe.n_group, m.moe.topk_group, m.moe.first_dense,
            m.moe.routed_scaling_factor, m.moe.num_shared_experts) == (
        "sigmoid_bias", 2, 1, 1, 2.5, 1)


def test_exported_deepseek_reads_back_into_transformers(deepseek):
    root, done, expected = deepseek
    export_hf(done.checkpoint, root / "exported")
    config = json.loads((root / "exported" / "config.json").read_text())
    assert config["model_type"] == "deepseek_v3" and config["first_k_dense_replace"] == 1
    diff = np.abs(hf_logits(root / "exported", tokens(rows=4)) - expected).max()
    assert diff <= TOLERANCE, diff


def _quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] -> (float8 e4m3 weight, float32 scale_inv per BLOCK), as DeepSeek stores."""
    rows, cols = (-(-n // b) for n, b in zip(w.shape, BLOCK, strict=True))
    scale = torch.empty(rows, cols)
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    for i in range(rows):
        for j in range(cols):
            part = w[i * BLOCK[0]:(i + 1) * BLOCK[0], j * BLOCK[1]:(j + 1) * BLOCK[1]]
            scale[i, j] = part.abs().max() / 448.0
            q[i * BLOCK[0]:(i + 1) * BLOCK[0], j * BLOCK[1]:(j + 1) * BLOCK[1]] = (
                part / scale[i, j]).to(torch.float8_e4m3fn)
    return q, scale


def test_float8_block_scaled_weights_import_dequantized(tmp_path, capsys):
    """Linear weights as float8 with their scale_inv blocks (partial blocks at the edges: the
    tiny sizes are not multiples of 16), a multi-token-prediction layer left out with a notice:
    each imported weight is its dequantized value."""
    from safetensors.torch import save_file

    model = build_hf_model("deepseek_v3")
    model.save_pretrained(tmp_path / "plain")
    config = json.loads((tmp_path / "plain" / "config.json").read_text())
    config.update(quantization_config={"quant_method": "fp8", "fmt": "e4m3",
                                       "activation_scheme": "dynamic",
                                       "weight_block_size": BLOCK},
                  num_nextn_predict_layers=1)
    (tmp_path / "fp8").mkdir()
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(config))
    from safetensors.torch import load_file
    tensors, dequantized = {}, {}
    for name, value in load_file(str(tmp_path / "plain" / "model.safetensors")).items():
        quantize = (value.ndim == 2 and "proj" in name)
        if quantize:
            q, scale = _quantize(value)
            tensors[name], tensors[name + "_scale_inv"] = q, scale
            dequantized[name] = (q.float() * scale.repeat_interleave(BLOCK[0], 0)
                                 .repeat_interleave(BLOCK[1], 1)[:q.shape[0], :q.shape[1]])
        else:
            tensors[name] = value
    tensors["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)  # MTP: left out
    save_file(tensors, str(tmp_path / "fp8" / "model.safetensors"), metadata={"format": "pt"})
    import_hf_main(tmp_path / "fp8", tmp_path / "jaxpar")
    assert "left out: 1 multi-token-prediction layer" in capsys.readouterr().out
    params, buffers, _ = read_weights(step_dir(tmp_path / "jaxpar"))
    # layer 1 is the first mixture (layers[0]); layer 0 the dense block
    checks = {
        "model.layers.0.self_attn.q_b_proj.weight":
            params["dense_layers"]["attn"]["wq_b"][0].reshape(24, -1).T,
        "model.layers.1.self_attn.kv_a_proj_with_mqa.weight":
            params["layers"]["attn"]["wkv_a"][0].T,
        "model.layers.2.mlp.experts.5.down_proj.weight": params["layers"]["moe"]["w_down"][1, 5].T,
        "model.layers.0.mlp.gate_proj.weight": params["dense_layers"]["mlp"]["w_gate"][0].T,
    }
    assert len(dequantized) > 20
    for name, got in checks.items():
        np.testing.assert_array_equal(got, dequantized[name].numpy(), err_msg=name)
    want_bias = tensors["model.layers.2.mlp.gate.e_score_correction_bias"].numpy()
    np.testing.assert_array_equal(buffers["layers"]["moe"]["router_bias"][1], want_bias)


@pytest.mark.parametrize("axes", [None, {"data": 2, "tensor": 2}], ids=["one-device",
                                                                      "data2-tensor2"])
def test_deepseek_generation_with_a_latent_cache_is_transformers_greedy(deepseek, axes):
    """The cache holds each layer's latent and rope key (not expanded keys and values), the
    decode steps attend over them in the absorbed form: transformers' greedy tokens."""
    import jax
    from transformers import AutoModelForCausalLM

    from jaxpar.config import Config, MeshConfig
    from jaxpar.inference.generation import Generator
    from jaxpar.mesh import make_mesh
    from jaxpar.model.kv_cache import model_cache

    root, done, _ = deepseek
    prompts = tokens(rows=2)[:, :20]
    hf = AutoModelForCausalLM.from_pretrained(root / "hf", dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf.generate(torch.tensor(prompts, dtype=torch.long), max_new_tokens=12,
                          do_sample=False, eos_token_id=None, pad_token_id=0)
    expected = out[:, prompts.shape[1]:].tolist()
    params, buffers, _ = read_weights(done.checkpoint)
    cfg = Config(model=done.model, mesh=MeshConfig(**{"data": 1, **(axes or {})}))
    mesh = None if axes is None else make_mesh(cfg, jax.devices()[:4])
    generator = Generator(cfg, params, buffers, mesh)
    assert generator.generate(prompts.tolist(), max_tokens=12) == expected
    # layers x rows x slots x (latent 16 | rope key 8): no heads
    cache = model_cache(done.model, 2, 32)
    assert (cache.k.shape, cache.v.shape) == ((3, 2, 32, 1, 16), (3, 2, 32, 1, 8))


def test_deepseek_with_yarn_rope_matches_transformers(tmp_path):
    """DeepSeek-V3's long-context RoPE: yarn frequencies (factor 4 over an original context of
    64, so that the 512 tokens reach the interpolated dims), the rotary dims' factor from
    mscale / mscale_all_dim, and the softmax scale times mscale(factor, mscale_all_dim)^2."""
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
            "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
            "mscale": 0.8, "mscale_all_dim": 0.7}
    build_hf_model("deepseek_v3", rope_parameters=yarn).save_pretrained(tmp_path / "hf")
    done = import_hf(tmp_path / "hf", tmp_path / "jaxpar")
    assert (done.model.rope_scaling.type, done.model.rope_scaling.mscale_all_dim) == ("yarn", 0.7)
    ids = tokens(rows=2)
    expected = hf_logits(tmp_path / "hf", ids)
    trainer, state = trainer_from_import(done.config_yaml, [], 1)
    diff = np.abs(jaxpar_logits(trainer, state, ids) - expected).max()
    assert diff <= TOLERANCE, diff
