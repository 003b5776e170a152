"""Point-to-point sends that every device issues in the same order.

JAX lowers every ``lax.ppermute`` with the same channel id (1), and XLA:CPU keys the rendezvous
of its in-process collectives by (run, channel). Ring attention over ``context=8`` on one
2048-token sequence (three sends a hop: K, V and their positions), with the embedding as a
gather, failed 3 of 4 runs on 8 virtual CPU devices: an abort (9 participants in an 8-device
permute, or one device in a gradient all-reduce while the others waited in a permute), a
segfault, and once silently, a NaN loss. With the sends chained as below, 13 of 13 runs passed.

:func:`ppermute_in_order` chains the sends: each one's operand goes through an
``optimization_barrier`` with the previous send's result, so the scheduler cannot start it
earlier. XLA removes the barrier once it has scheduled the program, so the fix acts through
that schedule (in the failing step, the unchained sends had been scheduled outside the layer
loop, next to a gradient all-reduce; chained, none were); that crossing sends with one channel
id are the cause is the likeliest reading, not a proven one (docs/jax-notes.md). It changes no
bytes, and compute still overlaps the sends.
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
