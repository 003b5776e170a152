"""Text generation end to end: greedy decoding against Hugging Face transformers' Llama, and
``jaxpar generate`` on a run trained by the command line (subprocesses sharing one compilation
cache). The library against the uncached model: ``tests/equivalence/test_generate.py``."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from helpers import GENERATION_MODEL as DENSE
from helpers import GENERATION_PROMPTS as PROMPTS
from helpers import assert_one_line_error, cached_jax_env, run_jaxpar

from jaxpar.config import Config, MeshConfig, config_from_dict
from jaxpar.data.tokenizer import ByteTokenizer
from jaxpar.inference.generation import Generator

# --------------------------------------------------------------------------------------------
# Against Hugging Face transformers


def test_greedy_equals_transformers_llama():
    """A tiny LlamaForCausalLM with its weights copied in: jaxpar's rotary embedding rotates
    (first half, second half) pairs with inv_freq = theta^(-2i/D), as HF Llama's rotate_half
    does, so the mapping is transposes and reshapes only."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    c = DENSE
    hf_cfg = transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.d_model, intermediate_size=c.d_ff,
        num_hidden_layers=c.n_layers, num_attention_heads=c.n_heads,
        num_key_value_heads=c.n_kv_heads, rms_norm_eps=c.norm_eps, rope_theta=c.rope_theta,
        initializer_range=0.5, tie_word_embeddings=False, attention_bias=False)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    sd = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    e, h, k, d = c.d_model, c.n_heads, c.n_kv_heads, c.resolved_head_dim

    def stacked(name, fn):
        return np.stack([fn(sd[f"model.layers.{i}.{name}"]) for i in range(c.n_layers)])

    params = {
        "embedding": sd["model.embed_tokens.weight"], "lm_head": sd["lm_head.weight"].T,
        "final_norm": {"scale": sd["model.norm.weight"]},
        "layers": {
            "attn_norm": {"scale": stacked("input_layernorm.weight", lambda w: w)},
            "mlp_norm": {"scale": stacked("post_attention_layernorm.weight", lambda w: w)},
            "attn": {"wq": stacked("self_attn.q_proj.weight", lambda w: w.T.reshape(e, h, d)),
                     "wk": stacked("self_attn.k_proj.weight", lambda w: w.T.reshape(e, k, d)),
                     "wv": stacked("self_attn.v_proj.weight", lambda w: w.T.reshape(e, k, d)),
                     "wo": stacked("self_attn.o_proj.weight", lambda w: w.T.reshape(h, d, e))},
            "mlp": {"w_gate": stacked("mlp.gate_proj.weight", lambda w: w.T),
                    "w_up": stacked("mlp.up_proj.weight", lambda w: w.T),
                    "w_down": stacked("mlp.down_proj.weight", lambda w: w.T)}}}
    ours = Generator(Config(model=c), params).generate(PROMPTS, max_tokens=24)
    for prompt, got in zip(PROMPTS, ours, strict=True):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            for _ in range(24):
                ids = torch.cat([ids, hf(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        assert got == ids[0, len(prompt):].tolist()


# --------------------------------------------------------------------------------------------
# The command line


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny model trained 3 steps by the CLI, and the environment its commands share."""
    env = cached_jax_env(tmp_path_factory.mktemp("jax-cache"))
    run_dir = tmp_path_factory.mktemp("run")
    result = run_jaxpar("train", "tiny", "train.steps=3", f"run_dir={run_dir}",
                        "logging.progress=false", env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir, env


def test_generate_cli_streams_what_the_library_generates(trained, tmp_path):
    from jaxpar.checkpoint.weights_only import read_weights, saved_config, step_dir

    run_dir, env = trained
    path = step_dir(run_dir)
    cfg = dataclasses.replace(config_from_dict(saved_config(path)), mesh=MeshConfig(data=1))
    generator = Generator(cfg, *read_weights(path)[:2])
    tok = ByteTokenizer()
    texts = ["def main(", "import os", "class A"]
    new = generator.generate([[0, *tok.encode(t).tolist()] for t in texts], max_tokens=12,
                             eos_id=0)
    result = run_jaxpar("generate", str(run_dir), "--prompt", texts[0], "--max-tokens", "12",
                        env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout == texts[0] + tok.decode(new[0]) + "\n"
    assert "tokens for 1 prompt(s)" in result.stderr
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(texts) + "\n")
    result = run_jaxpar("generate", str(path), "--prompts-file", str(prompts), "--max-tokens",
                        "12", "--mesh", "data=2,tensor=2", "host_devices=4", env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    expected = "".join(f"--- {i + 1}/3 ---\n{t}{tok.decode(n)}\n"
                       for i, (t, n) in enumerate(zip(texts, new, strict=True)))
    assert result.stdout == expected
    assert_one_line_error(run_jaxpar("generate", str(path), "--prompt", "x", "--mesh",
                                     "pipe=2", "host_devices=2", env=env), "pipe=2")
    assert_one_line_error(run_jaxpar("generate", str(path), "--prompt", "x", "model.d_ff=64",
                                     env=env), "params/layers/mlp/w_down", "model.*")


def test_weights_that_fail_their_checksum_are_refused(trained, tmp_path):
    import json
    import shutil

    from jaxpar.checkpoint.state import DamagedCheckpointError
    from jaxpar.checkpoint.weights_only import read_weights, step_dir

    path = shutil.copytree(step_dir(trained[0]), tmp_path / "3")
    params, _, step = read_weights(path)  # intact: verified, read
    assert step == 3 and params["embedding"].shape == (256, 64)
    record = path / "checksums" / "metadata"
    saved = json.loads(record.read_text())
    saved["arrays"]["params/layers/mlp/w_up"] ^= 1
    record.write_text(json.dumps(saved))
    with pytest.raises(DamagedCheckpointError, match="params/layers/mlp/w_up"):
        read_weights(path)
