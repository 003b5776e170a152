"""Hooks through which parallelism reaches the model, without the model knowing any mesh.

The model calls :func:`constrain` with logical names; by default that does nothing, so the model
runs unsharded on one device. The train step installs what the layout needs
(:mod:`jaxpar.parallel.hooks`): activation constraints, attention over ``context``
(:func:`attention_override`), the experts' dispatch (:func:`experts_override`), the sum of the
loss's per-shard head gradient (:func:`sum_over_token_shards`), sums over tokens split by hand
(:func:`sum_over_hand_split`) and LoRA dropout (:func:`lora_dropout_key`). These are the only global
state the model reads, and they live only for the duration of a trace.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import partial
from types import MappingProxyType
from typing import Any

import jax

Constrain = Callable[[jax.Array, Sequence[str | None]], jax.Array]
# attention(q [B,S,H,D], k [B,S,K,D], v [B,S,K,D], positions [B,S]) -> [B,S,H,D]
Attention = Callable[[jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]

# experts(x [B,S,E], expert_ids [B,S,k], gates [B,S,k], (w_gate, w_up, w_down), *, dispatch,
#         capacity_factor) -> (y [B,S,E], stats); see jaxpar.model.moe.local_experts
Experts = Callable[..., tuple[jax.Array, dict]]

_constrain: contextvars.ContextVar[Constrain | None] = contextvars.ContextVar(
    "jaxpar_activation_constrain", default=None)
_attention: contextvars.ContextVar[Attention | None] = contextvars.ContextVar(
    "jaxpar_attention", default=None)
_latent_cache: contextvars.ContextVar[Callable | None] = contextvars.ContextVar(
    "jaxpar_latent_cache", default=None)
_experts: contextvars.ContextVar[Experts | None] = contextvars.ContextVar(
    "jaxpar_experts", default=None)
_prepared: contextvars.ContextVar[bool] = contextvars.ContextVar("jaxpar_prepared_weights",
                                                                 default=False)
_reshard: contextvars.ContextVar[bool] = contextvars.ContextVar("jaxpar_reshard_after_forward",
                                                                default=False)
_grad_dtype: contextvars.ContextVar[Any] = contextvars.ContextVar("jaxpar_weight_grad_dtype",
                                                                 default=None)
_token_sum: contextvars.ContextVar[Callable | None] = contextvars.ContextVar(
    "jaxpar_token_shard_sum", default=None)
_split: contextvars.ContextVar[Mapping[str, int]] = contextvars.ContextVar(
    "jaxpar_split_counts", default=MappingProxyType({}))
_hand_split: contextvars.ContextVar[tuple[Callable, int] | None] = contextvars.ContextVar(
    "jaxpar_hand_split_tokens", default=None)
# (key, rate, token ids [B, S] or None), see lora_dropout_key
_lora_dropout: contextvars.ContextVar[tuple | None] = contextvars.ContextVar(
    "jaxpar_lora_dropout", default=None)


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Annotate ``x`` (one logical name per dimension) with the active activation layout."""
    if len(names) != x.ndim:
        raise ValueError(f"constrain: {len(names)} names {tuple(names)} for an array of shape "
                         f"{x.shape}")
    fn = _constrain.get()
    return x if fn is None else fn(x, names)


def gather_weight(w: jax.Array, stored: Sequence[str | None], used: Sequence[str | None]
                  ) -> jax.Array:
    """``w`` from its stored layout to the one a matmul reads (FSDP's gather): the active
    constrainer's ``gather`` where it has one, else a constraint to ``used``."""
    fn = _constrain.get()
    gather = getattr(fn, "gather", None)
    return gather(w, stored, used) if gather is not None else constrain(w, used)


@contextlib.contextmanager
def _setting(var: contextvars.ContextVar, value) -> Iterator[None]:
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


def activation_sharding(fn: Constrain | None) -> contextlib.AbstractContextManager[None]:
    """Within this block, :func:`constrain` applies ``fn``."""
    return _setting(_constrain, fn)


def latent_cache_override() -> Callable | None:
    """The cache multi-head latent attention reads and writes while decoding, if any."""
    return _latent_cache.get()


def use_latent_cache(fn: Callable | None) -> contextlib.AbstractContextManager[None]:
    return _setting(_latent_cache, fn)


def attention_override() -> Attention | None:
    """The attention implementation the active parallel layout wants, if not the dense one."""
    return _attention.get()


def use_attention(fn: Attention | None) -> contextlib.AbstractContextManager[None]:
    """Within this block, the model's attention layers call ``fn``."""
    return _setting(_attention, fn)


def experts_override() -> Experts | None:
    """The expert dispatch the active parallel layout wants, if not the single-device one."""
    return _experts.get()


def use_experts(fn: Experts | None) -> contextlib.AbstractContextManager[None]:
    """Within this block, the model's MoE layers send their tokens to experts through ``fn``."""
    return _setting(_experts, fn)


def sum_over_token_shards(partial_sums: jax.Array, used: Sequence[str | None],
                          stored: Sequence[str | None]) -> jax.Array:
    """``partial_sums`` [batch shards, sequence shards, ...] (one partial sum of a weight
    gradient per token shard) summed over both shard dimensions and laid out as ``stored``. By
    default a sum and a constraint; the layout may install an explicit one
    (:func:`use_token_shard_sum`)."""
    fn = _token_sum.get()
    if fn is not None:
        return fn(partial_sums, tuple(used), tuple(stored))
    return constrain(jax.numpy.sum(partial_sums, axis=(0, 1)), stored)


