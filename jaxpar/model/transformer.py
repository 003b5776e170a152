"""The decoder: token embedding, a scanned stack of blocks, final norm, output projection, loss.

The blocks are created with ``nnx.vmap`` so each parameter gets a leading ``layers`` dimension,
and run with ``jax.lax.scan``: the traced (and compiled) program holds one block whatever the
depth, so compile time does not grow with ``n_layers``.

With a mixture of experts (``model.moe.num_experts > 0``) the scanned unit must still be one
homogeneous module, so it is a *group* of ``moe.every`` consecutive blocks whose last block has
a MoE layer instead of the SwiGLU MLP: ``every=1`` stacks MoE blocks (parameters
``layers/moe/...``), ``every=2`` stacks (dense, MoE) pairs (``layers/block_0/mlp/...``,
``layers/block_1/moe/...``). The leading ``layers`` dimension then counts groups,
``n_layers / every`` of them (validation requires it to divide); a pipeline stage takes whole
groups.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.config import ModelConfig
from jaxpar.model.annotate import constrain, reshard_after_forward, split_count
from jaxpar.model.layers import Attention, RMSNorm, SwiGLU, _param
from jaxpar.model.moe import LAYER_STACKED, MoE
from jaxpar.model.projection import RESIDUAL, float32_logits, lookup, weight

Aux = dict[str, jax.Array]  # float32 statistics and losses of the MoE layers ({} when dense)

REMAT_POLICIES: dict[str, Callable | None] = {
    "none": None,  # keep every activation
    "full": jax.checkpoint_policies.nothing_saveable,  # keep only block inputs, recompute all
    # keep the outputs of the weight matmuls (no batch dims), recompute the cheap elementwise
    # ops and the attention scores/probabilities
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


class Block(nnx.Module):
    """Pre-norm decoder block: x + attn(norm(x)), then + ffn(norm(x)), where ffn is the SwiGLU
    MLP, or with ``moe=True`` a mixture of experts (:class:`jaxpar.model.moe.MoE`).

    Between blocks the residual stream is laid out as ``RESIDUAL`` (its tokens split over
    ``tensor`` too under sequence parallelism); the matmul inputs are laid out as ``seq``. The
    change of layout is where the compiler puts the all-gather (entering) and reduce-scatter
    (leaving) of Megatron-SP, or, without SP, the all-reduce of the row-parallel output.
    """

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, moe: bool = False):
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg, rngs)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        if moe:
            self.moe = MoE(cfg, rngs)
        else:
            self.mlp = SwiGLU(cfg, rngs)

    def __call__(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, Aux]:
        h, h_from = self.attn_norm.for_matmul(x)
        x = x + constrain(self.attn(h, positions, h_from), RESIDUAL)
        h, h_from = self.mlp_norm.for_matmul(x)
        if hasattr(self, "moe"):
            out, aux = self.moe(h)
        else:
            out, aux = self.mlp(h, h_from), {}
        return x + constrain(out, RESIDUAL), aux


class BlockGroup(nnx.Module):
    """``moe.every`` consecutive blocks, the scanned unit of a MoE model with ``every > 1``:
    ``block_0`` .. ``block_{every-2}`` dense, ``block_{every-1}`` with the MoE layer."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.size = cfg.moe.every
        for i in range(self.size):
            setattr(self, f"block_{i}", Block(cfg, rngs, moe=i == self.size - 1))

    def __call__(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, Aux]:
        for i in range(self.size):
            x, aux = getattr(self, f"block_{i}")(x, positions)
        return x, aux  # the MoE block's: the dense ones have none


def layer_units(cfg: ModelConfig) -> int:
    """Length of the stacked ``layers`` dimension: blocks, or groups of ``moe.every`` blocks."""
    return cfg.n_layers // cfg.moe.every if cfg.moe.enabled else cfg.n_layers


