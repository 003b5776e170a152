"""A stage that keeps only each chunk's input (``parallel.pipeline_stash=inputs``).

By default (``residuals``) a forward slot stashes its chunk's VJP residuals until the chunk's
backward slot: what ``train.remat`` saves of every layer of the chunk, for every microbatch in
flight. Under ``remat=full`` that is each layer's input: with 1F1B the first stage holds
``2p - 1`` microbatches, so ``(2p - 1) x L/p`` activations (Llama-3-70B at ``pipe=4``, one row
of 4096 tokens split over ``tensor=4``: 7 x 20 x 16 MiB, 2.5 GiB with the spare slot).

With ``inputs`` the forward slot stashes the chunk's input alone, one activation per microbatch
in flight, and the backward slot first runs the chunk's forward again from it (under
``jax.vjp``, its layers under ``train.remat`` as in the forward slot), then the backward as
usual: the residuals of one microbatch's chunk exist at a time, for the length of one slot.
The price is one more forward of the chunk per backward slot (masked ones too: the one-program
rule), and under ``pipeline_fsdp=per_layer`` one more gather of each of its layers. MaxText's
pipeline makes the same trade (it saves each stage's input per microbatch, its
``iteration_input``, and recomputes the stage in the backward pass).

Only schedules whose backward runs whole (``gpipe``, ``1f1b``, ``interleaved``): where it is cut
into I and W (``zero_bubble``, ``dualpipe_v``) the W, steps after its I, would need the chunk's
residuals again (config validation refuses the pair).

The forward slot still runs its chunk under ``jax.vjp`` (the executor's one forward): nothing
reads the residuals it makes, and the compiler drops them (the compiled memory tests, on tiny
against the plan, would see them).
"""

from __future__ import annotations

from typing import Any

import jax


def kept(env: Any, x: jax.Array, residuals: list) -> list:
    """What a forward slot stashes for the chunk's backward: ``residuals`` (the VJP's), or its
    input ``x`` alone (``env.stash_inputs``)."""
    return [x] if env.stash_inputs else residuals


def rebuilt(env: Any, j: jax.Array, stashed: list, mb: jax.Array) -> list:
    """The residuals a backward slot pulls its gradient through: ``stashed`` as they are, or
    (``env.stash_inputs``) made again by running chunk ``j``'s forward on the stashed input,
    with microbatch ``mb``'s positions and masks."""
    if not env.stash_inputs:
        return stashed
    (x,) = stashed
    _, residuals = env.forward(j, x, env.microbatch(mb))
    return residuals
