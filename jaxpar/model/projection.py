"""How layers multiply by their weights: :func:`weight`, :func:`project`, :func:`project_all`,
:func:`lookup`.

They turn a parameter as stored (float32, ``embed`` split over ``fsdp``) into the weight a matmul
reads (compute dtype, gathered), with a reduce-scatter backward. Why every weight must come through
here: docs/add-a-layer.md, "3. The projection helpers".
"""

from __future__ import annotations

from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.model.annotate import (
    constrain,
    current_layout,
    gather_weight,
    relayout,
)

RESIDUAL = ("residual_batch", "residual_seq", "act_embed")  # between blocks
MATMUL_INPUT = ("batch", "seq", "act_embed")  # entering the column-parallel matmuls


def weight(param: nnx.Param, names: tuple[str, ...], dtype) -> jax.Array:
    """A weight as a layer multiplies with it: in the compute dtype, laid out as ``names``.

    ``act_embed`` in ``names`` is the stored ``embed``, whole: FSDP's per-layer all-gather, written
    down so the compiler never moves activations instead. Its gradient is a reduce-scatter over
    ``fsdp``.
    """
    return _used_weight(param[...], names, dtype)


def summed_grad_dtype(dtype) -> jnp.dtype:
    """The dtype of a layer's weight gradients: the layout's ``weight_grad_dtype`` where wider than
    ``dtype``.
    """
    grad_dtype = current_layout().weight_grad_dtype
    wider = grad_dtype is not None and jnp.dtype(grad_dtype).itemsize > jnp.dtype(dtype).itemsize
    return jnp.dtype(grad_dtype if wider else dtype)


def _used_weight(w: jax.Array, names: tuple[str, ...], dtype) -> jax.Array:
    if current_layout().weights_prepared:
        return w
    return relayout(w.astype(dtype), _stored_names(names), names)


# A weight's dimension as a matmul reads it (whole) -> as stored (split over fsdp under ZeRO-3):
# the model dimension, and the latent dimension of MLA's up-projections (jaxpar/model/mla.py).
STORED_NAMES = {"act_embed": "embed", "act_q_lora_in": "q_lora_in",
                "act_kv_lora_in": "kv_lora_in"}
USED_NAMES = {stored: used for used, stored in STORED_NAMES.items()}


def _stored_names(names: tuple) -> tuple:
    return tuple(STORED_NAMES.get(name, name) for name in names)


class Projection(NamedTuple):
    """One weight matmul ``einsum(spec, x, weight)``, the weight laid out as ``names``.

    Several ``params`` of one shape are stacked on ``spec``'s letter ``t`` (not in ``names``): one
    matmul.
    """

    spec: str
    params: tuple[nnx.Param, ...]
    names: tuple[str, ...]


class Rebuild(NamedTuple):
    """How a matmul's backward pass rebuilds its input ``x``: ``fn(*kept)`` (``fn`` hashable)."""

    fn: Any
    kept: tuple


def _matmul_input(s: jax.Array) -> jax.Array:
    return constrain(s, MATMUL_INPUT)


def sequence_slice(x: jax.Array) -> Rebuild:
    """Keep each device's sequence slice of ``x``; gather it again backward (Megatron-SP).

    For a matmul input that no norm made.
    """
    return Rebuild(_matmul_input, (constrain(x, RESIDUAL),))


def project(spec: str, x: jax.Array, param: nnx.Param, names: tuple[str, ...], *,
            x_from: Rebuild | None = None) -> jax.Array:
    """:func:`project_all` of one projection: ``einsum(spec, x, weight)`` in ``x``'s dtype."""
    return project_all(x, (Projection(spec, (param,), tuple(names)),), x_from=x_from)[0]


def project_all(x: jax.Array, projections: tuple[Projection, ...], *,
                x_from: Rebuild | None = None) -> tuple[jax.Array, ...]:
    """Every projection of the same ``x`` (q, k, v; gate, up), in ``x``'s dtype, in order.

    One custom VJP fixes five things autodiff gets wrong at scale: docs/add-a-layer.md, "What the
    projection VJP fixes". In a pipeline stage (the layout's ``weights_prepared``) each parameter
    is its own matmul: stacking would stash a copy per slot.
    """
    if current_layout().weights_prepared:
        return tuple(_matmul(p.spec.replace("t", ""), None, x, param[...])
                     for p in projections for param in p.params)
    parts = tuple(_Part.of(p) for p in projections)
    ws = tuple(param[...] for p in projections for param in p.params)
    how = _ProjectVJP(parts, current_layout().reshard_after_forward, summed_grad_dtype(x.dtype),
                      ws[0].dtype, x_from.fn if x_from is not None else None)
    ys = _project(how, x, x_from.kept if x_from is not None else None, *ws)
    return tuple(out for part, y in zip(parts, ys, strict=True) for out in part.unstacked(y))


