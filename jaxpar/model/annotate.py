"""The one object through which parallelism reaches the model, without the model knowing any mesh.

The model names logical axes and reads the active :class:`Layout`: by default one device's (every
hook off), so the model runs unsharded. The train step installs the layout its mesh needs
(:func:`jaxpar.parallel.hooks.model_layout`) once per traced function, with :func:`installed`;
a few fields change for a block with :func:`layout_with` (a scan's remat, a stage's prepared
weights, decoding's cache). This one ``ContextVar`` is the only global state the model reads, and
it lives only for the duration of a trace.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
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


@dataclasses.dataclass(frozen=True)
class Layout:
    """What the model knows of the layout it runs under; each default is one device's."""

    # x, logical names -> x laid out; its optional ``gather(w, stored, used)`` is FSDP's.
    constrain: Constrain | None = None
    # Attention when not the dense one: over ``context``, a kernel, or decoding's KV cache.
    attention: Attention | None = None
    # Multi-head latent attention's decode cache (jaxpar.model.kv_cache).
    latent_cache: Callable | None = None
    # The MoE layers' dispatch to experts on other devices (jaxpar.parallel.expert).
    experts: Experts | None = None
    # Logical name -> over how many devices the layout splits it.
    split_counts: Mapping[str, int] = dataclasses.field(
        default_factory=lambda: MappingProxyType({}))
    # (partial sums [batch shards, seq shards, ...], used, stored) -> the summed weight
    # gradient; None: a sum and a constraint.
    token_shard_sum: Callable | None = None
    # (sum over the devices that split the tokens by hand, their number): a pipeline stage's.
    hand_split: tuple[Callable, int] | None = None
    # The dtype layers make weight gradients in (parallel.reduce_dtype); None: compute dtype.
    weight_grad_dtype: Any = None
    # Weights arrive cast and laid out already (a pipeline stage prepares them once per step).
    weights_prepared: bool = False
    # Layers keep only their stored weights for the backward pass (nothing recomputes them).
    reshard_after_forward: bool = False
    # LoRA dropout: (key, rate, token ids [B, S] or None); None: off.
    lora_dropout: tuple | None = None

    def describe(self) -> str:
        """One line per field: its value, callables by name."""
        def shown(value: Any) -> str:
            if callable(value):
                return getattr(value, "__qualname__", type(value).__name__)
            if isinstance(value, tuple):
                return "(" + ", ".join(shown(v) for v in value) + ")"
            if isinstance(value, Mapping):
                return str({k: v for k, v in value.items() if v != 1}) or "{}"
            return str(value)
        return "\n".join(f"{f.name}: {shown(getattr(self, f.name))}"
                         for f in dataclasses.fields(self))


ONE_DEVICE = Layout()
_layout: contextvars.ContextVar[Layout] = contextvars.ContextVar("jaxpar_layout",
                                                                 default=ONE_DEVICE)


def current_layout() -> Layout:
    """The layout the model is being traced under."""
    return _layout.get()


@contextlib.contextmanager
def installed(layout: Layout) -> Iterator[Layout]:
    """Within this block the model reads ``layout``."""
    token = _layout.set(layout)
    try:
        yield layout
    finally:
        _layout.reset(token)


def layout_with(**changes: Any) -> contextlib.AbstractContextManager[Layout]:
    """Within this block the active layout with ``changes`` (field -> value)."""
    return installed(dataclasses.replace(_layout.get(), **changes))


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Annotate ``x`` (one logical name per dimension) with the active activation layout."""
    if len(names) != x.ndim:
        raise ValueError(f"constrain: {len(names)} names {tuple(names)} for an array of shape "
                         f"{x.shape}")
    fn = _layout.get().constrain
    return x if fn is None else fn(x, names)


def gather_weight(w: jax.Array, stored: Sequence[str | None], used: Sequence[str | None]
                  ) -> jax.Array:
    """``w`` from its stored layout to the one a matmul reads (FSDP's gather): the active
    constrainer's ``gather`` where it has one, else a constraint to ``used``."""
    gather = getattr(_layout.get().constrain, "gather", None)
    return gather(w, stored, used) if gather is not None else constrain(w, used)


def sum_over_token_shards(partial_sums: jax.Array, used: Sequence[str | None],
                          stored: Sequence[str | None]) -> jax.Array:
    """``partial_sums`` [batch shards, sequence shards, ...] (one partial sum of a weight
    gradient per token shard) summed over both shard dimensions and laid out as ``stored``."""
    fn = _layout.get().token_shard_sum
    if fn is not None:
        return fn(partial_sums, tuple(used), tuple(stored))
    return constrain(jax.numpy.sum(partial_sums, axis=(0, 1)), stored)


def split_count(name: str) -> int:
    """Over how many devices the layout splits the logical dimension ``name`` (1: not split)."""
    return _layout.get().split_counts.get(name, 1)


def is_split(name: str) -> bool:
    """Whether the active layout splits the logical dimension ``name`` over devices."""
    return split_count(name) > 1


def hand_split_devices() -> int:
    """Over how many devices the tokens are split by hand (1: none), as inside a pipeline
    stage (:mod:`jaxpar.parallel.manual`), where a layer sees its own tokens alone."""
    hand = _layout.get().hand_split
    return 1 if hand is None else hand[1]


def sum_over_hand_split(x: jax.Array) -> jax.Array:
    """``x`` summed over the devices that split the tokens by hand. Forward statistics only: no
    gradient passes back."""
    hand = _layout.get().hand_split
    return x if hand is None else hand[0](jax.lax.stop_gradient(x))


def lora_dropout_for(key: jax.Array | None, rate: float, tokens: jax.Array | None = None
                     ) -> tuple | None:
    """The :attr:`Layout.lora_dropout` of ``key`` at ``rate`` (None or rate 0: off)."""
    return (key, rate, tokens) if key is not None and rate > 0 else None


def lora_dropout_tokens(tokens: jax.Array | None) -> contextlib.AbstractContextManager:
    """Within this block LoRA dropout masks the tokens numbered ``tokens`` (this micro-step's and
    device's ids travel with the batch, so a token's mask does not depend on where it is
    computed)."""
    active = _layout.get().lora_dropout
    if active is None or tokens is None:
        return contextlib.nullcontext()
    return layout_with(lora_dropout=(active[0], active[1], tokens))


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
