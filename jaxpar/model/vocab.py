"""The padded vocabulary: the embedding's rows and the head's columns past ``model.vocab_size``.

The padding ids are no tokens: zero rows (:func:`padded`), ``-inf`` logits (:func:`masked_logits`).
:func:`fit_vocab` resizes to another padding. Details: docs/configuration.md, "Padded vocabularies".
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
    """``logits`` [..., columns] with padding ids' columns (``>= vocab_size``) at ``-inf``.

    ``ids`` [columns]: each column's id (default ``0 .. columns - 1``). ``vocab_size`` None: no
    padding.
    """
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
    """``value`` zero-padded along ``axis`` up to ``rows`` (a new model's padding)."""
    return resized(value, rows, axis) if value.shape[axis] < rows else value


def fit_vocab(params: dict, rows: int) -> dict:
    """``params`` with embedding and head cut or zero-padded to ``rows``; only padding is cut."""
    return {k: resized(v, rows, VOCAB_AXIS[k]) if k in VOCAB_AXIS else v
            for k, v in params.items()}
