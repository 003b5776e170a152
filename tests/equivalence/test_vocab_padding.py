"""A vocabulary that does not divide over the devices splitting it, padded
(docs/configuration.md, "Padded vocabularies"): the masked loss against the unpadded model's,
``tensor=2``, ``fsdp x tensor`` and a ``pipe=2 tensor=2`` pipeline against one device (each
padding differently), generation that never emits a padded id, and a checkpoint resumed under
a layout that pads differently. The Hugging Face side (import, export, LoRA, transformers'
logits): tests/integration/test_hf_vocab_padding.py."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import layout_trainer, make_batches

from jaxpar.checkpoint import state as checkpoint
from jaxpar.checkpoint.weights import restore_params
from jaxpar.config import Config, load_config, validate
from jaxpar.inference.generation import Generator, Sampling
from jaxpar.mesh import make_mesh
from jaxpar.model.loss import summed_token_loss
from jaxpar.model.transformer import create_model
from jaxpar.model.vocab import VOCAB_AXIS, fit_vocab

V = 257  # no mesh axis divides it
BASE = ("model.vocab_size=257", "model.vocab_multiple=1", "train.dtype=float32")
ONE_DEVICE = ("mesh.data=1",)
LAYOUTS = {  # overrides -> the rows the layout pads the vocabulary to
    ("mesh.data=1", "mesh.tensor=2"): 258,
    ("mesh.data=1", "mesh.fsdp=2", "mesh.tensor=2"): 258,
    ("mesh.data=1", "mesh.pipe=2", "mesh.tensor=2", "train.microbatches=2"): 260,
}


def true_part(tree: dict, rows: int = V) -> dict:
    """``tree`` (parameters or gradients) with the embedding and head cut to ``rows``."""
    return fit_vocab(tree, rows)


def padding_of(tree: dict) -> list[np.ndarray]:
    """The padded rows (columns) of the embedding and the head."""
    return [np.take(np.asarray(tree[k]), range(V, tree[k].shape[a]), axis=a)
            for k, a in VOCAB_AXIS.items() if k in tree]


def assert_close(got: dict, ref: dict, tolerance: float = 1e-5) -> None:
    errors = jax.tree.map(lambda a, b: float(np.abs(np.asarray(a) - np.asarray(b)).max()
                                             / (np.abs(np.asarray(b)).max() + 1e-12)), got, ref)
    worst = max(jax.tree.leaves(errors))
    assert worst <= tolerance, errors


# --------------------------------------------------------------------------------------------
# The mask: the loss and the logits of the padded model are the unpadded one's.


@pytest.mark.parametrize("pieces, softcap", [(1, 0.0), (4, 0.0), (1, 10.0), (4, 10.0)])
def test_the_masked_loss_and_its_gradients_are_the_unpadded_models(pieces, softcap):
    """The head padded from 257 to 384 columns, the padding filled with large logits (masked
    means masked, not small): the summed token loss (whole, and in 4 pieces of the sequence;
    soft-capped or not) and its gradients w.r.t. the hidden states and the head's true columns
    are the unpadded head's; the padded columns get no gradient."""
    rng = np.random.default_rng(0)
    h = jnp.asarray(rng.standard_normal((2, 16, 8)), jnp.float32)
    head = jnp.asarray(rng.standard_normal((8, V)), jnp.float32)
    padded = jnp.concatenate([head, jnp.full((8, 384 - V), 30.0)], axis=1)
    targets = jnp.asarray(rng.integers(0, V, (2, 16)), jnp.int32).at[0, :3].set(V - 1)
    mask = jnp.ones((2, 16), jnp.float32).at[1, -4:].set(0.0)

    def loss(h, w, vocab):
        return summed_token_loss(h, w, targets, mask, pieces, softcap, vocab)

    want, (want_dh, want_dw) = jax.value_and_grad(loss, argnums=(0, 1))(h, head, None)
    got, (dh, dw) = jax.value_and_grad(loss, argnums=(0, 1))(h, padded, V)
    assert np.isfinite(float(got)) and float(got) == pytest.approx(float(want), rel=1e-6)
    np.testing.assert_allclose(dh, want_dh, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(dw[:, :V], want_dw, rtol=1e-5, atol=1e-7)
    assert not np.asarray(dw[:, V:]).any()
    # Without the true size the padding would win: the mask is what keeps the loss.
    assert float(loss(h, padded, None)) > float(want) + 1.0


def test_the_models_logits_are_minus_infinity_past_the_true_vocabulary():
    m = load_config("tiny", list(BASE)).model
    unpadded, padded = create_model(m, 0), create_model(m, 0, vocab_rows=384)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, V, (2, 8)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(8, dtype=jnp.int32), (2, 8))
    want, got = unpadded(tokens, positions)[0], padded(tokens, positions)[0]
    assert got.shape == (2, 8, 384)
    np.testing.assert_allclose(got[..., :V], want, rtol=1e-6, atol=1e-6)
    assert np.all(np.isneginf(np.asarray(got[..., V:])))
    # A new model's padding is zeros, its true rows the unpadded model's draw.
    params = nnx.to_pure_dict(nnx.state(padded, nnx.Param))
    assert not any(p.any() for p in padding_of(params))
    assert_close(true_part(params), nnx.to_pure_dict(nnx.state(unpadded, nnx.Param)), 0.0)


