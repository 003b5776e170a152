"""``train.init_from``: a run that starts from another checkpoint's weights.

The parameters are read straight into this run's shardings and dtype
(:func:`jaxpar.checkpoint.weights.restore_params`); the optimizer state is fresh, the step is 0,
and the model's buffers take their initial values (MoE router biases start at zero, the layers'
window flags as the config sets them).
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp

from jaxpar.checkpoint.weights import restore_params
from jaxpar.model.transformer import initial_buffers
from jaxpar.train.step import Trainer, TrainState, make_optimizer


def initial_state(trainer: Trainer, source: Path) -> TrainState:
    """The first state of a run with ``train.init_from=source`` (module docstring)."""
    params = restore_params(source, trainer.abstract_state.params)
    tx = make_optimizer(trainer.cfg.train)

    def fresh(params: dict) -> TrainState:
        buffers = jax.tree.map(jnp.asarray, initial_buffers(trainer.cfg.model,
                                                            trainer.abstract_state.buffers))
        return TrainState(jnp.zeros((), jnp.int32), params, tx.init(params), buffers)

    with jax.set_mesh(trainer.mesh):
        state = jax.jit(fresh, out_shardings=trainer.state_shardings)(params)
    return trainer.from_model_order(state)
