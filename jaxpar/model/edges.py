"""The model's two ends on plain arrays: the embedding's scale, the output head, and the loss.

The model's own ``embed``, ``logits`` and token loss call these, and so does a pipeline stage,
which holds one piece of the vocabulary and cannot run the model's methods whole
(:mod:`jaxpar.parallel.pipeline.stages`). So each feature of the ends (``model.embed_scale``,
``model.tie_embeddings``, ``model.final_softcap``, the padded vocabulary's mask) is written once,
here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxpar.config import ModelConfig
from jaxpar.model.loss import head_logits, summed_token_loss, vocab_piece_loss


@dataclass(frozen=True)
class Edges:
    """The ends of a model of ``cfg`` whose vocabulary is padded to ``vocab_rows`` ids."""

    cfg: ModelConfig
    vocab_rows: int

    @property
    def masked_from(self) -> int | None:
        """The first padding id, whose logits are masked; None: no padding."""
        return self.cfg.vocab_size if self.vocab_rows > self.cfg.vocab_size else None

    @property
    def head_param(self) -> str:
        """The parameter the output head reads: the embedding's rows when tied."""
        return "embedding" if self.cfg.tie_embeddings else "lm_head"

    def scaled(self, rows: jax.Array) -> jax.Array:
        """Embedding rows times ``sqrt(d_model)`` under ``model.embed_scale``, in their own
        dtype (rounded as transformers rounds it). Linear and symmetric: also the gradient's."""
        if not self.cfg.embed_scale:
            return rows
        return rows * jnp.asarray(self.cfg.d_model ** 0.5, rows.dtype)

    def head_table(self, params: Mapping[str, jax.Array]) -> jax.Array:
        """The head as a table [vocab rows, d_model], one row per token id, from the model's
        top-level arrays ``params``."""
        table = params[self.head_param]
        return table if self.cfg.tie_embeddings else table.T

    def head_grad(self, d_head: jax.Array) -> tuple[str, jax.Array, int]:
        """A gradient of the head [d_model, ids] as (parameter, gradient laid out as that
        parameter, the parameter's vocabulary axis)."""
        if self.cfg.tie_embeddings:
            return "embedding", d_head.T, 0
        return "lm_head", d_head, 1

    def logits(self, h: jax.Array, head: jax.Array) -> jax.Array:
        """float32 logits [B, S, vocab rows] of final hidden states ``h`` (soft-capped, the
        padding masked)."""
        return head_logits(h, head, self.cfg.final_softcap, self.masked_from)

    def token_loss(self, h: jax.Array, head: jax.Array, targets: jax.Array, mask: jax.Array,
                   pieces: int = 1) -> jax.Array:
        """The summed token loss of ``h @ head`` (:func:`~jaxpar.model.loss.summed_token_loss`,
        over ``pieces`` pieces of the sequence)."""
        return summed_token_loss(h, head, targets, mask, pieces, self.cfg.final_softcap,
                                 self.masked_from)

    def piece_loss(self, head: jax.Array, ids: jax.Array, h: jax.Array, targets: jax.Array,
                   mask: jax.Array, scale: jax.Array, axis: str) -> tuple:
        """The loss over a vocabulary cut across the manual ``axis``
        (:func:`~jaxpar.model.loss.vocab_piece_loss`): (summed loss, d_head, d_h)."""
        return vocab_piece_loss(head, ids, h, targets, mask, scale, axis,
                                self.cfg.final_softcap, self.masked_from)