# --------------------------------------------------------------------------------------------
# Layouts against one device.


@functools.cache
def first_step(overrides: tuple[str, ...]) -> dict:
    """The first batch's loss and gradients of tiny with 257 ids under ``overrides``, and the
    parameters after one optimizer step."""
    cfg, trainer = layout_trainer((*BASE, *overrides))
    batch = trainer.put_batch(make_batches(cfg)[0])
    state = trainer.init()
    loss, grads = trainer.loss_and_grads(state, batch)
    state, _ = trainer.compile_step()(state, batch)
    return {"rows": cfg.vocab_rows(), "loss": float(loss),
            "grads": jax.tree.map(np.asarray, grads),
            "params": jax.tree.map(np.asarray, state.params)}


@pytest.mark.parametrize("overrides", list(LAYOUTS), ids=lambda o: ",".join(
    a.removeprefix("mesh.") for a in o if a.startswith("mesh.") and a != "mesh.data=1"))
def test_a_layout_that_pads_the_vocabulary_trains_as_one_device(overrides):
    """Loss and gradients of the first batch, and the parameters after a step, against one
    device (which pads nothing: 257 rows), on the true rows; the padding's gradients and
    parameters stay zero."""
    ref, got = first_step(ONE_DEVICE), first_step(overrides)
    assert ref["rows"] == V and got["rows"] == LAYOUTS[overrides]
    assert got["loss"] == pytest.approx(ref["loss"], rel=1e-6)
    assert_close(true_part(got["grads"]), ref["grads"])
    # Adam's first step divides by the gradients' magnitude: their round-off shows up to 1e-4
    # (the layouts' tolerance, helpers.assert_grads_and_params_match).
    assert_close(true_part(got["params"]), ref["params"], 1e-4)
    assert not any(p.any() for p in padding_of(got["grads"]) + padding_of(got["params"]))


def test_tied_soft_capped_vocabulary_pieces_of_a_pipeline_train_as_one_device():
    """The head tied to the embedding (its gradient the lookup's and the head's) and the logits
    soft-capped before the mask, in a pipeline's vocabulary pieces (260 rows) against one
    device."""
    extra = ("model.tie_embeddings=true", "model.final_softcap=5")
    ref = first_step((*extra, *ONE_DEVICE))
    got = first_step((*extra, "mesh.data=1", "mesh.pipe=2", "mesh.tensor=2",
                      "train.microbatches=2"))
    assert got["rows"] == 260 and "lm_head" not in got["grads"]
    assert got["loss"] == pytest.approx(ref["loss"], rel=1e-6)
    assert_close(true_part(got["grads"]), ref["grads"])
    # Adam's first step divides by the gradients' magnitude: their round-off shows up to 1e-4
    # (the layouts' tolerance, helpers.assert_grads_and_params_match).
    assert_close(true_part(got["params"]), ref["params"], 1e-4)
    assert not any(p.any() for p in padding_of(got["grads"]) + padding_of(got["params"]))


# --------------------------------------------------------------------------------------------
# Generation never emits a padded id.


def padded_weights(m, rows: int) -> tuple[dict, dict]:
    """An unpadded tiny model's weights padded to ``rows``, the head's padding filled with
    large values (so that only the mask keeps those ids out)."""
    _, params, buffers = nnx.split(create_model(m, 0), nnx.Param, ...)
    params = fit_vocab(jax.tree.map(np.asarray, nnx.to_pure_dict(params)), rows)
    params["lm_head"][:, V:] = 100.0
    params["embedding"][V:] = 1.0
    return params, nnx.to_pure_dict(buffers)


def test_generation_never_emits_a_padded_id():
    m = load_config("tiny", list(BASE)).model
    _, params, buffers = nnx.split(create_model(m, 0), nnx.Param, ...)
    plain = Generator(Config(model=m), nnx.to_pure_dict(params), nnx.to_pure_dict(buffers))
    prompts = [[1, 2, 3, 4, 5], [200, 17, 256]]
    want = plain.generate(prompts, max_tokens=12)
    wide = Config(model=dataclasses.replace(m, vocab_multiple=128))
    assert wide.vocab_rows() == 384
    padded = Generator(wide, *padded_weights(m, 384))
    assert padded.generate(prompts, max_tokens=12) == want  # greedy: the unpadded choice
    sampled = padded.generate(prompts, max_tokens=24, sampling=Sampling(temperature=2.0))
    assert max(max(row) for row in sampled) < V
    (got, _), = padded.score([[1, 2, 3, 256, 9]])
    (ref, _), = plain.score([[1, 2, 3, 256, 9]])
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
    # On a mesh whose padding differs (tensor=2: 258 rows), the weights are cut to it.
    cfg = validate(load_config("tiny", [*BASE, "mesh.data=1", "mesh.tensor=2"]), 2)
    on_mesh = Generator(cfg, *padded_weights(m, 384), make_mesh(cfg, jax.devices()[:2]))
    assert on_mesh.vocab_rows == 258 and on_mesh.params["lm_head"].shape == (64, 258)
    assert on_mesh.generate(prompts, max_tokens=12) == want


