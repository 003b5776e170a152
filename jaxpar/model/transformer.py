"""The decoder: token embedding, a scanned stack of blocks, final norm, output projection, loss.

The blocks are created with ``nnx.vmap`` (each parameter gets a leading ``layers`` dimension)
and run with ``jax.lax.scan``, so compile time does not grow with ``n_layers``. With a
mixture of experts the scanned unit is a *group* of ``moe.every`` blocks, the last one MoE
(``layers/moe/...``, or ``layers/block_0/mlp/...``, ``layers/block_1/moe/...``); DeepSeek's
``moe.first_dense`` blocks are a second stack, ``dense_layers``, scanned first
(docs/moe.md).
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.config import LoraConfig, ModelConfig
from jaxpar.model.annotate import (
    constrain,
    current_layout,
    layout_with,
    split_count,
)
from jaxpar.model.edges import Edges
from jaxpar.model.layers import Attention, RMSNorm, SwiGLU, _param
from jaxpar.model.lora import add_adapters
from jaxpar.model.loss import HIDDEN
from jaxpar.model.mask import Positions
from jaxpar.model.mla import MLA
from jaxpar.model.moe import LAYER_STACKED, MoE
from jaxpar.model.projection import RESIDUAL, lookup, weight
from jaxpar.model.remat import ATTENTION_BRANCH, Remat, named, rematted
from jaxpar.model.vocab import VOCAB_AXIS, padded

Aux = dict[str, jax.Array]  # float32 statistics and losses of the MoE layers ({} when dense)

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


class Block(nnx.Module):
    """Pre-norm decoder block: x + attn(norm(x)), then + ffn(norm(x)), where ffn is the SwiGLU
    MLP, or with ``moe=True`` a mixture of experts (:class:`jaxpar.model.moe.MoE`). With
    ``model.post_norms`` (Gemma's "sandwich"), each branch's output is normed too before the
    add: x + post_norm(attn(norm(x))).

    Between blocks the residual stream is laid out as ``RESIDUAL`` (its tokens split over
    ``tensor`` too under sequence parallelism); the matmul inputs are laid out as ``seq``. The
    change of layout is where the compiler puts the all-gather (entering) and reduce-scatter
    (leaving) of Megatron-SP, or, without SP, the all-reduce of the row-parallel output.
    """

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, moe: bool = False):
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = MLA(cfg, rngs) if cfg.mla.enabled else Attention(cfg, rngs)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        if moe:
            self.moe = MoE(cfg, rngs)
        else:
            self.mlp = SwiGLU(cfg, rngs)
        if cfg.post_norms:
            self.attn_post_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
            self.mlp_post_norm = RMSNorm(cfg.d_model, cfg.norm_eps)

    def __call__(self, x: jax.Array, positions: Positions) -> tuple[jax.Array, Aux]:
        h, h_from = self.attn_norm.for_matmul(x)
        branch = self._post_norm("attn_post_norm", self.attn(h, positions, h_from))
        x = x + named(ATTENTION_BRANCH, branch)[0]
        h, h_from = self.mlp_norm.for_matmul(x)
        if hasattr(self, "moe"):
            out, aux = self.moe(h)
        else:
            out, aux = self.mlp(h, h_from), {}
        return x + self._post_norm("mlp_post_norm", out), aux

    def _post_norm(self, name: str, out: jax.Array) -> jax.Array:
        """A branch's output in the residual stream's layout, normed there (where sequence
        parallelism splits its tokens) under ``model.post_norms``."""
        out = constrain(out, RESIDUAL)
        return getattr(self, name)(out) if hasattr(self, name) else out


class BlockGroup(nnx.Module):
    """``moe.every`` consecutive blocks, the scanned unit of a MoE model with ``every > 1``:
    ``block_0`` .. ``block_{every-2}`` dense, ``block_{every-1}`` with the MoE layer."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.size = cfg.moe.every
        for i in range(self.size):
            setattr(self, f"block_{i}", Block(cfg, rngs, moe=i == self.size - 1))

    def __call__(self, x: jax.Array, positions: Positions) -> tuple[jax.Array, Aux]:
        for i in range(self.size):
            x, aux = getattr(self, f"block_{i}")(x, positions)
        return x, aux  # the MoE block's: the dense ones have none


def layer_units(cfg: ModelConfig) -> int:
    """Length of the stacked ``layers`` dimension: blocks, or groups of ``moe.every`` blocks
    (after the ``moe.first_dense`` blocks of ``dense_layers``)."""
    if not cfg.moe.enabled:
        return cfg.n_layers
    return (cfg.n_layers - cfg.moe.first_dense) // cfg.moe.every


def dense_units(cfg: ModelConfig) -> int:
    """Length of the ``dense_layers`` stack: the dense blocks before the mixtures (0: none)."""
    return cfg.moe.first_dense if cfg.moe.enabled else 0


def layer_is_local(cfg: ModelConfig) -> np.ndarray:
    """int32 [n_layers]: 1 for a layer that attends within ``sliding_window``, 0 for a global
    one. Counting from 1, layers ``global_every``, ``2 global_every``, ... are global (Gemma 2:
    every 2nd, Gemma 3: every 6th); ``global_every=0``: every layer local (Mistral)."""
    n = cfg.n_layers
    if cfg.sliding_window is None:
        return np.zeros(n, np.int32)
    if not cfg.global_every:
        return np.ones(n, np.int32)
    return (np.arange(1, n + 1) % cfg.global_every != 0).astype(np.int32)


def unit_is_local(cfg: ModelConfig, block: int = 0, stack: str = "layers") -> np.ndarray:
    """int32 [units]: :func:`layer_is_local` of block ``block`` of every scanned unit of
    ``stack``. The layers are counted across both stacks: the ``dense_layers`` (DeepSeek's
    first dense blocks) are the model's first layers, ``layers`` the rest."""
    flags, first = layer_is_local(cfg), dense_units(cfg)
    if stack == "dense_layers":
        return flags[:first]
    return flags[first:].reshape(layer_units(cfg), -1)[:, block]


def initial_buffers(cfg: ModelConfig, like: dict) -> dict:
    """The model's buffers as a fresh model holds them, for the nested dict ``like`` (their
    shapes and dtypes, e.g. a train state's abstract buffers, in the model's layer order):
    the layers' :class:`~jaxpar.model.layers.LocalLayer` flags, zeros elsewhere (MoE router
    biases)."""
    def value(path, a):
        keys = [getattr(p, "key", p) for p in path]
        if keys[-1] != "local":
            return np.zeros(a.shape, a.dtype)
        block = next((int(k.split("_")[1]) for k in keys if str(k).startswith("block_")), 0)
        stack = "dense_layers" if "dense_layers" in keys else "layers"
        return unit_is_local(cfg, block, stack).astype(a.dtype)
    return jax.tree_util.tree_map_with_path(value, like)


def complete_buffers(cfg: ModelConfig, buffers: dict) -> dict:
    """``buffers`` plus the initial value of each buffer they lack: a weights-only checkpoint
    of a Hugging Face import holds parameters only, and the window flags follow the config."""
    _, _, abstract = nnx.split(abstract_model(cfg), nnx.Param, ...)

    def merged(fresh, given):
        if not isinstance(fresh, dict):
            return given if given is not None else fresh
        given = given or {}
        return {**given, **{k: merged(v, given.get(k)) for k, v in fresh.items()}}
    return merged(initial_buffers(cfg, nnx.to_pure_dict(abstract)), buffers)


def _make_unit(cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.Module:
    if not cfg.moe.enabled:
        return Block(cfg, rngs)
    return Block(cfg, rngs, moe=True) if cfg.moe.every == 1 else BlockGroup(cfg, rngs)


def _stack(units: int, make: Callable[[nnx.Rngs], nnx.Module], rngs: nnx.Rngs) -> nnx.Module:
    """``units`` modules made by ``make``, each parameter stacked on a leading ``layers`` axis."""

    @nnx.split_rngs(splits=units)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def make_stack(rngs: nnx.Rngs) -> nnx.Module:
        return make(rngs)

    return make_stack(rngs)


def _set_local_flags(model: nnx.Module, cfg: ModelConfig) -> None:
    """Each attention's :class:`~jaxpar.model.layers.LocalLayer` flags, in both stacks."""
    stacks = [("layers", model.layers)]
    if hasattr(model, "dense_layers"):
        stacks.append(("dense_layers", model.dense_layers))
    for name, stack in stacks:
        blocks = ([stack] if not isinstance(stack, BlockGroup) else
                  [getattr(stack, f"block_{i}") for i in range(stack.size)])
        for i, block in enumerate(blocks):
            block.attn.local.set_value(jnp.asarray(unit_is_local(cfg, i, name)))
            # nnx.vmap names the stacked axis only of variables with axis names (a scalar has
            # none), so the flags name it themselves.
            block.attn.local.set_metadata(out_sharding=("layers",))


def _vocab_param(rngs: nnx.Rngs, cfg: ModelConfig, rows: int, name: str, std: float
                 ) -> nnx.Param:
    """The embedding [rows, d_model] (or the head [d_model, rows]): the true vocabulary drawn
    as without padding (the same values whatever the layout pads), zeros in the padding
    (:mod:`jaxpar.model.vocab`)."""
    axis = VOCAB_AXIS[name]
    shape = [cfg.d_model, cfg.d_model]
    shape[axis] = cfg.vocab_size
    names = ("vocab", "embed") if axis == 0 else ("embed", "vocab")
    drawn = _param(rngs, tuple(shape), names, std)
    return nnx.Param(padded(drawn[...], rows, axis), out_sharding=names)


class Transformer(nnx.Module):
    """``vocab_rows``: the embedding's rows and the head's columns, ``model.vocab_size`` or more
    (:meth:`jaxpar.config.Config.vocab_rows` pads for a layout); the padding's logits are
    masked (:mod:`jaxpar.model.vocab`)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, vocab_rows: int | None = None):
        self.cfg = cfg
        rows = cfg.vocab_size if vocab_rows is None else vocab_rows
        self.embedding = _vocab_param(rngs, cfg, rows, "embedding", 1.0)

        self.layers = _stack(layer_units(cfg), lambda r: _make_unit(cfg, r), rngs)
        if dense_units(cfg):
            self.dense_layers = _stack(dense_units(cfg), lambda r: Block(cfg, r), rngs)
        if cfg.sliding_window is not None:
            _set_local_flags(self, cfg)
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        if not cfg.tie_embeddings:
            self.lm_head = _vocab_param(rngs, cfg, rows, "lm_head", cfg.init_std)

    def __call__(self, tokens: jax.Array, positions: Positions, *, dtype=jnp.float32,
                 remat: Remat | str = "none") -> tuple[jax.Array, Aux]:
        """tokens, positions: int32 [B, S] (or positions as a mask description of packed
        documents, :mod:`jaxpar.model.mask`) -> (float32 logits [B, S, vocab], aux of
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
        return constrain(self.edges.scaled(x), RESIDUAL)

    def run_layers(self, x: jax.Array, positions: Positions, *, remat: Remat | str = "none",
                   dense: bool = True) -> tuple[jax.Array, Aux]:
        """Every unit of ``self.layers`` in order, as one ``lax.scan``.

        Returns the residual stream and ``aux``, the MoE layers' float32 losses and statistics
        (``{}`` for a dense model): each entry summed over the units, except those in
        :data:`jaxpar.model.moe.LAYER_STACKED` (``layer_expert_tokens`` [units, experts]),
        which keep one row per unit, in stack order, because the router-bias update needs each
        layer's own load. (A model merged with a slice of ``layers`` returns that slice's rows:
        concatenate them over pipeline stages; add everything else.) ``dense=False`` leaves out
        ``dense_layers`` (a pipeline runs them before its stages:
        :mod:`jaxpar.parallel.pipeline.executor`).
        """
        if dense and hasattr(self, "dense_layers"):
            x, _ = scan_stack(self.dense_layers, x, positions, remat, stack_id=1)
        x, per_unit = scan_stack(self.layers, x, positions, remat)
        aux = {k: v if k in LAYER_STACKED else jnp.sum(v, axis=0) for k, v in per_unit.items()}
        return x, aux

    def logits(self, x: jax.Array, *, dtype=jnp.float32) -> jax.Array:
        """The residual stream -> float32 logits [B, S, vocab rows] (final norm, output head,
        ``model.final_softcap``, the padded vocabulary's columns at ``-inf``)."""
        return self.edges.logits(self.final_hidden(x), self.head(dtype))

    @property
    def edges(self) -> Edges:
        """The model's ends as functions of arrays (:mod:`jaxpar.model.edges`)."""
        return Edges(self.cfg, self.embedding.shape[0])

    def final_hidden(self, x: jax.Array) -> jax.Array:
        """The residual stream after the final norm: what the output head multiplies."""
        return constrain(self.final_norm(x), HIDDEN)

    def head(self, dtype=jnp.float32) -> jax.Array:
        """The output head [d_model, vocab] in ``dtype`` (the embedding's transpose if tied)."""
        return (weight(self.embedding, ("vocab", "act_embed"), dtype).T if self.cfg.tie_embeddings
                else weight(self.lm_head, ("act_embed", "vocab"), dtype))


def scan_stack(stack: nnx.Module, x: jax.Array, positions: Positions, remat: Remat | str,
               stack_id: int = 0) -> tuple[jax.Array, Aux]:
    """The units of one stacked module in order, as one ``lax.scan`` (aux stacked per unit),
    each under ``remat``'s policy, or with ``remat.every = k`` one in every k
    (:mod:`jaxpar.model.remat`: the scan then runs groups of k units). Under LoRA dropout each
    unit's adapters get the step's key folded with (``stack_id``, the unit's index), so that
    every layer draws its own masks."""
    remat = Remat.of(remat)
    graphdef, stacked = nnx.split(stack)
    dropout = current_layout().lora_dropout
    units = jax.tree.leaves(stacked)[0].shape[0]

    def one_unit(x: jax.Array, scanned) -> tuple[jax.Array, Aux]:
        if dropout is None:
            return nnx.merge(graphdef, scanned)(x, positions)
        layer_state, index = scanned
        key = jax.random.fold_in(jax.random.fold_in(dropout[0], stack_id), index)
        with layout_with(lora_dropout=(key, *dropout[1:])):
            return nnx.merge(graphdef, layer_state)(x, positions)

    if dropout is not None:  # each unit's index rides along, for its key
        stacked = (stacked, jnp.arange(units, dtype=jnp.int32))
    if remat.every == 1:
        # Without remat nothing would gather a layer's weights again for its backward pass.
        with layout_with(reshard_after_forward=remat.policy == "none"):
            return jax.lax.scan(rematted(one_unit, remat.policy), x, stacked)
    k, first = remat.every, rematted(one_unit, remat.policy)

    def one_group(x: jax.Array, group) -> tuple[jax.Array, Aux]:
        per_unit = []
        for i in range(k):
            with layout_with(reshard_after_forward=i > 0):  # the units that keep everything
                unit = jax.tree.map(operator.itemgetter(i), group)
                x, aux = (first if i == 0 else one_unit)(x, unit)
            per_unit.append(aux)
        return x, jax.tree.map(lambda *a: jnp.stack(a), *per_unit)

    groups = jax.tree.map(lambda a: a.reshape(units // k, k, *a.shape[1:]), stacked)
    x, aux = jax.lax.scan(one_group, x, groups)
    return x, jax.tree.map(lambda a: a.reshape(units, *a.shape[2:]), aux)


def create_model(cfg: ModelConfig, seed: int, lora: LoraConfig | None = None, *,
                 vocab_rows: int | None = None) -> Transformer:
    """A concrete model (call under ``jax.jit`` with ``out_shardings`` to create it sharded),
    with ``lora``'s adapters (:mod:`jaxpar.model.lora`) when given, its vocabulary padded to
    ``vocab_rows`` (None: unpadded; a layout's: ``Config.vocab_rows()``)."""
    with nnx.use_eager_sharding(False):
        model = Transformer(cfg, nnx.Rngs(params=seed), vocab_rows)
        return model if lora is None else add_adapters(model, lora, seed)


def abstract_model(cfg: ModelConfig, lora: LoraConfig | None = None, *,
                   vocab_rows: int | None = None) -> Transformer:
    """Shapes and metadata only; no memory is allocated."""
    with nnx.use_eager_sharding(False):
        return nnx.eval_shape(lambda: create_model(cfg, 0, lora, vocab_rows=vocab_rows))
