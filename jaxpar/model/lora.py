"""Low-rank adapters (LoRA, ``train.lora``): ``x W + (alpha / r) (x A) B`` for each target.

``A [in, r]`` and ``B [r, out]`` (zero at first) sit beside each targeted weight of the stacked
layers. :func:`add_adapters` adds them as :class:`Adapter` modules named ``lora_<target>``. Which
parameters train is read from their path (:func:`is_adapter`). The rules, dropout and tests:
docs/lora.md.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.config.schema import LoraConfig
from jaxpar.model.annotate import constrain, current_layout
from jaxpar.model.projection import USED_NAMES, weight

# target -> (the weight it adapts, its module attribute, einsum letters of the input's
# contracted axes, of the output's feature axes); the input is [b, s, *in], the output
# [b, s, *out].
TARGETS = {
    "q": ("attn", "wq", "e", "hd"),
    "k": ("attn", "wk", "e", "kd"),
    "v": ("attn", "wv", "e", "kd"),
    "o": ("attn", "wo", "hd", "e"),
    "gate": ("mlp", "w_gate", "e", "f"),
    "up": ("mlp", "w_up", "e", "f"),
    "down": ("mlp", "w_down", "f", "e"),
    # latent attention (jaxpar/model/mla.py); "c" a latent (q_lora or kv_lora, with kv_a's rope
    # key dims)
    "q_a": ("attn", "wq_a", "e", "c"),
    "q_b": ("attn", "wq_b", "c", "hd"),
    "kv_a": ("attn", "wkv_a", "e", "c"),
    "kv_b": ("attn", "wkv_b", "c", "hd"),
}
PREFIX = "lora_"
FEED_FORWARD = ("gate", "up", "down")  # in a MoE layer: its routed experts' weights


def is_adapter(name: str) -> bool:
    """Whether the parameter named ``name`` ("layers/attn/lora_q/a") is an adapter."""
    return any(part.startswith(PREFIX) for part in name.split("/"))


def _used(names: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(USED_NAMES.get(name, name) for name in names)


class Adapter(nnx.Module):
    """``A`` and ``B`` of one targeted weight, stacked over ``units`` layers.

    ``lead=1``: a MoE layer's experts, an axis both share.
    """

    def __init__(self, w: nnx.Param, n_in: int, rank: int, scale: float, key: jax.Array,
                 salt: int = 0, lead: int = 0):
        names = tuple(w.get_metadata()["out_sharding"])  # ("layers", *lead, *in, *out)
        shape = w.get_value().shape
        cut = 1 + lead + n_in
        lead_names, in_names, out_names = names[1:1 + lead], names[1 + lead:cut], names[cut:]
        lead_shape, in_shape, out_shape = shape[1:1 + lead], shape[1 + lead:cut], shape[cut:]
        fan_in = 1
        for d in in_shape:
            fan_in *= d
        bound = fan_in ** -0.5  # PEFT's kaiming-uniform(a=sqrt(5)) bound
        a = jax.random.uniform(key, (shape[0], *lead_shape, *in_shape, rank), jnp.float32,
                               -bound, bound)
        self.a_stored = (*lead_names, *in_names, "lora_rank")  # per layer, as stored
        self.b_stored = (*lead_names, "lora_rank", *out_names)
        self.a = nnx.Param(a, out_sharding=("layers", *self.a_stored))
        self.b = nnx.Param(jnp.zeros((shape[0], *lead_shape, rank, *out_shape), jnp.float32),
                           out_sharding=("layers", *self.b_stored))
        self.scale = scale
        self.salt = salt  # tells this adapter's dropout mask from the other adapters' of a layer
        self.a_names = _used((*in_names, "lora_rank"))
        self.b_names = _used(("lora_rank", *out_names))

    def __call__(self, x: jax.Array, ins: str, outs: str) -> jax.Array:
        """``scale (x A) B`` for ``x [b, s, *ins]``: ``[b, s, *outs]`` in ``x``'s dtype."""
        a = weight(self.a, self.a_names, x.dtype)
        b = weight(self.b, self.b_names, x.dtype)
        x = dropped_out(x, self.salt)
        h = constrain(jnp.einsum(f"bs{ins},{ins}r->bsr", x, a), ("batch", "seq", "lora_rank"))
        return jnp.einsum(f"bsr,r{outs}->bs{outs}", h, b) * jnp.asarray(self.scale, x.dtype)


def dropout_key(lora: LoraConfig, seed: int, step: jax.Array) -> jax.Array | None:
    """The key of a train step's dropout masks; None without dropout.

    Only the train step's gradient installs it.
    """
    if lora.rank == 0 or lora.dropout == 0:
        return None
    return jax.random.fold_in(jax.random.key(seed + 2), step)


def dropped_out(x: jax.Array, salt: int) -> jax.Array:
    """``x`` [b, s, *in] with LoRA dropout where the train step installed it, else ``x``.

    Each token's mask is the same on every layout (docs/lora.md, "Dropout").
    """
    active = current_layout().lora_dropout
    if active is None:
        return x
    key, rate, tokens = active
    if tokens is None or tokens.shape != x.shape[:2]:
        raise ValueError(f"LoRA dropout: token ids {None if tokens is None else tokens.shape} "
                         f"for an input of shape {x.shape}")
    key = jax.random.fold_in(key, salt)

    def one_token(number: jax.Array) -> jax.Array:
        return jax.random.bernoulli(jax.random.fold_in(key, number), 1.0 - rate, x.shape[2:])

    keep = jax.vmap(jax.vmap(one_token))(tokens)
    return jnp.where(keep, x / jnp.asarray(1.0 - rate, x.dtype), jnp.zeros((), x.dtype))