# --------------------------------------------------------------------------------------------
# A checkpoint resumed onto a layout that pads differently.


SAVED_UNDER = ("mesh.data=1", "mesh.tensor=2")  # 258 rows
RESUMED_UNDER = {("mesh.data=1", "mesh.tensor=4"): 260, ONE_DEVICE: 257}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict:
    """Two steps under tensor=2 (258 rows), saved; the saved state on the host, the next
    batch, and the state and loss after a third step under tensor=2."""
    run_dir = tmp_path_factory.mktemp("saved")
    cfg, trainer = layout_trainer((*BASE, *SAVED_UNDER, f"run_dir={run_dir}"))
    batches = [trainer.put_batch(b) for b in make_batches(cfg)]
    step, state = trainer.compile_step(), trainer.init()
    for batch in batches[:2]:
        state, _ = step(state, batch)
    saver = checkpoint.Saver(cfg)
    saver.save(2, state, {"position": 2}, {"step": 2, "vocab_rows": cfg.vocab_rows()})
    saver.close()
    host = jax.device_get(state)
    after, metrics = step(state, batches[2])
    return {"path": run_dir / "checkpoints" / "2", "host": host, "batch": make_batches(cfg)[2],
            "after": jax.device_get(after), "loss": float(metrics["loss"])}


def adam_state(opt_state):
    """AdamW's moments (``mu``, ``nu``) in optax's chain of states."""
    return next(s for s in jax.tree.leaves(opt_state, is_leaf=lambda x: hasattr(x, "mu"))
                if hasattr(s, "mu"))


@pytest.mark.parametrize("overrides", list(RESUMED_UNDER), ids=["tensor=4", "one-device"])
def test_a_checkpoint_resumes_onto_a_layout_that_pads_differently(saved, overrides):
    """Saved with 258 rows, restored with 260 (padded with zeros) or 257 (the padding cut):
    every array verified as saved, the parameters and the AdamW moments the saved ones on the
    true rows, zeros past them, and the next step the step the saving layout took."""
    cfg, trainer = layout_trainer((*BASE, *overrides))
    assert cfg.vocab_rows() == RESUMED_UNDER[overrides]
    restored = checkpoint.restore(saved["path"], trainer.abstract_state, vocab_size=V)
    assert restored.verified
    got, want = jax.device_get(restored.state), saved["host"]
    assert got.params["embedding"].shape[0] == cfg.vocab_rows()
    assert_close(true_part(got.params), true_part(want.params), 0.0)
    moments = [adam_state(s.opt_state) for s in (got, want)]
    assert moments[0].mu["lm_head"].shape[1] == cfg.vocab_rows() and moments[1].nu["lm_head"].any()
    for name in ("mu", "nu"):
        mine, saved_one = (true_part(getattr(m, name)) for m in moments)
        assert_close(mine, saved_one, 0.0)
        assert not any(p.any() for p in padding_of(getattr(moments[0], name)))
    assert not any(p.any() for p in padding_of(got.params))
    state, metrics = trainer.compile_step()(restored.state, trainer.put_batch(saved["batch"]))
    assert float(metrics["loss"]) == pytest.approx(saved["loss"], rel=1e-6)
    assert_close(true_part(jax.device_get(state).params), true_part(saved["after"].params))
    # Weights alone (train.init_from, jaxpar eval) are read into the new rows the same way.
    params = restore_params(saved["path"], trainer.abstract_state.params, vocab_size=V)
    assert_close(jax.device_get(params), got.params, 0.0)


def test_a_checkpoint_of_another_vocabulary_is_one_line(saved):
    _, trainer = layout_trainer((*BASE, "model.vocab_size=300", *SAVED_UNDER))
    for read in (lambda: checkpoint.restore(saved["path"], trainer.abstract_state, 300),
                 lambda: restore_params(saved["path"], trainer.abstract_state.params,
                                        vocab_size=300)):
        with pytest.raises(checkpoint.CheckpointError, match="model.vocab_size=257") as err:
            read()
        assert "\n" not in str(err.value) and "300" in str(err.value)
    # Without the true size to check, a padding that differs is a shape that differs.
    _, other = layout_trainer((*BASE, "mesh.data=1", "mesh.tensor=4"))
    with pytest.raises(checkpoint.CheckpointError, match="params/embedding"):
        checkpoint.restore(saved["path"], other.abstract_state)