class _Part(NamedTuple):
    """A :class:`Projection` as the VJP sees it (hashable)."""

    spec: str
    names: tuple  # the weight's layout as used (None on the stacking axis)
    at: int | None  # the weights' stacking axis; None: one weight
    count: int

    @classmethod
    def of(cls, p: Projection) -> _Part:
        if len(p.params) == 1:
            return cls(p.spec, tuple(p.names), None, 1)
        at = p.spec.split("->")[0].split(",")[1].index("t")
        return cls(p.spec, (*p.names[:at], None, *p.names[at:]), at, len(p.params))

    def operand_names(self) -> tuple[tuple, tuple]:
        """The logical layouts of ``x`` and the output, per letter.

        ``b`` and ``s``: the tokens'; every other letter its weight dimension's name.
        """
        inputs, out = self.spec.split("->")
        x_spec, w_spec = inputs.split(",")
        name = {"b": "batch", "s": "seq", **dict(zip(w_spec, self.names, strict=True))}
        return tuple(name[c] for c in x_spec), tuple(name[c] for c in out)

    def unstacked(self, y: jax.Array) -> tuple[jax.Array, ...]:
        if self.at is None:
            return (y,)
        axis = self.spec.split("->")[1].index("t")
        # split (not indexing): its transpose is one concatenate, where slices' are pads and adds
        return tuple(jnp.squeeze(part, axis) for part in jnp.split(y, self.count, axis=axis))


def _per_part(parts: tuple[_Part, ...], ws: tuple) -> list[tuple]:
    out, i = [], 0
    for part in parts:
        out.append(ws[i:i + part.count])
        i += part.count
    return out


def _stacked(ws: tuple[jax.Array, ...], at: int | None) -> jax.Array:
    return ws[0] if at is None else jnp.stack(ws, axis=at)


class _ProjectVJP(NamedTuple):
    """The static part of :func:`project_all`'s custom VJP."""

    parts: tuple[_Part, ...]
    regather: bool  # keep the stored shards, not the used weights, for the backward pass
    grad_dtype: Any  # the dtype of the weight gradients and of their sums
    stored_dtype: Any  # the parameters' (train.param_dtype)
    rebuild: Any  # keep its arguments, not x, and rebuild x from them (None: keep x)


def _gathered(w: jax.Array, names: tuple, dtype) -> jax.Array:
    return gather_weight(w.astype(dtype), _stored_names(names), names)


def _used_weights(how: _ProjectVJP, ws: tuple, dtype) -> list[jax.Array]:
    return [_gathered(_stacked(w, part.at), part.names, dtype)
            for part, w in zip(how.parts, _per_part(how.parts, ws), strict=True)]


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _project(how: _ProjectVJP, x: jax.Array, x_kept: tuple | None, *ws: jax.Array,
             ) -> tuple[jax.Array, ...]:
    return tuple(jnp.einsum(part.spec, x, wg)
                 for part, wg in zip(how.parts, _used_weights(how, ws, x.dtype), strict=True))


def _project_fwd(how, x, x_kept, *ws):
    wgs = _used_weights(how, ws, x.dtype)
    ys = tuple(jnp.einsum(part.spec, x, wg) for part, wg in zip(how.parts, wgs, strict=True))
    return ys, (x_kept if how.rebuild else x, ws if how.regather else tuple(wgs))


def _project_bwd(how, residuals, dys):
    x_or_kept, w_kept = residuals
    x = how.rebuild(*x_or_kept) if how.rebuild else x_or_kept
    wgs = _used_weights(how, w_kept, x.dtype) if how.regather else w_kept
    dx, dws = None, []
    for part, wg, dy in zip(how.parts, wgs, dys, strict=True):
        # x and dy as the forward pass laid them out, so that the weight gradient contracts
        # each device's own tokens (then a reduce-scatter to the weight's layout): left free,
        # the partitioner may gather a whole operand over the batch axes instead (Megatron-SP
        # at 64 x 4096 tokens: the whole f32[64, 4096, 4096] residual stream per matmul).
        x_names, y_names = part.operand_names()
        dx_part, dw = _matmul_grads(part.spec, None, constrain(x, x_names), wg,
                                    constrain(dy, y_names), how.grad_dtype)
        dx = dx_part if dx is None else dx + dx_part
        dw = constrain(dw.astype(how.stored_dtype), _stored_names(part.names))
        if part.at is None:
            dws.append(dw)
        else:
            dws.extend(jnp.squeeze(d, part.at) for d in jnp.split(dw, part.count, axis=part.at))
    # what rebuilds x only stands in for it: the gradient flows through x
    d_kept = jax.tree.map(jnp.zeros_like, x_or_kept) if how.rebuild else None
    return dx, d_kept, *dws


