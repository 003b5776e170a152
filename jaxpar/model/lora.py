"""Low-rank adapters (LoRA, ``train.lora``): beside each targeted weight ``W`` of the stacked
layers, ``A [in, r]`` and ``B [r, out]``, and the projection computes
``x W + (alpha / r) (x A) B``. ``B`` starts at zero, so the adapted model starts as the base.

The adapters are added to a built model (:func:`add_adapters`) as :class:`Adapter` modules named
``lora_<target>`` beside the weight (``layers/attn/lora_q/a``), stacked over the layers like it.
Their logical axes are the weight's: ``A`` takes the weight's input axes and ``lora_rank``
(never split), ``B`` takes ``lora_rank`` and the weight's output axes, so the rules table splits
them as it splits the weight. Which parameters train is read from their path
(:func:`is_adapter`); the train step differentiates those only (jaxpar/train/step.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.config.schema import LoraConfig
from jaxpar.model.annotate import constrain
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


def is_adapter(name: str) -> bool:
    """Whether the parameter named ``name`` ("layers/attn/lora_q/a") is an adapter."""
    return any(part.startswith(PREFIX) for part in name.split("/"))


def _used(names: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(USED_NAMES.get(name, name) for name in names)


class Adapter(nnx.Module):
    """``A`` and ``B`` of one targeted weight, stacked over ``units`` layers."""

    def __init__(self, w: nnx.Param, n_in: int, rank: int, scale: float, key: jax.Array):
        names = tuple(w.get_metadata()["out_sharding"])  # ("layers", *in, *out)
        shape = w.get_value().shape
        in_names, out_names = names[1:1 + n_in], names[1 + n_in:]
        in_shape, out_shape = shape[1:1 + n_in], shape[1 + n_in:]
        fan_in = 1
        for d in in_shape:
            fan_in *= d
        bound = fan_in ** -0.5  # PEFT's kaiming-uniform(a=sqrt(5)) bound
        a = jax.random.uniform(key, (shape[0], *in_shape, rank), jnp.float32, -bound, bound)
        self.a = nnx.Param(a, out_sharding=("layers", *in_names, "lora_rank"))
        self.b = nnx.Param(jnp.zeros((shape[0], rank, *out_shape), jnp.float32),
                           out_sharding=("layers", "lora_rank", *out_names))
        self.scale = scale
        self.a_names = _used((*in_names, "lora_rank"))
        self.b_names = _used(("lora_rank", *out_names))

    def __call__(self, x: jax.Array, ins: str, outs: str) -> jax.Array:
        """``scale (x A) B`` for ``x [b, s, *ins]``: ``[b, s, *outs]`` in ``x``'s dtype."""
        a = weight(self.a, self.a_names, x.dtype)
        b = weight(self.b, self.b_names, x.dtype)
        h = constrain(jnp.einsum(f"bs{ins},{ins}r->bsr", x, a), ("batch", "seq", "lora_rank"))
        return jnp.einsum(f"bsr,r{outs}->bs{outs}", h, b) * jnp.asarray(self.scale, x.dtype)


def adapted(module: nnx.Module, target: str, x: jax.Array, out: jax.Array) -> jax.Array:
    """``out`` (the base projection of ``x``) plus the target's adapter, if it has one."""
    adapter = getattr(module, PREFIX + target, None)
    if adapter is None:
        return out
    _, _, ins, outs = TARGETS[target]
    return out + adapter(x, ins, outs)


def add_adapters(model: nnx.Module, lora: LoraConfig, seed: int) -> nnx.Module:
    """``model`` (a :class:`jaxpar.model.transformer.Transformer`) with an adapter beside each
    targeted weight of its stacked dense blocks; the same model when ``lora.rank`` is 0."""
    if lora.rank == 0:
        return model
    key = jax.random.key(seed + 1)
    for i, target in enumerate(lora.targets):
        part, attr, ins, _ = TARGETS[target]
        owner = getattr(model.layers, part)
        w = getattr(owner, attr)
        setattr(owner, PREFIX + target,
                Adapter(w, len(ins), lora.rank, lora.alpha / lora.rank,
                        jax.random.fold_in(key, i)))
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


def merged_weights(params: dict, lora: LoraConfig) -> dict:
    """``params`` (host arrays, as a checkpoint holds them) with each targeted weight replaced
    by ``W + (alpha / r) A B`` and the adapters left out: the model the adapters make, as a
    plain model's parameters (``jaxpar export --format hf``). Computed in float32."""
    if lora.rank == 0:
        return params
    out = base_part(params)
    for target in lora.targets:
        part, attr, ins, outs = TARGETS[target]
        adapter = params["layers"][part][PREFIX + target]
        a, b = (np.asarray(adapter[k], np.float32) for k in ("a", "b"))
        w = np.asarray(out["layers"][part][attr], np.float32)
        delta = np.einsum(f"l{ins}r,lr{outs}->l{ins}{outs}", a, b)
        out["layers"][part][attr] = w + np.float32(lora.alpha / lora.rank) * delta
    return out
