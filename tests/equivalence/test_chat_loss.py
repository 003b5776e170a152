"""The trainer's loss on a chat batch (``data.loss_on=assistant``): the model's summed token
loss over the batch's mask, divided by the mask's sum as the step does, equals numpy's mean of
-log softmax at the targets over the assistant's tokens only (tests/unit/test_chat_data.py
builds the mask)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import save_chat_tokenizer, write_chat

from jaxpar.data import build_dataset, make_tokenizer


@pytest.mark.parametrize("pieces", [1, 2])
def test_the_trainers_masked_loss_equals_numpy_on_chat_rows(tmp_path, pieces):
    import jax.numpy as jnp

    from jaxpar.model.loss import summed_token_loss

    tok = make_tokenizer(save_chat_tokenizer(tmp_path / "tok"))
    source = write_chat(tmp_path / "chat.jsonl",
                        [{"prompt": f"q{i}?", "completion": f"a{i}."} for i in range(5)])
    ds = build_dataset(source, tok, seq_len=16, val_fraction=0.0, loss_on="assistant")
    rows = ds.rows(np.arange(4))
    rng = np.random.default_rng(1)
    h = rng.normal(size=(4, 16, 8)).astype(np.float32)
    head = rng.normal(size=(8, tok.vocab_size)).astype(np.float32)
    total = summed_token_loss(jnp.asarray(h), jnp.asarray(head), jnp.asarray(rows["targets"]),
                              jnp.asarray(rows["mask"]), pieces)
    loss = float(total) / max(rows["mask"].sum(), 1.0)

    logits = h.astype(np.float64) @ head.astype(np.float64)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    picked = np.take_along_axis(logp, rows["targets"][..., None], -1)[..., 0]
    on = rows["mask"] == 1.0
    assert 0 < on.sum() < on.size
    np.testing.assert_allclose(loss, -picked[on].mean(), rtol=1e-5)
