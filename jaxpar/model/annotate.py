"""Logical-axis annotations for activations, without knowing anything about meshes.

The model calls :func:`constrain` with logical names (``("batch", "seq", "act_embed")``). By
default that does nothing, so the model runs unsharded on one device. The train step enters
:func:`activation_sharding` with a function, built by :mod:`jaxpar.parallel.rules`, that turns the
names into a sharding constraint on the current mesh. This is the single piece of global state the
model reads, and it only lives for the duration of a trace.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence

import jax

Constrain = Callable[[jax.Array, Sequence[str | None]], jax.Array]

_constrain: contextvars.ContextVar[Constrain | None] = contextvars.ContextVar(
    "jaxpar_activation_constrain", default=None)


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Annotate ``x`` (one logical name per dimension) with the active activation layout."""
    if len(names) != x.ndim:
        raise ValueError(f"constrain: {len(names)} names {tuple(names)} for an array of shape "
                         f"{x.shape}")
    fn = _constrain.get()
    return x if fn is None else fn(x, names)


@contextlib.contextmanager
def activation_sharding(fn: Constrain | None) -> Iterator[None]:
    """Within this block, :func:`constrain` applies ``fn``."""
    token = _constrain.set(fn)
    try:
        yield
    finally:
        _constrain.reset(token)