def use_token_shard_sum(fn: Callable | None) -> contextlib.AbstractContextManager[None]:
    """Within this block, :func:`sum_over_token_shards` calls ``fn(partial_sums, used,
    stored)``."""
    return _setting(_token_sum, fn)


def hand_split_devices() -> int:
    """Over how many devices the micro-batch's tokens are split by hand (1: none), as inside a
    pipeline stage (:mod:`jaxpar.parallel.manual`), where a layer sees its own tokens alone."""
    hand = _hand_split.get()
    return 1 if hand is None else hand[1]


def sum_over_hand_split(x: jax.Array) -> jax.Array:
    """``x`` summed over the devices that split the tokens by hand. Forward statistics only: no
    gradient passes back."""
    hand = _hand_split.get()
    return x if hand is None else hand[0](jax.lax.stop_gradient(x))


def use_hand_split(sum_fn: Callable[[jax.Array], jax.Array], devices: int,
                   ) -> contextlib.AbstractContextManager[None]:
    """Within this block the tokens are split by hand over ``devices``, summed by ``sum_fn``."""
    return _setting(_hand_split, (sum_fn, devices) if devices > 1 else None)


def weights_prepared() -> bool:
    """Whether the layer's parameters were already cast and laid out for use
    (:func:`jaxpar.model.layers.prepare_weight`)."""
    return _prepared.get()


def use_prepared_weights() -> contextlib.AbstractContextManager[None]:
    """Within this block layers read their weights as given (a pipeline stage prepares them once
    per step, so its stash holds no copy of them)."""
    return _setting(_prepared, True)


def resharding_after_forward() -> bool:
    """Whether layers must not keep their used (cast, gathered) weights for the backward pass."""
    return _reshard.get()


def reshard_after_forward(on: bool) -> contextlib.AbstractContextManager[None]:
    """Within this block layers keep only their stored weights for the backward pass (where
    nothing else recomputes the used ones: ``remat=none``)."""
    return _setting(_reshard, on)


def weight_grad_dtype() -> Any:
    """The dtype layers produce their weight gradients in; None: their compute dtype."""
    return _grad_dtype.get()


def weight_grads_in(dtype: Any) -> contextlib.AbstractContextManager[None]:
    """Within this block layers produce weight gradients in ``dtype``. The compiler sums a weight
    gradient in the dtype of the matmul that makes it, so this is how ``parallel.reduce_dtype``
    reaches the sums jaxpar does not take by hand."""
    return _setting(_grad_dtype, dtype)


def split_count(name: str) -> int:
    """Over how many devices the layout splits the logical dimension ``name`` (1: not split)."""
    return _split.get().get(name, 1)


def is_split(name: str) -> bool:
    """Whether the active layout splits the logical dimension ``name`` over devices."""
    return split_count(name) > 1


def splitting(counts: Mapping[str, int]) -> contextlib.AbstractContextManager[None]:
    """Within this block, :func:`split_count` reads ``counts`` (logical name -> devices)."""
    return _setting(_split, MappingProxyType(dict(counts)))


def relayout(x: jax.Array, src: Sequence[str | None], dst: Sequence[str | None]) -> jax.Array:
    """Move ``x`` from layout ``src`` to ``dst``, and its gradient from ``dst`` back to ``src``.

    A plain :func:`constrain` to ``dst`` would pin the gradient to ``dst`` too. Where the forward
    gathers a split dimension (Megatron-SP's all-gather of the sequence), the gradient must go
    straight back to ``src``: one reduce-scatter instead of an all-reduce and a slice.
    """
    return _relayout(x, tuple(src), tuple(dst))


@partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _relayout(x: jax.Array, src: tuple, dst: tuple) -> jax.Array:
    return constrain(x, dst)


def _relayout_fwd(x, src, dst):
    return constrain(x, dst), None


def _relayout_bwd(src, dst, _, grad):  # noqa: ARG001
    return (constrain(grad, src),)


_relayout.defvjp(_relayout_fwd, _relayout_bwd)


def lora_dropout_key() -> tuple[jax.Array, float, jax.Array | None] | None:
    """(key, rate, token ids) of LoRA dropout for the layer being traced, or None. The ids ([B,
    S], each token's global number) travel with the batch, so a token's mask does not depend on
    where it is computed (:func:`jaxpar.model.lora.dropped_out`)."""
    return _lora_dropout.get()


def use_lora_dropout(key: jax.Array | None, rate: float, tokens: jax.Array | None = None
                     ) -> contextlib.AbstractContextManager[None]:
    """Within this block LoRA adapters drop their input out at ``rate``, with masks from ``key``
    and the tokens' ids; None or rate 0: none."""
    return _setting(_lora_dropout, (key, rate, tokens) if key is not None and rate > 0 else None)


def lora_dropout_tokens(tokens: jax.Array | None) -> contextlib.AbstractContextManager[None]:
    """Within this block LoRA dropout masks the tokens numbered ``tokens`` (this micro-step's and
    device's)."""
    active = _lora_dropout.get()
    if active is None or tokens is None:
        return contextlib.nullcontext()
    return _setting(_lora_dropout, (active[0], active[1], tokens))
