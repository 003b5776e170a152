"""Splitting a global batch into micro-steps (gradient accumulation) or pipeline microbatches."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def split_micro_steps(batch: dict, steps: int) -> dict:
    """[B, S] -> [steps, B/steps, S], micro-step j taking rows j, j+steps, ...: each device's
    rows stay on it, and it holds rows of every micro-step."""
    def split(x: jax.Array) -> jax.Array:
        return jnp.swapaxes(x.reshape(x.shape[0] // steps, steps, *x.shape[1:]), 0, 1)

    return jax.tree.map(split, batch)
