"""The decoder: token embedding, a scanned stack of blocks, final norm, output projection, loss.

The blocks are made by ``nnx.vmap`` (parameters get a leading ``layers`` axis) and run by
``jax.lax.scan``, so compile time does not grow with depth. With a mixture of experts the scanned
unit is a group of ``moe.every`` blocks; ``moe.first_dense`` blocks are a second stack,
``dense_layers`` (docs/moe.md, "Keys").
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
    """Pre-norm decoder block: x + attn(norm(x)), then + ffn(norm(x)).

    ffn: SwiGLU, or with ``moe=True`` :class:`jaxpar.model.moe.MoE`. ``model.post_norms`` (Gemma): x
    + post_norm(attn(norm(x))). The residual stream is ``RESIDUAL``, the matmul inputs ``seq``
    (docs/add-a-layer.md, "4. Activations and hooks").
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
        """A branch's output normed in the residual stream's layout (``model.post_norms``)."""
        out = constrain(out, RESIDUAL)
        return getattr(self, name)(out) if hasattr(self, name) else out


class BlockGroup(nnx.Module):
    """``moe.every`` consecutive blocks, the scanned unit of a MoE model with ``every > 1``.

    The last, ``block_{every-1}``, holds the MoE layer.
    """

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.size = cfg.moe.every
        for i in range(self.size):
            setattr(self, f"block_{i}", Block(cfg, rngs, moe=i == self.size - 1))

    def __call__(self, x: jax.Array, positions: Positions) -> tuple[jax.Array, Aux]:
        for i in range(self.size):
            x, aux = getattr(self, f"block_{i}")(x, positions)
        return x, aux  # the MoE block's: the dense ones have none


def layer_units(cfg: ModelConfig) -> int:
    """Length of the ``layers`` stack: blocks, or groups of ``moe.every`` blocks.

    The ``moe.first_dense`` blocks are not counted (``dense_layers``).
    """
    if not cfg.moe.enabled:
        return cfg.n_layers
    return (cfg.n_layers - cfg.moe.first_dense) // cfg.moe.every


def dense_units(cfg: ModelConfig) -> int:
    """Length of the ``dense_layers`` stack (0: none)."""
    return cfg.moe.first_dense if cfg.moe.enabled else 0


def layer_is_local(cfg: ModelConfig) -> np.ndarray:
    """int32 [n_layers]: 1 for a layer within ``sliding_window``, 0 for a global one.

    Counting from 1, layers ``global_every``, ``2 global_every``, ... are global;
    ``global_every=0``: every layer local.
    """
    n = cfg.n_layers
    if cfg.sliding_window is None:
        return np.zeros(n, np.int32)
    if not cfg.global_every:
        return np.ones(n, np.int32)
    return (np.arange(1, n + 1) % cfg.global_every != 0).astype(np.int32)


def unit_is_local(cfg: ModelConfig, block: int = 0, stack: str = "layers") -> np.ndarray:
    """int32 [units]: :func:`layer_is_local` of block ``block`` of each unit of ``stack``.

    Layers count across both stacks: ``dense_layers`` first, then ``layers``.
    """
    flags, first = layer_is_local(cfg), dense_units(cfg)
    if stack == "dense_layers":
        return flags[:first]
    return flags[first:].reshape(layer_units(cfg), -1)[:, block]


def initial_buffers(cfg: ModelConfig, like: dict) -> dict:
    """A fresh model's buffers, shaped as the nested dict ``like`` (in layer order).

    The :class:`~jaxpar.model.layers.LocalLayer` flags; zeros elsewhere (MoE router biases).
    """
    def value(path, a):
        keys = [getattr(p, "key", p) for p in path]
        if keys[-1] != "local":
            return np.zeros(a.shape, a.dtype)
        block = next((int(k.split("_")[1]) for k in keys if str(k).startswith("block_")), 0)
        stack = "dense_layers" if "dense_layers" in keys else "layers"
        return unit_is_local(cfg, block, stack).astype(a.dtype)
    return jax.tree_util.tree_map_with_path(value, like)


def complete_buffers(cfg: ModelConfig, buffers: dict) -> dict:
    """``buffers`` plus the initial value of each buffer they lack.

    A Hugging Face import's weights-only checkpoint holds none; window flags follow the config.
    """
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
    """``units`` modules made by ``make``, stacked on a leading ``layers`` axis."""

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
    """The embedding [rows, d_model] (or head [d_model, rows]), zeros in the padding.

    The true vocabulary is drawn as without padding, so any layout gets the same values.
    """
    axis = VOCAB_AXIS[name]
    shape = [cfg.d_model, cfg.d_model]
    shape[axis] = cfg.vocab_size
    names = ("vocab", "embed") if axis == 0 else ("embed", "vocab")
    drawn = _param(rngs, tuple(shape), names, std)
    return nnx.Param(padded(drawn[...], rows, axis), out_sharding=names)


class Transformer(nnx.Module):
    """``vocab_rows``: the embedding's rows and head's columns, ``model.vocab_size`` or more.

    Padding: :meth:`jaxpar.config.Config.vocab_rows`; its logits are masked
    (:mod:`jaxpar.model.vocab`).
    """

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
        """tokens, positions: int32 [B, S] -> (float32 logits [B, S, vocab], aux of
        :meth:`run_layers`).

        ``positions`` may be a mask description (:mod:`jaxpar.model.mask`).
        """
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
        """Every unit of ``self.layers`` in order, as one ``lax.scan``: (residual stream, ``aux``).

        ``aux``: the MoE layers' float32 losses and statistics (``{}`` if dense), summed over units.
        :data:`jaxpar.model.moe.LAYER_STACKED` entries keep one row per unit: the router-bias update
        needs each layer's load. A model holding a slice of ``layers`` returns that slice's rows
        (concatenate over stages). ``dense=False``: skip ``dense_layers`` (a pipeline runs them
        first).
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
        """The residual stream after the final norm: what the head multiplies."""
        return constrain(self.final_norm(x), HIDDEN)

    def head(self, dtype=jnp.float32) -> jax.Array:
        """The output head [d_model, vocab] in ``dtype`` (the embedding's transpose if tied)."""
        return (weight(self.embedding, ("vocab", "act_embed"), dtype).T if self.cfg.tie_embeddings
                else weight(self.lm_head, ("act_embed", "vocab"), dtype))


def scan_stack(stack: nnx.Module, x: jax.Array, positions: Positions, remat: Remat | str,
               stack_id: int = 0) -> tuple[jax.Array, Aux]:
    """The units of one stacked module in order, as one ``lax.scan`` (aux stacked per unit).

    Each unit under ``remat``'s policy (:mod:`jaxpar.model.remat`). Under LoRA dropout each unit
    folds (``stack_id``, its index) into the key: every layer draws its own masks.
    """
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
    """A concrete model; call under ``jax.jit`` with ``out_shardings`` to create it sharded.

    With ``lora``'s adapters when given. ``vocab_rows`` None: unpadded.
    """
    with nnx.use_eager_sharding(False):
        model = Transformer(cfg, nnx.Rngs(params=seed), vocab_rows)
        return model if lora is None else add_adapters(model, lora, seed)


def abstract_model(cfg: ModelConfig, lora: LoraConfig | None = None, *,
                   vocab_rows: int | None = None) -> Transformer:
    """Shapes and metadata only; no memory is allocated."""
    with nnx.use_eager_sharding(False):
        return nnx.eval_shape(lambda: create_model(cfg, 0, lora, vocab_rows=vocab_rows))
