"""Point-to-point sends that every device issues in the same order.

JAX lowers every ``lax.ppermute`` with one channel id, and XLA:CPU keys its rendezvous by (run,
channel): independent sends could meet the wrong partners, and a ring attention step failed that way
(an abort, a segfault, once a silent NaN loss). :func:`ppermute_in_order` chains the sends through
``optimization_barrier`` ops, so the scheduler keeps their order. It changes no bytes, and compute
still overlaps the sends. What was seen and tried: docs/jax-notes.md, "Collectives under control
flow (XLA:CPU)".
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
from jax import lax


def ppermute_in_order(arrays: Sequence[jax.Array], axis: str,
                      perms: Sequence[Sequence[tuple[int, int]]]) -> list[jax.Array]:
    """``lax.ppermute(arrays[i], axis, perms[i])`` for each i, one after the other."""
    received: list[jax.Array] = []
    for x, perm in zip(arrays, perms, strict=True):
        if received:
            x, _ = lax.optimization_barrier((x, received[-1]))
        received.append(lax.ppermute(x, axis, list(perm)))
    return received