def _make_unit(cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.Module:
    if not cfg.moe.enabled:
        return Block(cfg, rngs)
    return Block(cfg, rngs, moe=True) if cfg.moe.every == 1 else BlockGroup(cfg, rngs)


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embedding = _param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), 1.0)

        @nnx.split_rngs(splits=layer_units(cfg))
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make_blocks(rngs: nnx.Rngs) -> nnx.Module:
            return _make_unit(cfg, rngs)

        self.layers = make_blocks(rngs)
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        if not cfg.tie_embeddings:
            self.lm_head = _param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"),
                                  cfg.init_std)

    def __call__(self, tokens: jax.Array, positions: jax.Array, *, dtype=jnp.float32,
                 remat: str = "none") -> tuple[jax.Array, Aux]:
        """tokens, positions: int32 [B, S] -> (float32 logits [B, S, vocab], aux of
        :meth:`run_layers`)."""
        x = self.embed(tokens, dtype=dtype)
        x, aux = self.run_layers(x, positions, remat=remat)
        return self.logits(x, dtype=dtype), aux

    # The three pieces below are also what a pipeline stage runs: the first stage embeds, every
    # stage runs its slice of ``layers`` (a model merged with fewer stacked layers runs just
    # those), the last computes the logits.

    def embed(self, tokens: jax.Array, *, dtype=jnp.float32, grad_pieces: int = 1
              ) -> jax.Array:
        """int32 [B, S] -> the residual stream [B, S, d_model] in ``dtype``: a gather (from each
        device's rows and summed where ``vocab`` is split over devices); the table's
        gradient is built for ``grad_pieces`` slices of the vocabulary one after another
        (:func:`~jaxpar.model.projection.lookup`)."""
        tokens = constrain(tokens, ("batch", "seq"))
        x = lookup(tokens, self.embedding, ("vocab", "act_embed"), dtype, grad_pieces,
                   vocab_shards=split_count("vocab"))
        return constrain(x, RESIDUAL)

    def run_layers(self, x: jax.Array, positions: jax.Array, *, remat: str = "none",
                   ) -> tuple[jax.Array, Aux]:
        """Every unit of ``self.layers`` in order, as one ``lax.scan``.

        Returns the residual stream and ``aux``, the MoE layers' float32 losses and statistics
        (``{}`` for a dense model): each entry summed over the units, except those in
        :data:`jaxpar.model.moe.LAYER_STACKED` (``layer_expert_tokens`` [units, experts]),
        which keep one row per unit, in stack order, because the router-bias update needs each
        layer's own load. (A model merged with a slice of ``layers`` returns that slice's rows:
        concatenate them over pipeline stages; add everything else.)
        """
        graphdef, stacked = nnx.split(self.layers)

        def one_unit(x: jax.Array, layer_state) -> tuple[jax.Array, Aux]:
            return nnx.merge(graphdef, layer_state)(x, positions)

        if REMAT_POLICIES[remat] is not None:
            one_unit = jax.checkpoint(one_unit, policy=REMAT_POLICIES[remat],
                                      prevent_cse=False)
        # Without remat nothing would gather a layer's weights again for its backward pass.
        with reshard_after_forward(remat == "none"):
            x, per_unit = jax.lax.scan(one_unit, x, stacked)
        aux = {k: v if k in LAYER_STACKED else jnp.sum(v, axis=0) for k, v in per_unit.items()}
        return x, aux

    def logits(self, x: jax.Array, *, dtype=jnp.float32) -> jax.Array:
        """The residual stream -> float32 logits [B, S, vocab] (final norm, output head)."""
        return head_logits(self.final_hidden(x), self.head(dtype))

    def final_hidden(self, x: jax.Array) -> jax.Array:
        """The residual stream after the final norm: what the output head multiplies."""
        return constrain(self.final_norm(x), ("batch", "seq", "act_embed"))

    def head(self, dtype=jnp.float32) -> jax.Array:
        """The output head [d_model, vocab] in ``dtype`` (the embedding's transpose if tied)."""
        return (weight(self.embedding, ("vocab", "act_embed"), dtype).T if self.cfg.tie_embeddings
                else weight(self.lm_head, ("act_embed", "vocab"), dtype))


def head_logits(h: jax.Array, head: jax.Array) -> jax.Array:
    """float32 logits [B, S, vocab] of final hidden states ``h`` [B, S, d_model]."""
    return constrain(float32_logits(h, head), ("batch", "seq", "vocab"))