_project.defvjp(_project_fwd, _project_bwd)


def float32_logits(h: jax.Array, head: jax.Array) -> jax.Array:
    """The loss's float32 logits ``einsum("bse,ev->bsv", h, head)``, backward by
    :func:`_matmul_grads`.
    """
    return _matmul("bse,ev->bsv", jnp.float32, h, head)


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _matmul(spec: str, out_dtype, x: jax.Array, w: jax.Array) -> jax.Array:
    """``einsum(spec, x, w)`` accumulated in ``out_dtype`` (None: the inputs'), backward by
    :func:`_matmul_grads`.

    Its residuals are ``x`` and ``w`` as passed, so the pipeline's stash does not copy the weight.
    """
    return jnp.einsum(spec, x, w, preferred_element_type=out_dtype)


def _matmul_fwd(spec, out_dtype, x, w):
    return _matmul(spec, out_dtype, x, w), (x, w)


def _matmul_bwd(spec, out_dtype, residuals, dy):
    x, w = residuals
    dx, dw = _matmul_grads(spec, out_dtype, x, w, dy, jnp.promote_types(w.dtype, dy.dtype))
    return dx.astype(x.dtype), dw.astype(w.dtype)


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


def _matmul_grads(spec: str, out_dtype, x: jax.Array, w: jax.Array, dy: jax.Array, grad_dtype,
                  ) -> tuple[jax.Array, jax.Array]:
    """(dx, dw) of ``einsum(spec, x, w)``; dw is its own matmul ``x^T dy`` in ``grad_dtype``.

    Why: docs/add-a-layer.md, "What the projection VJP fixes".
    """
    (dx,) = jax.linear_transpose(
        lambda x_: jnp.einsum(spec, x_, w, preferred_element_type=out_dtype), x)(dy)
    inputs, out = spec.split("->")
    x_spec, w_spec = inputs.split(",")
    return dx, jnp.einsum(f"{x_spec},{out}->{w_spec}", x, dy, preferred_element_type=grad_dtype)


def lookup(tokens: jax.Array, param: nnx.Param, names: tuple[str, ...], dtype,
           pieces: int = 1, *, vocab_shards: int = 1) -> jax.Array:
    """Rows of the table ``param`` [vocab, d_model] for int ``tokens``, in ``dtype``: the embedding.

    Forward: a gather (vocab-parallel: per owner, summed over shards). Backward: the one-hot
    matmul's weight gradient, in ``pieces`` slices of the vocabulary, in ``parallel.reduce_dtype``
    where wider. Why: docs/attention-and-loss.md, "The embedding".
    """
    w = param[...]
    stored = _stored_names(tuple(names))
    how = _LookupVJP(tuple(names), stored, w.shape[0], pieces, vocab_shards, jnp.dtype(dtype),
                     summed_grad_dtype(dtype), w.dtype)
    return _lookup(how, tokens, w)


class _LookupVJP(NamedTuple):
    """The static part of :func:`lookup`'s custom VJP."""

    names: tuple  # the table's layout as used
    stored: tuple  # ... and as stored
    vocab_size: int
    pieces: int  # slices of the vocabulary the gradient is built in, one after another
    vocab_shards: int  # devices the table's rows are split over (1: whole)
    dtype: Any  # the rows' (the compute dtype)
    grad_dtype: Any
    stored_dtype: Any


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _lookup(how: _LookupVJP, tokens: jax.Array, w: jax.Array) -> jax.Array:
    table = _gathered(w, how.names, how.dtype)
    if how.vocab_shards == 1:
        return jnp.take(table, tokens, axis=0)
    return _rows_by_owner(how, table, tokens)


