"""The padded vocabulary: the embedding's rows and the output head's columns past
``model.vocab_size``.

A layout that splits the vocabulary over devices needs its size to divide (``tensor``, and a
pipeline's stages); :meth:`jaxpar.config.Config.vocab_rows` derives the padded size from the
config, which keeps the true one. The padding ids are no tokens:

- no token has one, so the embedding never reads their rows; a new model, an import and a
  checkpoint padded anew hold zeros there (:func:`padded`);
- their logits are masked, ``-inf`` after any soft cap and before every softmax and argmax
  (:func:`masked_logits`): they take no probability and no gradient, and never win a greedy
  pick, so the loss, perplexity and generation are the unpadded model's. Every logits path
  calls it: the model's logits, the token loss, a pipeline stage's piece of the vocabulary.

:func:`fit_vocab` resizes a model's vocabulary-shaped weights to another padding (``jaxpar
export`` strips it, generation lays weights out for its own mesh).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# Parameter -> the axis of its shape that runs over the vocabulary.
VOCAB_AXIS = {"embedding": 0, "lm_head": 1}


def masked_logits(logits: jax.Array, vocab_size: int | None,
                  ids: jax.Array | None = None) -> jax.Array:
    """``logits`` [..., columns] with the columns of padding ids (``>= vocab_size``) at
    ``-inf``. ``ids``: each column's token id ([columns]: a pipeline stage's piece of the
    vocabulary); by default ``0 .. columns - 1``, and then logits without padding are returned
    as they are (nothing is traced). ``vocab_size`` None: no padding."""
    if vocab_size is None:
        return logits
    if ids is None:
        if logits.shape[-1] <= vocab_size:
            return logits
        ids = jnp.arange(logits.shape[-1])
    return jnp.where(ids < vocab_size, logits, -jnp.inf)


def resized(value: Any, rows: int, axis: int) -> Any:
    """``value`` (a numpy or jax array) cut or zero-padded to ``rows`` along ``axis``."""
    have = value.shape[axis]
    if have >= rows:
        return value[(slice(None),) * axis + (slice(0, rows),)]
    widths = [(0, 0)] * value.ndim
    widths[axis] = (0, rows - have)
    pad = np.pad if isinstance(value, np.ndarray) else jnp.pad
    return pad(value, widths)


def padded(value: Any, rows: int, axis: int) -> Any:
    """``value`` with zeros appended along ``axis`` up to ``rows`` (a new model's padding)."""
    return resized(value, rows, axis) if value.shape[axis] < rows else value


def fit_vocab(params: dict, rows: int) -> dict:
    """``params`` (a model's nested dict) with the embedding and the head, where it has them,
    cut or zero-padded to ``rows`` along the vocabulary: ``model.vocab_size`` strips the
    padding, :meth:`~jaxpar.config.Config.vocab_rows` pads for a layout. Only padding is ever
    cut (``rows`` is at least the true vocabulary)."""
    return {k: resized(v, rows, VOCAB_AXIS[k]) if k in VOCAB_AXIS else v
            for k, v in params.items()}