def summed_token_loss(h: jax.Array, head: jax.Array, targets: jax.Array, mask: jax.Array,
                      pieces: int = 1) -> jax.Array:
    """Sum over tokens of ``mask`` x the cross entropy of ``h @ head`` against ``targets``,
    computed over ``pieces`` pieces of the sequence one after another: only one piece's float32
    logits ([B, S/pieces, vocab]) and their gradient are alive at a time; the backward pass
    recomputes each piece's logits (one more head matmul, 2 x d_model x vocab flops a token).

    Piece i holds tokens i, i + n, i + 2n, ... (n = ``pieces``): a strided cut, so each
    device's contiguous shard of the sequence (context parallelism) keeps its own tokens in
    every piece and nothing moves between devices. The sum does not depend on the order.
    """
    if pieces == 1:
        return jnp.sum(token_losses(head_logits(h, head), targets) * mask)

    @jax.checkpoint
    def one_piece(total: jax.Array, piece: tuple) -> tuple[jax.Array, None]:
        h_i, targets_i, mask_i = piece
        h_i = constrain(h_i, ("batch", "seq", "act_embed"))
        return total + jnp.sum(token_losses(head_logits(h_i, head), targets_i) * mask_i), None

    total, _ = jax.lax.scan(one_piece, jnp.zeros((), jnp.float32),
                            tuple(sequence_pieces(a, pieces) for a in (h, targets, mask)))
    return total


def sequence_pieces(a: jax.Array, n: int) -> jax.Array:
    """[B, S, ...] -> [n, B, S/n, ...]: piece i holds tokens i, i + n, i + 2n, ... (a strided
    cut, so a device's contiguous shard of the sequence keeps its tokens in every piece)."""
    b, s = a.shape[:2]
    return jnp.moveaxis(a.reshape(b, s // n, n, *a.shape[2:]), 2, 0)


def joined_pieces(a: jax.Array) -> jax.Array:
    """The inverse of :func:`sequence_pieces`: [n, B, S/n, ...] -> [B, S, ...]."""
    n, b, s = a.shape[:3]
    return jnp.moveaxis(a, 0, 2).reshape(b, s * n, *a.shape[3:])


def token_losses(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Per-token cross entropy in float32. With logits split on vocab, the max and the sum of
    exponentials each become a small all-reduce over the vocab shards (vocab-parallel loss).

    The gradient, ``softmax(logits) - one_hot(targets)``, is one pass over the logits and their
    log-partition ``log_z`` (the residuals): autodiff of ``logsumexp`` would keep the
    exponentials as well, a third logits-sized float32 array beside the logits and their
    gradient."""
    return _token_losses(logits.astype(jnp.float32), targets)


@jax.custom_vjp
def _token_losses(logits: jax.Array, targets: jax.Array) -> jax.Array:
    return _token_losses_fwd(logits, targets)[0]


def _is_target(logits: jax.Array, targets: jax.Array) -> jax.Array:
    # A one-hot select rather than a gather keeps the vocab dimension elementwise, so each shard
    # picks its own target logits and only a [B, S] partial sum crosses devices.
    return jnp.arange(logits.shape[-1]) == targets[..., None]


def _token_losses_fwd(logits, targets):
    log_z = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.sum(jnp.where(_is_target(logits, targets), logits, 0.0), axis=-1)
    return log_z - target_logit, (logits, targets, log_z)


def _token_losses_bwd(residuals, g):
    logits, targets, log_z = residuals
    probs = jnp.exp(logits - log_z[..., None])
    d_logits = (probs - _is_target(logits, targets).astype(jnp.float32)) * g[..., None]
    return d_logits, None  # None: integer targets have no gradient


_token_losses.defvjp(_token_losses_fwd, _token_losses_bwd)


def create_model(cfg: ModelConfig, seed: int) -> Transformer:
    """A concrete model (call under ``jax.jit`` with ``out_shardings`` to create it sharded)."""
    with nnx.use_eager_sharding(False):
        return Transformer(cfg, nnx.Rngs(params=seed))


def abstract_model(cfg: ModelConfig) -> Transformer:
    """Shapes and metadata only; no memory is allocated."""
    with nnx.use_eager_sharding(False):
        return nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(params=0)))