def with_dropout_tokens(batch: dict, lora: LoraConfig) -> dict:
    """``batch`` plus ``lora_tokens``, each token's global number, when ``lora`` drops out."""
    if lora.rank == 0 or lora.dropout == 0:
        return batch
    order = getattr(batch["positions"], "order", batch["positions"])
    rows, seq = order.shape
    return dict(batch, lora_tokens=jnp.arange(rows, dtype=jnp.int32)[:, None] * seq + order)


def adapted(module: nnx.Module, target: str, x: jax.Array, out: jax.Array) -> jax.Array:
    """``out`` (the base projection of ``x``) plus the target's adapter, if any."""
    adapter = getattr(module, PREFIX + target, None)
    if adapter is None:
        return out
    _, _, ins, outs = TARGETS[target]
    return out + adapter(x, ins, outs)


def _blocks(model: nnx.Module) -> list[nnx.Module]:
    """Every stacked block of ``model``: ``layers`` (or its ``block_<i>``), then ``dense_layers``.
    """
    out = []
    for name in ("layers", "dense_layers"):
        stack = getattr(model, name, None)
        if stack is None:
            continue
        size = getattr(stack, "size", 0) if hasattr(stack, "block_0") else 0
        out.extend([getattr(stack, f"block_{i}") for i in range(size)] if size else [stack])
    return out


def _owners(block: nnx.Module, target: str) -> list[tuple[nnx.Module, int]]:
    """The modules of ``block`` holding ``target``'s weight, each with its leading axes.

    1: a MoE layer's ``experts``.
    """
    part = TARGETS[target][0]
    if part != "mlp" or hasattr(block, "mlp"):
        return [(getattr(block, part), 0)]
    shared = getattr(block.moe, "shared", None)
    return [(block.moe, 1)] + ([(shared, 0)] if shared is not None else [])


def add_adapters(model: nnx.Module, lora: LoraConfig, seed: int) -> nnx.Module:
    """``model`` with an adapter beside each targeted weight; unchanged when ``lora.rank`` is 0."""
    if lora.rank == 0:
        return model
    key = jax.random.key(seed + 1)
    for j, block in enumerate(_blocks(model)):
        for i, target in enumerate(lora.targets):
            _, attr, ins, _ = TARGETS[target]
            for n, (owner, lead) in enumerate(_owners(block, target)):
                # The first block's first owner keeps the key a dense model's adapters had.
                k = jax.random.fold_in(key, i)
                k = k if j == n == 0 else jax.random.fold_in(jax.random.fold_in(k, j), n)
                setattr(owner, PREFIX + target,
                        Adapter(getattr(owner, attr), len(ins), lora.rank,
                                lora.alpha / lora.rank, k, salt=(j * 4 + n) * 16 + i,
                                lead=lead))
    return model


def _select(tree: dict, keep: bool, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            sub = _select(value, keep, name + "/")
            if sub:
                out[key] = sub
        elif is_adapter(name) == keep:
            out[key] = value
    return out


def adapter_part(tree: dict) -> dict:
    """The adapters' leaves of a nested dict shaped like the parameters (any leaf type)."""
    return _select(tree, True)


def base_part(tree: dict) -> dict:
    """Every other leaf of such a dict: the frozen base weights."""
    return _select(tree, False)


def merged(a: dict, b: dict) -> dict:
    """Two disjoint nested dicts as one (:func:`adapter_part` and :func:`base_part` back)."""
    out = dict(a)
    for key, value in b.items():
        out[key] = merged(out[key], value) if key in out else value
    return out


def for_gradients(params: dict, buffers: Any, adapted: bool) -> tuple[dict, Any]:
    """(what is differentiated, what rides along). ``adapted`` (LoRA): the adapters, and
    (``buffers``, the frozen base weights), so no gradient of the base is computed or summed."""
    return (adapter_part(params), (buffers, base_part(params))) if adapted else (params, buffers)


def riding_apart(riding: Any, adapted: bool) -> tuple[Any, dict]:
    """What :func:`for_gradients` set riding along, as (buffers, frozen base weights)."""
    return riding if adapted else (riding, {})


def from_gradients(params: dict, riding: Any, adapted: bool) -> tuple[dict, Any]:
    """The inverse of :func:`for_gradients`: the whole parameters and the buffers."""
    buffers, frozen = riding_apart(riding, adapted)
    return merged(params, frozen), buffers


def merged_weights(params: dict, lora: LoraConfig) -> dict:
    """``params`` (host arrays) with each target's ``W + (alpha / r) A B`` and no adapters.

    float32. The adapted model as plain parameters (``jaxpar export --format hf``).
    """
    if lora.rank == 0:
        return params
    out = base_part(params)
    _merge_into(params, out, np.float32(lora.alpha / lora.rank))
    return out


def _merge_into(node: dict, out: dict, scale: np.float32) -> None:
    """Each adapter of ``node`` merged into its weight in ``out``, in every sub-module."""
    for key, value in node.items():
        if key.startswith(PREFIX):
            _, attr, ins, outs = TARGETS[key[len(PREFIX):]]
            lead = "x" if "router" in node else ""  # a MoE layer's experts
            a, b = (np.asarray(value[k], np.float32) for k in ("a", "b"))
            delta = np.einsum(f"l{lead}{ins}r,l{lead}r{outs}->l{lead}{ins}{outs}", a, b)
            out[attr] = np.asarray(out[attr], np.float32) + scale * delta
        elif isinstance(value, dict) and key in out:
            _merge_into(value, out[key], scale)
