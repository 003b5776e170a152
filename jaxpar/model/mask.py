"""The one mask description every attention kernel reads: causal order plus documents.

Query q sees key k when ``segments[q] == segments[k]`` and ``order[q] >= order[k]``. Every field is
``[B, S]`` int32, so the mask is split like the tokens. A plain positions array means
``AttentionMask(order=positions)``. The rules: docs/attention-and-loss.md, "The mask: causal order
and documents" and "Sliding windows and soft-capped scores".
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

SKIP, FULL, MASKED = 0, 1, 2
UNLIMITED = 2**30  # the window of a global layer: wider than any sequence, no int32 overflow


@partial(jax.tree_util.register_dataclass, data_fields=["order", "segments", "rope", "window"],
         meta_fields=["softcap"])
@dataclass(frozen=True)
class AttentionMask:
    """Per token of ``[B, S]`` rows: where it is, its document, rope position and window.

    ``segments``: document ids, non-decreasing along ``order`` (None: one). ``rope``: position in
    its document (None: ``order``). ``window``: keys seen back (None: unlimited). ``softcap`` 0:
    off.
    """

    order: jax.Array
    segments: jax.Array | None = None
    rope: jax.Array | None = None
    window: jax.Array | None = None
    softcap: float = 0.0

    @property
    def rope_positions(self) -> jax.Array:
        return self.order if self.rope is None else self.rope


Positions = jax.Array | AttentionMask  # what the model's layers take


def as_mask(positions: Positions) -> AttentionMask:
    """``positions`` as a mask description (a plain array: causal by it, one document)."""
    return positions if isinstance(positions, AttentionMask) else AttentionMask(positions)


def with_window(positions: Positions, window: jax.Array | int | None, softcap: float = 0.0
                ) -> AttentionMask:
    """``positions`` with ``window`` (broadcast; None: unlimited) and ``softcap``."""
    mask = as_mask(positions)
    if window is not None:
        window = jnp.broadcast_to(jnp.asarray(window, jnp.int32), mask.order.shape)
    return replace(mask, window=window, softcap=float(softcap))


def rope_positions(positions: Positions) -> jax.Array:
    """The positions rotary embeddings use (restarting at each document)."""
    return as_mask(positions).rope_positions


def visible(q: AttentionMask, k: AttentionMask) -> jax.Array:
    """bool ``[B, Sq, Sk]``: which keys each query sees."""
    seen = q.order[:, :, None] >= k.order[:, None, :]
    if q.window is not None:
        seen = seen & (q.order[:, :, None] - k.order[:, None, :] < q.window[:, :, None])
    if q.segments is not None:
        seen = seen & (q.segments[:, :, None] == k.segments[:, None, :])
    return seen


def block_kind(q: Positions, k: Positions) -> jax.Array:
    """SKIP, FULL or MASKED per (query block, key block); ``[B, n]`` tiles or ``[n]`` rows."""
    q, k = as_mask(q), as_mask(k)
    qo, ko = q.order, k.order
    skip = qo.max(-1) < ko.min(-1)
    full = qo.min(-1) > ko.max(-1)
    if q.window is not None:
        # The oldest key each query sees has order q.order - q.window + 1.
        reach = qo - q.window
        skip = skip | (reach.min(-1) >= ko.max(-1))
        full = full & (reach.max(-1) < ko.min(-1))
    if q.segments is not None:
        qs, ks = q.segments, k.segments
        skip = skip | (qs.max(-1) < ks.min(-1)) | (qs.min(-1) > ks.max(-1))
        # Segments only grow along the row, so these two equalities leave one document.
        full = full & (qs.min(-1) == ks.max(-1)) & (qs.max(-1) == ks.min(-1))
    return jnp.where(jnp.all(skip), SKIP, jnp.where(jnp.all(full), FULL, MASKED))


def document_positions(segment_ids: np.ndarray) -> np.ndarray:
    """int32 ``[n, S]``: each token's index in its document, from segment ids in row order."""
    segment_ids = np.asarray(segment_ids)
    index = np.broadcast_to(np.arange(segment_ids.shape[-1]), segment_ids.shape)
    starts = np.ones(segment_ids.shape, bool)
    starts[..., 1:] = segment_ids[..., 1:] != segment_ids[..., :-1]
    first = np.maximum.accumulate(np.where(starts, index, 0), axis=-1)
    return (index - first).astype(np.int32)
