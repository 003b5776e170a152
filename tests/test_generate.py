"""Text generation (jaxpar/generate.py, jaxpar/model/kv_cache.py, ``jaxpar generate``).

The reference is the model itself, uncached: the whole sequence through the training forward
pass for every new token, argmax at the last position. Models are initialised with a large
scale (``init_std=0.5``) so that the argmax margins are far above float32 round-off and
token-for-token equality is the right test.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.monitoring
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import assert_one_line_error, cached_jax_env, run_jaxpar

from jaxpar.cli.main import main
from jaxpar.config import Config, MeshConfig, ModelConfig, MoEConfig, config_from_dict
from jaxpar.data.tokenizer import ByteTokenizer
from jaxpar.generate import Generator, Sampling, generate, sample
from jaxpar.mesh import make_mesh
from jaxpar.model.kv_cache import cache_bytes_per_token
from jaxpar.model.transformer import create_model

DENSE = ModelConfig(d_model=64, n_layers=2, n_heads=8, n_kv_heads=4, d_ff=128, vocab_size=256,
                    init_std=0.5)
# Groups of (dense, MoE) blocks: two attention layers per scanned unit; sigmoid router (buffers).
MOE = dataclasses.replace(DENSE, n_layers=4, moe=MoEConfig(
    num_experts=4, top_k=2, every=2, d_ff_expert=64, router="sigmoid_bias"))
# The 19-token prompt pads to 32 = 2 blocks of 16: the prefill runs blockwise attention.
BLOCKWISE = dataclasses.replace(DENSE, attention_block=16)
MODELS = {"dense": DENSE, "moe": MOE, "blockwise": BLOCKWISE}
# Lengths 4, 19 (past the 16-token bucket) and 2; with a mesh of data=2 they pad to 4 rows.
PROMPTS = [[0, 5, 17, 99], [0, 200, *[3] * 16, 42], [0, 7]]
NEW = 32


@functools.cache
def model(name: str, init_std: float | None = None):
    cfg = MODELS[name] if init_std is None else dataclasses.replace(MODELS[name],
                                                                    init_std=init_std)
    return create_model(cfg, seed=0)


@functools.cache
def uncached_greedy(name: str, prompt: tuple[int, ...], new: int = NEW) -> list[int]:
    """Greedy tokens by full forward passes (one compile: the sequence is padded to its final
    length; causal attention keeps the padding out of the logits read)."""
    m = model(name)
    graphdef, state = nnx.split(m)
    total = len(prompt) + new

    @jax.jit
    def next_token(state, tokens, last):
        logits, _ = nnx.merge(graphdef, state)(tokens[None], jnp.arange(total)[None])
        return jnp.argmax(logits[0, last])

    tokens = np.zeros(total, np.int32)
    tokens[:len(prompt)] = prompt
    for i in range(len(prompt), total):
        tokens[i] = int(next_token(state, tokens, i - 1))
    return tokens[len(prompt):].tolist()


def weights(m):
    _, params, buffers = nnx.split(m, nnx.Param, ...)
    return nnx.to_pure_dict(params), nnx.to_pure_dict(buffers)


def mesh_generator(name: str, **axes: int) -> Generator:
    cfg = Config(model=MODELS[name], mesh=MeshConfig(**{"data": 1, **axes}))
    devices = int(np.prod(list(axes.values())))
    return Generator(cfg, *weights(model(name)), make_mesh(cfg, jax.devices()[:devices]))


# --------------------------------------------------------------------------------------------
# Cached decoding = the uncached model


@pytest.mark.parametrize("name", list(MODELS))
def test_cached_greedy_equals_uncached_forward_and_batching_changes_nothing(name):
    refs = [uncached_greedy(name, tuple(p)) for p in PROMPTS]
    assert all(len(set(r)) > 8 for r in refs), refs  # not a degenerate, repeating output
    one = Generator(Config(model=MODELS[name]), *weights(model(name)))  # compiles per shape once
    assert [one.generate([p], max_tokens=NEW)[0] for p in PROMPTS] == refs
    assert generate(model(name), PROMPTS, max_tokens=NEW) == refs


@pytest.mark.parametrize("name, axes", [("dense", {"data": 2, "tensor": 2}),
                                        ("moe", {"data": 2, "tensor": 2}),
                                        ("dense", {"fsdp": 2, "tensor": 2})])
def test_cached_greedy_on_a_mesh_equals_one_device(name, axes):
    generator = mesh_generator(name, **axes)
    wq = generator.params["layers"]["attn" if name == "dense" else "block_0"]
    wq = wq["wq"] if name == "dense" else wq["attn"]["wq"]
    assert "tensor" in str(wq.sharding.spec)  # heads really split
    refs = [uncached_greedy(name, tuple(p)) for p in PROMPTS]
    assert generator.generate(PROMPTS, max_tokens=NEW) == refs


def test_a_kv_cache_position_costs_the_bytes_the_docstring_says():
    # 2 (k, v) x 2 layers x 4 kv heads x 8 head_dim x 4 bytes
    assert cache_bytes_per_token(2, 4, 8) == 512
    assert cache_bytes_per_token(16, 8, 64, jnp.bfloat16) == 32 * 1024


# --------------------------------------------------------------------------------------------
# Sampling


def test_sampling_repeats_with_a_seed_and_top_k_1_is_greedy():
    m = model("dense", init_std=0.02)  # small init: flat distributions, so draws differ
    generator = Generator(Config(model=m.cfg), *weights(m))
    hot = Sampling(temperature=1.0)
    first = generator.generate(PROMPTS, max_tokens=16, sampling=hot, seed=1)
    assert generator.generate(PROMPTS, max_tokens=16, sampling=hot, seed=1) == first
    assert generator.generate(PROMPTS, max_tokens=16, sampling=hot, seed=2) != first
    greedy = generator.generate(PROMPTS, max_tokens=16)
    assert greedy != first
    for cut in (Sampling(temperature=1.0, top_k=1), Sampling(temperature=1.0, top_p=1e-6)):
        assert generator.generate(PROMPTS, max_tokens=16, sampling=cut, seed=3) == greedy


def test_sampling_draws_the_same_tokens_on_a_mesh():
    m = model("dense", init_std=0.02)
    cfg = Config(model=m.cfg, mesh=MeshConfig(data=2, tensor=2))
    on_mesh = Generator(cfg, *weights(m), make_mesh(cfg, jax.devices()[:4]))
    alone = Generator(Config(model=m.cfg), *weights(m))
    nucleus = Sampling(temperature=1.0, top_p=0.9)
    got = on_mesh.generate(PROMPTS, max_tokens=16, sampling=nucleus, seed=5)
    assert got == alone.generate(PROMPTS, max_tokens=16, sampling=nucleus, seed=5)


def test_sample_draws_only_from_the_top_k_and_the_nucleus_at_their_frequencies():
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    logits = jnp.broadcast_to(jnp.log(jnp.asarray(probs, jnp.float32)), (4000, 4))
    key = jax.random.key(0)

    def drawn(sampling):
        return np.bincount(np.asarray(sample(logits, key, jnp.int32(0), sampling)),
                           minlength=4) / 4000

    np.testing.assert_allclose(drawn(Sampling(temperature=1.0)), probs, atol=0.03)
    np.testing.assert_allclose(drawn(Sampling(temperature=1.0, top_k=3)), [*probs[:3] / 0.95, 0],
                               atol=0.03)
    # before-mass 0, 0.5, 0.8: top_p=0.7 keeps tokens 0 and 1
    np.testing.assert_allclose(drawn(Sampling(temperature=1.0, top_p=0.7)),
                               [0.625, 0.375, 0, 0], atol=0.03)
    sharp = drawn(Sampling(temperature=0.25))  # p^4, renormalised
    np.testing.assert_allclose(sharp, probs**4 / np.sum(probs**4), atol=0.03)


def test_sampling_options_are_checked():
    for bad in ({"temperature": -1.0}, {"top_k": -2}, {"top_p": 0.0}, {"top_p": 1.5}):
        with pytest.raises(ValueError):
            Sampling(**bad)


# --------------------------------------------------------------------------------------------
# End of text, compiles


def test_eos_stops_each_sequence_on_its_own():
    refs = [uncached_greedy("dense", tuple(p)) for p in PROMPTS]
    k = next(i for i in range(3, NEW) if refs[0][i] not in refs[0][:i])
    eos = refs[0][k]
    expected = [r[:r.index(eos)] if eos in r else r for r in refs]
    assert len(expected[0]) == k and any(len(e) == NEW for e in expected[1:]), expected
    assert generate(model("dense"), PROMPTS, max_tokens=NEW, eos_id=eos) == expected
    # Alone, the loop ends at the end-of-text token (yielded, then no more steps).
    generator = Generator(Config(model=DENSE), *weights(model("dense")))
    steps = list(generator.stream([PROMPTS[0]], max_tokens=NEW, eos_id=eos))
    assert len(steps) == k + 1 and int(steps[-1].tokens[0]) == eos


_compiles: list[str] = []
jax.monitoring.register_event_duration_secs_listener(
    lambda event, _, **kw: _compiles.append(kw.get("fun_name", ""))
    if event == "/jax/core/compile/backend_compile_duration" else None)


def test_the_decode_step_compiles_once():
    generator = Generator(Config(model=DENSE), *weights(model("dense")))
    _compiles.clear()
    generator.generate(PROMPTS[:2], max_tokens=20)
    assert _compiles.count("jit(_decode_fn)") == 1, _compiles
    assert _compiles.count("jit(_prefill_fn)") == 1, _compiles
    # Other prompts, the longest in the same bucket (17..32 tokens): nothing compiles again.
    generator.generate([[0, 1, 2, 3, 4], [0, 9] * 10], max_tokens=20)
    assert _compiles.count("jit(_decode_fn)") == 1, _compiles
    assert _compiles.count("jit(_prefill_fn)") == 1, _compiles


def test_weights_of_another_model_are_one_line():
    params, buffers = weights(model("dense"))
    wrong = Config(model=dataclasses.replace(DENSE, d_ff=64))
    with pytest.raises(ValueError, match="params/layers/mlp/w_down is .* but the model"):
        Generator(wrong, params, buffers)


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


def test_generate_help_and_one_line_errors(capsys, tmp_path):
    with pytest.raises(SystemExit) as done:
        main(["generate", "--help"])
    assert done.value.code == 0 and "--prompts-file" in capsys.readouterr().out
    assert main(["generate", str(tmp_path / "nowhere"), "--prompt", "x"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("jaxpar: error: ") and "nowhere" in err[0]
    for bad in (["--prompt", "x", "--max-tokens", "0"], ["--prompt", "x", "--bogus"], []):
        with pytest.raises(SystemExit) as done:
            main(["generate", str(tmp_path), *bad])
        err = capsys.readouterr().err.splitlines()
        assert done.value.code == 2 and len(err) == 1 and err[0].startswith("jaxpar: error:")


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
