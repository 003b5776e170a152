"""Text generation (jaxpar/inference/generation.py, jaxpar/model/kv_cache.py) against the
uncached model.

The reference is the model itself, uncached: the whole sequence through the training forward
pass for every new token, argmax at the last position. Models are initialised with a large
scale (``init_std=0.5``) so that the argmax margins are far above float32 round-off and
token-for-token equality is the right test.

Against Hugging Face transformers and through ``jaxpar generate``:
``tests/integration/test_generate_end_to_end.py``; sampling options, cache sizes and the command
line's errors: ``tests/unit/test_generate_options.py``.
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
from helpers import GENERATION_MODEL as DENSE
from helpers import GENERATION_PROMPTS as PROMPTS
from helpers import greedy_by_full_forward

from jaxpar.config import Config, MeshConfig, MoEConfig
from jaxpar.inference.generation import Generator, Sampling, generate, sample
from jaxpar.mesh import make_mesh
from jaxpar.model.transformer import create_model

# DENSE (helpers.GENERATION_MODEL): d_model 64, 2 layers, init_std=0.5. PROMPTS: lengths 4, 19
# (past the 16-token bucket) and 2; with a mesh of data=2 they pad to 4 rows.
# Groups of (dense, MoE) blocks: two attention layers per scanned unit; sigmoid router (buffers).
MOE = dataclasses.replace(DENSE, n_layers=4, moe=MoEConfig(
    num_experts=4, top_k=2, every=2, d_ff_expert=64, router="sigmoid_bias"))
# The 19-token prompt pads to 32 = 2 blocks of 16: the prefill runs blockwise attention.
BLOCKWISE = dataclasses.replace(DENSE, attention_block=16)
MODELS = {"dense": DENSE, "moe": MOE, "blockwise": BLOCKWISE}
NEW = 32


@functools.cache
def model(name: str, init_std: float | None = None):
    cfg = MODELS[name] if init_std is None else dataclasses.replace(MODELS[name],
                                                                    init_std=init_std)
    return create_model(cfg, seed=0)


@functools.cache
def uncached_greedy(name: str, prompt: tuple[int, ...], new: int = NEW) -> list[int]:
    """Greedy tokens by full forward passes (helpers.greedy_by_full_forward)."""
    return greedy_by_full_forward(model(name), prompt, new)


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
