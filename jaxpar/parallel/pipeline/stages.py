"""What a pipeline stage computes: the model cut into chunks, and the vocabulary cut into pieces.

Every stage runs the same program (:mod:`jaxpar.parallel.pipeline.executor`), so the embedding and
the output head cannot live on the first and last stage alone: the vocabulary is cut into one piece
per stage, and every stage embeds and scores its piece, the pieces combined over ``pipe``. The
head's weights and work are split ``p`` ways, not repeated.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from jaxpar.config import Config
from jaxpar.model.annotate import layout_with
from jaxpar.model.edges import Edges
from jaxpar.model.layers import RMSNorm, prepare_weight, prepared_weight_grad
from jaxpar.model.loss import joined_pieces, sequence_pieces
from jaxpar.model.moe import LAYER_STACKED, moe_loss
from jaxpar.model.projection import owned_rows
from jaxpar.model.remat import Remat
from jaxpar.parallel.rules import logical_rules
from jaxpar.platform import FLOAT32_STAGE_SUM_PLATFORMS

PIPE_AXIS = "pipe"

# --------------------------------------------------------------------------------------------
# What a stage computes


@dataclass(frozen=True)
class Stages:
    """The model, cut for the executor (``mb``: one microbatch's arrays).

    ``layers(shared, layers, consts, x, mb) -> (y, aux)`` runs one chunk's layers (``shared``:
    the parameters outside the stack; ``consts``: the chunk's slice of non-trained per-layer
    state, the MoE router biases); ``final_norm(shared, x)``
    the norm before the head. ``aux`` (``{}`` for a dense model) holds the chunk's MoE
    statistics, summed over its layers except the ``layer_stacked`` keys, one row per layer;
    ``aux_loss(aux)`` is the term it adds to the objective. ``vocab_shards``: how many ways the
    axes of ``vocab`` other than ``pipe`` split the vocabulary. ``layers`` reads weights as
    ``prepare`` left them (cast to the compute dtype, FSDP-gathered), so the residuals a
    forward saves hold the very arrays passed in, which the stash leaves out.
    """

    layers: Callable
    final_norm: Callable
    prepare: Callable  # chunks [v, layers/v, ...] -> cast and laid out for use, once per step
    unprepare: Callable  # one chunk's gradient w.r.t. its prepared weights -> stored layout
    dtype: Any
    edges: Edges  # the model's own embedding scale, head and loss (jaxpar/model/edges.py)
    vocab_shards: int
    aux_loss: Callable = lambda aux: jnp.zeros((), jnp.float32)  # noqa: E731
    layer_stacked: tuple[str, ...] = ()
    loss_pieces: int = 1  # the head runs over this many pieces of the sequence, one at a time
    # The dtype of the sums over ``pipe`` that hand one stage's value to all (the others add
    # zeros: exact in any dtype): None keeps the value's (the compute dtype); float32 on
    # XLA:CPU, which aborts on this program's bf16 all-reduces (FLOAT32_STAGE_SUM_PLATFORMS).
    handover_dtype: Any = None
    embedding_grad_pieces: int = 1  # ... the embedding's gradient over this many vocab slices
    # Chunk 0's inputs come in with the microbatches (``x0``: the embedding and the dense
    # first blocks, run before the pipeline) and their gradients go back out.
    pre_embedded: bool = False


class VocabPiece(NamedTuple):
    """Stage ``s``'s piece of the vocabulary: ``ids`` [V/p] (global token ids, in the order
    of the piece) and ``rows``, how to cut a ``[V, ...]`` array into pieces."""

    ids: jax.Array
    stage: jax.Array
    shards: int
    p: int

    def cut(self, table: jax.Array) -> jax.Array:
        """``table`` [V, ...] -> this stage's rows [V/p, ...]. Each of the ``shards`` blocks that
        already split V (over ``tensor``) gives its own sub-block, so no row leaves its device."""
        v = table.shape[0]
        blocks = table.reshape(self.shards, self.p, v // (self.shards * self.p),
                               *table.shape[1:])
        piece = lax.dynamic_index_in_dim(blocks, self.stage, axis=1, keepdims=False)
        return piece.reshape(v // self.p, *table.shape[1:])

    def added(self, total: jax.Array, piece: jax.Array, axis: int = 0) -> jax.Array:
        """``total + uncut(piece)`` along ``axis`` (the vocabulary's), without building
        ``uncut(piece)``: the piece's rows of ``total`` updated in place. A gradient sum over
        the vocabulary ``[V/t, E]`` in float32 is 1 GiB per device at Llama-3-70B's ``tensor=4``;
        the zeros around a piece added to it were a second such buffer at the TPU compiler's
        peak."""
        v = total.shape[axis]
        shape = (*total.shape[:axis], self.shards, self.p, v // (self.shards * self.p),
                 *total.shape[axis + 1:])
        blocks = total.reshape(shape)
        rows = lax.dynamic_index_in_dim(blocks, self.stage, axis=axis + 1, keepdims=True)
        more = piece.reshape(rows.shape).astype(total.dtype)
        return lax.dynamic_update_index_in_dim(blocks, rows + more, self.stage,
                                               axis=axis + 1).reshape(total.shape)

    def uncut(self, piece: jax.Array) -> jax.Array:
        """The inverse of :meth:`cut`, zeros elsewhere: [V/p, ...] -> [V, ...]."""
        v = piece.shape[0] * self.p
        blocks = jnp.zeros((self.shards, self.p, v // (self.shards * self.p),
                            *piece.shape[1:]), piece.dtype)
        blocks = lax.dynamic_update_index_in_dim(
            blocks, piece.reshape(self.shards, 1, -1, *piece.shape[1:]), self.stage, axis=1)
        return blocks.reshape(v, *piece.shape[1:])


class Residuals:
    """The forward's VJP as data: which of its leaves are the chunk's own weights (taken from
    the weights again at the backward) and which must wait in the stash.

    ``jax.vjp`` returns a pytree whose leaves are the saved residuals; a weight used as it is
    appears among them as the very array passed in. Keeping those out of the stash means a
    stashed microbatch costs its activations only, not a copy of the stage's weights.
    """

    def __init__(self):
        self.layout: tuple | None = None  # (treedef, [leaf -> weight index or None])

    def split(self, vjp_fn: Callable, weights: list) -> list:
        leaves, treedef = jax.tree.flatten(vjp_fn)
        which = tuple(next((i for i, w in enumerate(weights) if leaf is w), None)
                      for leaf in leaves)
        shapes = tuple((leaf.shape, leaf.dtype) for leaf in leaves)
        if self.layout is None:
            # The first trace's pullback serves every later one: its function is a jaxpr of
            # the residuals alone, and every trace of the same chunk saves the same leaves.
            self.layout = (treedef, which, shapes)
        elif self.layout[1:] != (which, shapes):
            raise AssertionError("the forward's residuals changed between traces")
        return [leaf for leaf, w in zip(leaves, which, strict=True) if w is None]

    def join(self, stashed: list, weights: list) -> Callable:
        treedef, which, _ = self.layout
        stashed = iter(stashed)
        return jax.tree.unflatten(treedef, [next(stashed) if w is None else weights[w]
                                            for w in which])


def sum_over_stages(x: jax.Array, dtype: Any = None) -> jax.Array:
    """``psum`` over ``pipe`` in ``dtype`` (None: ``x``'s), returned in ``x``'s dtype."""
    return lax.psum(x.astype(dtype or x.dtype), PIPE_AXIS).astype(x.dtype)


def vocab_piece(vocab_rows: int, shards: int, p: int, stage: jax.Array) -> VocabPiece:
    """Stage ``stage``'s piece of a vocabulary of ``vocab_rows`` (padded) ids."""
    block = vocab_rows // (shards * p)
    ids = (jnp.arange(shards)[:, None] * (vocab_rows // shards) + stage * block
           + jnp.arange(block)[None, :]).reshape(-1)
    return VocabPiece(ids.astype(jnp.int32), stage, shards, p)


def embed_partial(stages: Stages, table: jax.Array, piece: VocabPiece, tokens: jax.Array,
                  ) -> jax.Array:
    """This stage's share of the embeddings of ``tokens``: the rows of those in its vocab piece
    (``table``: its rows), zeros for the others; the stages' shares add up over ``pipe``. A
    gather, from each ``tensor`` block's own rows where those split the piece."""
    v = piece.ids.shape[0] * piece.p
    block = v // (piece.shards * piece.p)
    shard, within = jnp.divmod(tokens, v // piece.shards)
    stage, local_id = jnp.divmod(within, block)
    owner = jnp.where(stage == piece.stage, shard, -1)
    rows = owned_rows(table.astype(stages.dtype).reshape(piece.shards, block, -1), owner,
                      local_id)
    # Each token's row is on one stage (zeros elsewhere): scaled before the sum, it is rounded
    # as the model's own lookup rounds it.
    return stages.edges.scaled(rows)


def head_and_loss(stages: Stages, shared: dict, head: jax.Array, piece: VocabPiece,
                  y: jax.Array, mb: dict, loss_scale: jax.Array) -> tuple:
    """Summed token loss of output ``y`` (the same on every stage), its gradient w.r.t. ``y``,
    and this stage's head-piece and final-norm gradients, with ``loss_scale`` per token.

    The sequence goes through the head in ``stages.loss_pieces`` strided pieces, one after
    another (a ``lax.scan``, as ``train.loss_pieces`` does without a pipeline): only one
    piece's float32 logits ``[B, S/n, V/p]`` and their gradient exist at a time.
    """
    h, norm_vjp = jax.vjp(stages.final_norm, shared, y)
    n = stages.loss_pieces
    if n == 1:
        loss, d_head, d_h = stages.edges.piece_loss(head, piece.ids, h, mb["targets"],
                                                    mb["mask"], loss_scale, PIPE_AXIS)
    else:
        def one_piece(carry: tuple, xs: tuple) -> tuple:
            loss_i, d_head_i, d_h_i = stages.edges.piece_loss(head, piece.ids, *xs,
                                                              loss_scale, PIPE_AXIS)
            return (carry[0] + loss_i, carry[1] + d_head_i), d_h_i

        zeros = (jnp.zeros((), jnp.float32), jnp.zeros(head.shape, jnp.float32))
        (loss, d_head), d_h = lax.scan(one_piece, zeros, tuple(
            sequence_pieces(a, n) for a in (h, mb["targets"], mb["mask"])))
        d_h, d_head = joined_pieces(d_h), d_head.astype(head.dtype)
    # The pieces' contributions to d_h all differ from zero: summed in float32, without bf16
    # round-off.
    d_shared, d_y = norm_vjp(sum_over_stages(d_h, jnp.float32).astype(h.dtype))
    return loss, d_y, d_head, d_shared


# --------------------------------------------------------------------------------------------
# The model cut into chunks


def _matching(axes: dict, tree: dict) -> dict:
    """The part of ``axes`` with ``tree``'s keys: under LoRA a stage prepares its adapters and
    its frozen weights apart (:class:`jaxpar.parallel.pipeline.executor.Frozen`)."""
    return {k: _matching(axes[k], sub) if isinstance(sub, dict) else axes[k]
            for k, sub in tree.items()}


def model_stages(graphdef: Any, cfg: Config, layer_axes: dict, *, dtype: Any, remat: Remat,
                 platform: str = "cpu", dense_stand_in: Any = None) -> Stages:
    """The model's pieces as the executor calls them (see :class:`Stages`); ``layer_axes``:
    the logical names of the stacked layer parameters (``layers`` first). ``dense_stand_in``:
    with dense first blocks (run before the pipeline, not by the stages), stand-in leaves for
    the ``dense_layers`` parameters, which the stages' model holds but never reads."""
    pre = {} if dense_stand_in is None else {"dense_layers": dense_stand_in}

    def layers(shared: dict, layer_params: dict, consts: dict, x: jax.Array, mb: dict,
               ) -> tuple:
        net = nnx.merge(graphdef, {**shared, **pre, "layers": layer_params},
                        {"layers": consts} if consts else {})
        with layout_with(weights_prepared=True):
            return net.run_layers(x, mb["positions"], remat=remat, dense=not pre)

    def by_leaf(fn: Callable, tree: Any, leading: int) -> Any:
        """``fn(leaf, name, names)`` over the layer tree, ``names`` its stored logical names with
        the stacked dimension(s) left unnamed (``pipe`` is manual inside the executor)."""
        return jax.tree_util.tree_map_with_path(
            lambda path, leaf, names: fn(leaf, path[-1].key, (None,) * leading + names[1:]),
            tree, _matching(layer_axes, tree), is_leaf=lambda x: isinstance(x, tuple))

    def prepare(chunks: Any) -> Any:
        return by_leaf(lambda a, name, names: prepare_weight(a, name, names, dtype), chunks, 2)

    def unprepare(grads: Any) -> Any:
        return by_leaf(lambda g, _, names: prepared_weight_grad(g, names), grads, 1)

    def final_norm(norm_params: dict, x: jax.Array) -> jax.Array:
        return nnx.merge(norm_graph, norm_params["final_norm"])(x)

    with nnx.use_eager_sharding(False):
        norm_graph = nnx.graphdef(nnx.eval_shape(
            lambda: RMSNorm(cfg.model.d_model, cfg.model.norm_eps)))
    rules, mesh_shape = logical_rules(cfg), cfg.mesh_shape
    moe = cfg.model.moe
    shards = int(np.prod([mesh_shape[a] for a in rules["vocab"] if a != PIPE_AXIS]))
    return Stages(layers, final_norm, prepare, unprepare, dtype,
                  Edges(cfg.model, cfg.vocab_rows()), shards,
                  aux_loss=lambda aux: moe_loss(aux, moe),
                  layer_stacked=LAYER_STACKED if moe.enabled else (),
                  loss_pieces=cfg.loss_pieces(),
                  embedding_grad_pieces=cfg.embedding_grad_pieces(),
                  pre_embedded=bool(pre),
                  handover_dtype=(jnp.float32 if platform in FLOAT32_STAGE_SUM_PLATFORMS
                                  else None))
