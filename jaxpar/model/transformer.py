"""The decoder: token embedding, a scanned stack of blocks, final norm, output projection, loss.

The blocks are created with ``nnx.vmap`` so each parameter gets a leading ``layers`` dimension,
and run with ``jax.lax.scan``: the traced (and compiled) program holds one block whatever the
depth, so compile time does not grow with ``n_layers``.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.config import ModelConfig
from jaxpar.model.annotate import constrain
from jaxpar.model.layers import Block, RMSNorm, _param, weight

REMAT_POLICIES: dict[str, Callable | None] = {
    "none": None,  # keep every activation
    "full": jax.checkpoint_policies.nothing_saveable,  # keep only block inputs, recompute all
    # keep the outputs of the weight matmuls (no batch dims), recompute the cheap elementwise
    # ops and the attention scores/probabilities
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embedding = _param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), 1.0)

        @nnx.split_rngs(splits=cfg.n_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make_blocks(rngs: nnx.Rngs) -> Block:
            return Block(cfg, rngs)

        self.layers = make_blocks(rngs)
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        if not cfg.tie_embeddings:
            self.lm_head = _param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"),
                                  cfg.init_std)

    def __call__(self, tokens: jax.Array, positions: jax.Array, *, dtype=jnp.float32,
                 remat: str = "none") -> jax.Array:
        """tokens, positions: int32 [B, S] -> float32 logits [B, S, vocab]."""
        x = self.embed(tokens, dtype=dtype)
        x = self.run_layers(x, positions, remat=remat)
        return self.logits(x, dtype=dtype)

    # The three pieces below are also what a pipeline stage runs: the first stage embeds, every
    # stage runs its slice of ``layers`` (a model merged with fewer stacked layers runs just
    # those), the last computes the logits.

    def embed(self, tokens: jax.Array, *, dtype=jnp.float32) -> jax.Array:
        """int32 [B, S] -> the residual stream [B, S, d_model] in ``dtype``."""
        tokens = constrain(tokens, ("batch", "seq"))
        # Vocab-parallel embedding as a one-hot matmul: each tensor shard multiplies by the rows
        # of the table it owns, and the partial sums are all-reduced (reduce-scattered over the
        # sequence under SP). A gather from a vocab-split table would instead make the compiler
        # all-gather the whole table. The one-hot costs the flops of one [B, S, V] x [V, E]
        # matmul and the memory of a logits-sized tensor, both split over the vocab shards.
        one_hot = jax.nn.one_hot(tokens, self.cfg.vocab_size, dtype=dtype)
        one_hot = constrain(one_hot, ("batch", "seq", "vocab"))
        table = weight(self.embedding, ("vocab", "act_embed"), dtype)
        x = jnp.einsum("bsv,ve->bse", one_hot, table)
        return constrain(x, ("batch", "residual_seq", "act_embed"))

    def run_layers(self, x: jax.Array, positions: jax.Array, *, remat: str = "none",
                   ) -> jax.Array:
        """Every block of ``self.layers`` in order, as one ``lax.scan``."""
        graphdef, stacked = nnx.split(self.layers)

        def one_block(x: jax.Array, layer_state) -> tuple[jax.Array, None]:
            return nnx.merge(graphdef, layer_state)(x, positions), None

        if REMAT_POLICIES[remat] is not None:
            one_block = jax.checkpoint(one_block, policy=REMAT_POLICIES[remat],
                                       prevent_cse=False)
        x, _ = jax.lax.scan(one_block, x, stacked)
        return x

    def logits(self, x: jax.Array, *, dtype=jnp.float32) -> jax.Array:
        """The residual stream -> float32 logits [B, S, vocab] (final norm, output head)."""
        x = constrain(self.final_norm(x), ("batch", "seq", "act_embed"))
        head = (weight(self.embedding, ("vocab", "act_embed"), dtype).T if self.cfg.tie_embeddings
                else weight(self.lm_head, ("act_embed", "vocab"), dtype))
        logits = jnp.einsum("bse,ev->bsv", x, head,
                            preferred_element_type=jnp.float32)
        return constrain(logits, ("batch", "seq", "vocab"))


def token_losses(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Per-token cross entropy in float32. With logits split on vocab, the max and the sum of
    exponentials each become a small all-reduce over the vocab shards (vocab-parallel loss)."""
    logits = logits.astype(jnp.float32)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    # A one-hot select rather than a gather keeps the vocab dimension elementwise, so each shard
    # picks its own target logits and only a [B, S] partial sum crosses devices.
    is_target = jnp.arange(logits.shape[-1]) == targets[..., None]
    target_logit = jnp.sum(jnp.where(is_target, logits, 0.0), axis=-1)
    return log_z - target_logit


def create_model(cfg: ModelConfig, seed: int) -> Transformer:
    """A concrete model (call under ``jax.jit`` with ``out_shardings`` to create it sharded)."""
    with nnx.use_eager_sharding(False):
        return Transformer(cfg, nnx.Rngs(params=seed))


def abstract_model(cfg: ModelConfig) -> Transformer:
    """Shapes and metadata only; no memory is allocated."""
    with nnx.use_eager_sharding(False):
        return nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(params=0)))