def _rows_by_owner(how: _LookupVJP, table: jax.Array, tokens: jax.Array) -> jax.Array:
    """The vocab-parallel gather: the table as ``[shards, V/shards, E]``, rows by owner."""
    rows = how.vocab_size // how.vocab_shards
    owner, local_id = jnp.divmod(tokens, rows)
    blocks = table.reshape(how.vocab_shards, rows, table.shape[-1])
    return owned_rows(blocks, owner, local_id, how.names[-1])


def owned_rows(blocks: jax.Array, owner: jax.Array, local_id: jax.Array,
               embed_name: str = "act_embed") -> jax.Array:
    """Rows of a table split into ``blocks`` [k, rows, E]: token t's is ``blocks[owner[t],
    local_id[t]]``.

    Zeros where ``owner`` is -1. The sum over blocks, ``[tokens, E]``, is the one collective.
    """
    blocks = constrain(blocks, ("vocab", None, embed_name))
    gathered = jax.vmap(lambda block: jnp.take(block, local_id, axis=0))(blocks)
    gathered = constrain(gathered, ("vocab", "batch", "seq", embed_name))
    mine = owner[None] == jnp.arange(blocks.shape[0], dtype=owner.dtype)[:, None, None]
    return jnp.sum(jnp.where(mine[..., None], gathered, 0), axis=0)


def _lookup_fwd(how, tokens, w):
    return _lookup(how, tokens, w), tokens


def _lookup_bwd(how, tokens, dy):
    # Ids past the vocab pad the last slice (they match no token).
    rows = -(-how.vocab_size // how.pieces) * how.pieces
    dy = constrain(dy, ("batch", "seq", how.names[-1]))  # each device's tokens (see _project_bwd)
    dw = one_hot_weight_grad(jnp.arange(rows, dtype=tokens.dtype), tokens, dy, how.pieces,
                             how.grad_dtype, how.stored)[:how.vocab_size]
    return None, constrain(dw.astype(how.stored_dtype), how.stored)  # None: ints have none


def one_hot_weight_grad(row_ids: jax.Array, tokens: jax.Array, dy: jax.Array, pieces: int,
                        grad_dtype: Any, names: tuple | None = None) -> jax.Array:
    """``one_hot(tokens)^T dy`` [R, E] for rows ``row_ids`` [R], in ``grad_dtype``.

    Built in ``pieces`` strided slices (rows k, k + n, ...), each laid out as ``names`` at once, so
    no whole unreduced [R, E] gradient exists.
    """
    n = pieces

    def slice_grad(ids: jax.Array) -> jax.Array:
        one_hot = constrain((ids[:, None, None] == tokens[None]).astype(dy.dtype),
                            ("vocab", "batch", "seq"))
        dw = jnp.einsum("vbs,bse->ve", one_hot, dy, preferred_element_type=grad_dtype)
        return dw if names is None else constrain(dw, names)

    if n == 1:
        return slice_grad(row_ids)
    per_slice = row_ids.reshape(-1, n).T  # [n, R/n]: slice k is row_ids[k::n]
    dw = jax.lax.map(slice_grad, per_slice)  # [n, R/n, E] -> [R/n, n, E]: row r n + k
    return jnp.moveaxis(dw, 0, 1).reshape(row_ids.shape[0], -1)


_lookup.defvjp(_lookup_fwd, _lookup_bwd)


def add_bias(y: jax.Array, param: nnx.Param, names: tuple[str, ...]) -> jax.Array:
    """``y`` plus the bias ``param`` (laid out as ``names``), in ``y``'s dtype.

    Its gradient sums over tokens in :func:`summed_grad_dtype`, not bf16.
    """
    b = param[...]
    if current_layout().weights_prepared:
        return y + b
    return _add_bias(_BiasVJP(tuple(names), summed_grad_dtype(y.dtype), b.dtype), y, b)


class _BiasVJP(NamedTuple):
    """The static part of :func:`add_bias`'s custom VJP."""

    names: tuple
    grad_dtype: Any
    stored_dtype: Any


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _add_bias(how: _BiasVJP, y: jax.Array, b: jax.Array) -> jax.Array:
    return y + _used_weight(b, how.names, y.dtype)


def _add_bias_fwd(how, y, b):
    return _add_bias(how, y, b), None


def _add_bias_bwd(how, _, dy):
    tokens = tuple(range(dy.ndim - len(how.names)))
    db = jnp.sum(dy, axis=tokens, dtype=how.grad_dtype)
    return dy, constrain(db.astype(how.stored_dtype), _stored_names(how.names))


_add_bias.defvjp(_add_bias_fwd, _add_bias_bwd)
