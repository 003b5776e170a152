"""A stage that keeps only each chunk's input (``parallel.pipeline_stash=inputs``).

By default (``residuals``) a forward slot stashes the chunk's VJP residuals until its backward
slot. With ``inputs`` it stashes the input alone, and the backward slot reruns the forward from
it first: one microbatch's residuals exist at a time, for one more forward per backward slot
(as MaxText). Only for whole-backward schedules (``gpipe``, ``1f1b``, ``interleaved``): a later
W would need the residuals. Memory and price: docs/pipelines.md, "Each chunk's input alone".
"""

from __future__ import annotations

from typing import Any

import jax


def kept(env: Any, x: jax.Array, residuals: list) -> list:
    """What a forward slot stashes: ``residuals``, or (``env.stash_inputs``) its input."""
    return [x] if env.stash_inputs else residuals


def rebuilt(env: Any, j: jax.Array, stashed: list, mb: jax.Array) -> list:
    """The residuals a backward slot uses: ``stashed``, or (``env.stash_inputs``) rebuilt by
    chunk ``j``'s forward on the stashed input with microbatch ``mb``'s positions and masks."""
    if not env.stash_inputs:
        return stashed
    (x,) = stashed
    _, residuals = env.forward(j, x, env.microbatch(mb))
    return residuals
