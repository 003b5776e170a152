"""The token loss: cross entropy of the head's float32 logits.

Whole, in pieces of the sequence, or over a vocabulary cut across devices (a pipeline's stages). The
head's gradient is one partial sum per token shard, added once after the pieces. The derivation:
docs/attention-and-loss.md, "The loss at vocabulary scale".
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from jaxpar.model.annotate import constrain, split_count, sum_over_token_shards
from jaxpar.model.projection import RESIDUAL, float32_logits
from jaxpar.model.vocab import masked_logits

HIDDEN = ("batch", "seq", "act_embed")  # the final norm's output, entering the head
HEAD = ("act_embed", "vocab")  # the head as the loss multiplies with it
STORED_HEAD = ("embed", "vocab")  # ... and as stored (split over fsdp under ZeRO-3)


def head_logits(h: jax.Array, head: jax.Array, softcap: float = 0.0,
                vocab_size: int | None = None) -> jax.Array:
    """float32 logits [B, S, vocab] of ``h`` [B, S, d_model], soft-capped, padding masked.

    The losses below take the logits before the cap and the mask.
    """
    logits = soft_capped(constrain(float32_logits(h, head), ("batch", "seq", "vocab")), softcap)
    return masked_logits(logits, vocab_size)


def soft_capped(logits: jax.Array, cap: float) -> jax.Array:
    """``cap * tanh(logits / cap)`` (Gemma 2's final soft cap); ``cap`` 0: unchanged."""
    return cap * jnp.tanh(logits / cap) if cap else logits


def summed_token_loss(h: jax.Array, head: jax.Array, targets: jax.Array, mask: jax.Array,
                      pieces: int = 1, softcap: float = 0.0, vocab_size: int | None = None
                      ) -> jax.Array:
    """Sum over tokens of ``mask`` x cross entropy of ``h @ head`` against ``targets``.

    In ``pieces`` strided pieces (:func:`sequence_pieces`): one piece's float32 logits alive at a
    time, recomputed backward. Columns from ``vocab_size`` on are masked.
    """
    if pieces == 1:
        return jnp.sum(token_losses(head_logits(h, head), targets, softcap, vocab_size) * mask)
    return _loss_in_pieces(pieces, softcap, vocab_size, h, head, targets, mask)


def _pieces(n: int, *arrays: jax.Array) -> tuple[jax.Array, ...]:
    return tuple(sequence_pieces(a, n) for a in arrays)


@partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _loss_in_pieces(pieces: int, softcap: float, vocab_size: int | None, h: jax.Array,
                    head: jax.Array, targets: jax.Array, mask: jax.Array) -> jax.Array:
    def one_piece(total: jax.Array, piece: tuple) -> tuple[jax.Array, None]:
        h_i, targets_i, mask_i = piece
        logits = head_logits(constrain(h_i, HIDDEN), head)
        losses = token_losses(logits, targets_i, softcap, vocab_size)
        return total + jnp.sum(losses * mask_i), None

    total, _ = jax.lax.scan(one_piece, jnp.zeros((), jnp.float32),
                            _pieces(pieces, h, targets, mask))
    return total


def _loss_in_pieces_fwd(pieces, softcap, vocab_size, h, head, targets, mask):
    return (_loss_in_pieces(pieces, softcap, vocab_size, h, head, targets, mask),
            (h, head, targets, mask))


def _loss_in_pieces_bwd(pieces, softcap, vocab_size, residuals, g):
    h, head, targets, mask = residuals

    def one_piece(partial_sums: jax.Array, piece: tuple) -> tuple[jax.Array, jax.Array]:
        h_i, targets_i, mask_i = piece
        h_i = constrain(h_i, HIDDEN)
        logits, logits_vjp = jax.vjp(lambda x: head_logits(x, head), h_i)
        d_logits = token_loss_grad(logits, targets_i, mask_i * g, softcap, vocab_size)
        (d_h,) = logits_vjp(d_logits)  # its weight gradient, unused, is left out by XLA
        return partial_sums + per_shard_weight_grad(h_i, d_logits), _as_residual(d_h)

    zeros = jnp.zeros((split_count("batch"), split_count("seq"), *head.shape), jnp.float32)
    partial_sums, d_h = jax.lax.scan(one_piece, constrain(zeros, _PER_SHARD),
                                     _pieces(pieces, h, targets, mask))
    d_head = sum_over_token_shards(partial_sums, HEAD, STORED_HEAD).astype(head.dtype)
    return joined_pieces(d_h), d_head, None, None  # None: targets and mask have none


_loss_in_pieces.defvjp(_loss_in_pieces_fwd, _loss_in_pieces_bwd)


def _as_residual(d_h: jax.Array) -> jax.Array:
    """A piece's input gradient in the residual stream's layout, where its tokens divide.

    Under sequence parallelism a partial sum over ``tensor`` is then reduce-scattered straight into
    the stream.
    """
    if d_h.shape[0] % split_count("residual_batch") or d_h.shape[1] % split_count("residual_seq"):
        return d_h
    return constrain(d_h, RESIDUAL)


# The head gradient's partial sums, one per (batch shard, sequence shard) of the tokens.
_PER_SHARD = ("batch", "seq", *HEAD)


def per_shard_weight_grad(h: jax.Array, dy: jax.Array) -> jax.Array:
    """``h^T dy`` as one partial sum per token shard: ``[batch shards, seq shards, E, V]``.

    ``h`` [B, S, E], ``dy`` [B, S, V] float32. Each device contracts its own tokens; no collective.
    """
    nb, ns = split_count("batch"), split_count("seq")
    b, s = h.shape[:2]
    h = constrain(h.reshape(nb, b // nb, ns, s // ns, h.shape[-1]),
                  ("batch", None, "seq", None, "act_embed"))
    dy = constrain(dy.reshape(nb, b // nb, ns, s // ns, dy.shape[-1]),
                   ("batch", None, "seq", None, "vocab"))
    dw = jnp.einsum("abcde,abcdv->acev", h, dy, preferred_element_type=jnp.float32)
    return constrain(dw, _PER_SHARD)




def sequence_pieces(a: jax.Array, n: int) -> jax.Array:
    """[B, S, ...] -> [n, B, S/n, ...]: piece i holds tokens i, i + n, i + 2n, ...

    A device's contiguous shard of the sequence keeps its tokens in every piece.
    """
    b, s = a.shape[:2]
    return jnp.moveaxis(a.reshape(b, s // n, n, *a.shape[2:]), 2, 0)


def joined_pieces(a: jax.Array) -> jax.Array:
    """The inverse of :func:`sequence_pieces`: [n, B, S/n, ...] -> [B, S, ...]."""
    n, b, s = a.shape[:3]
    return jnp.moveaxis(a, 0, 2).reshape(b, s * n, *a.shape[3:])


def token_losses(logits: jax.Array, targets: jax.Array, softcap: float = 0.0,
                 vocab_size: int | None = None) -> jax.Array:
    """Per-token float32 cross entropy of logits capped at ``softcap`` (0: off), padding masked.

    The backward pass keeps only the capped, unmasked logits and ``log_z``. The mask's ``-inf``
    would make the cap's derivative NaN.
    """
    return _token_losses(logits.astype(jnp.float32), targets, softcap, vocab_size)


def token_loss_grad(logits: jax.Array, targets: jax.Array, scale: jax.Array,
                    softcap: float = 0.0, vocab_size: int | None = None) -> jax.Array:
    """The gradient of ``sum(token_losses(...) * scale)`` w.r.t. float32 ``logits``.

    ``(softmax(z) - one_hot(targets)) * scale * dz/dlogits``, z capped and masked (zero at padding).
    """
    capped = soft_capped(logits, softcap)
    log_z = jax.nn.logsumexp(masked_logits(capped, vocab_size), axis=-1)
    return _token_losses_bwd(softcap, vocab_size, (capped, targets, log_z), scale)[0]


@partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _token_losses(logits: jax.Array, targets: jax.Array, softcap: float,
                  vocab_size: int | None) -> jax.Array:
    return _token_losses_fwd(logits, targets, softcap, vocab_size)[0]


def _is_target(logits: jax.Array, targets: jax.Array) -> jax.Array:
    # A one-hot select rather than a gather keeps the vocab dimension elementwise, so each shard
    # picks its own target logits and only a [B, S] partial sum crosses devices.
    return jnp.arange(logits.shape[-1]) == targets[..., None]


def _token_losses_fwd(logits, targets, softcap, vocab_size):
    capped = soft_capped(logits, softcap)
    log_z = jax.nn.logsumexp(masked_logits(capped, vocab_size), axis=-1)
    target_logit = jnp.sum(jnp.where(_is_target(logits, targets), capped, 0.0), axis=-1)
    return log_z - target_logit, (capped, targets, log_z)


def _token_losses_bwd(softcap, vocab_size, residuals, g):
    capped, targets, log_z = residuals  # the cap's derivative is 1 - (capped / cap)^2
    d_capped = _d_logits(masked_logits(capped, vocab_size), log_z,
                         _is_target(capped, targets), g)
    if softcap:
        d_capped = d_capped * (1 - jnp.square(capped / softcap))
    return d_capped, None  # None: integer targets have no gradient


def _d_logits(logits: jax.Array, log_z: jax.Array, is_target: jax.Array,
              scale: jax.Array) -> jax.Array:
    """``(softmax(logits) - one_hot(target)) * scale``: the scaled token loss's gradient."""
    probs = jnp.exp(logits - log_z[..., None])
    return (probs - is_target.astype(jnp.float32)) * scale[..., None]


_token_losses.defvjp(_token_losses_fwd, _token_losses_bwd)


def vocab_piece_loss(head: jax.Array, ids: jax.Array, h: jax.Array, targets: jax.Array,
                     mask: jax.Array, scale: jax.Array, axis: str, softcap: float = 0.0,
                     vocab_size: int | None = None) -> tuple:
    """Cross entropy over a vocabulary cut into pieces across the manual ``axis``.

    This device holds ``head`` [E, V/p], the columns of ``ids`` [V/p]; ``h`` [B, s, E] is
    everywhere. Returns (summed loss, d_head, d_h), weighted ``mask * scale`` per token. Each piece
    caps its logits, then masks ids from ``vocab_size`` on (None: none). The VJP is taken unmasked.
    """
    logits, logits_vjp = jax.vjp(lambda w, h: soft_capped(float32_logits(h, w), softcap),
                                 head, h)
    logits = masked_logits(constrain(logits, ("batch", "seq", "vocab")), vocab_size, ids)
    top = jax.lax.pmax(jnp.max(jax.lax.stop_gradient(logits), axis=-1), axis)
    exp_sum = jax.lax.psum(jnp.sum(jnp.exp(logits - top[..., None]), axis=-1), axis)
    log_z = top + jnp.log(exp_sum)
    is_target = ids == targets[..., None]
    target = jax.lax.psum(jnp.sum(jnp.where(is_target, logits, 0.0), axis=-1), axis)
    loss = jnp.sum((log_z - target) * mask)
    d_head, d_h = logits_vjp(_d_logits(logits, log_z, is_target, mask * scale))
    return loss, d_head, d_h
