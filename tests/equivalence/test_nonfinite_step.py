"""A step with a non-finite loss, in this process: parameters and optimizer state are kept, the
step is counted, and the next finite step updates again. What the command line does with such
steps (``train.on_nonfinite``): ``tests/integration/test_checkpoint.py``."""

from __future__ import annotations

import math

import jax
import numpy as np
from helpers import synthetic_batch, trainer_for


def test_nonfinite_step_keeps_params_and_optimizer_state_and_counts_the_step():
    trainer = trainer_for(["mesh.data=8"])
    state, _ = trainer.step(trainer.init(), synthetic_batch(trainer, 0))
    before = jax.device_get(state)
    state, metrics_ = trainer.step(state, synthetic_batch(trainer, 1, poison=True))
    assert bool(metrics_["nonfinite"]) and not math.isfinite(float(metrics_["loss"]))
    after = jax.device_get(state)
    assert int(after.step) == 2  # the batch was consumed
    jax.tree.map(np.testing.assert_array_equal, (after.params, after.opt_state),
                 (before.params, before.opt_state))
    state, metrics_ = trainer.step(state, synthetic_batch(trainer, 2))
    assert not bool(metrics_["nonfinite"])
    moved = jax.device_get(state.params)
    assert any(not np.array_equal(a, b) for a, b in
               zip(jax.tree.leaves(moved), jax.tree.leaves(before.params), strict=True))
