"""A stage that keeps only each chunk's input (``parallel.pipeline_stash=inputs``).

By default (``residuals``) a forward slot stashes its chunk's VJP residuals until the chunk's
backward slot: what ``train.remat`` saves of every layer, for every microbatch in flight. With
``inputs`` the forward slot stashes the chunk's input alone, and the backward slot first runs the
chunk's forward again from it, then the backward as usual. So one microbatch's chunk residuals exist
at a time, for one slot; the price is one more forward of the chunk per backward slot (MaxText's
pipeline makes the same trade).

Only schedules whose backward runs whole (``gpipe``, ``1f1b``, ``interleaved``): a W steps after its
I would need the residuals again. The memory and the price in bytes: docs/pipelines.md, "Each
chunk's input alone".
"""

from __future__ import annotations

from typing import Any

import jax


def kept(env: Any, x: jax.Array, residuals: list) -> list:
    """What a forward slot stashes: the VJP's ``residuals``, or (``env.stash_inputs``) its input
    alone."""
    return [x] if env.stash_inputs else residuals


def rebuilt(env: Any, j: jax.Array, stashed: list, mb: jax.Array) -> list:
    """The residuals a backward slot pulls its gradient through: ``stashed``, or
    (``env.stash_inputs``) made again by running chunk ``j``'s forward on the stashed input, with
    microbatch ``mb``'s positions and masks."""
    if not env.stash_inputs:
        return stashed
    (x,) = stashed
    _, residuals = env.forward(j, x, env.microbatch(mb))
    return residuals
