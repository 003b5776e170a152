"""``train.init_from``: a run that starts from another checkpoint's weights.

The parameters are read straight into this run's shardings and dtype
(:func:`jaxpar.checkpoint.weights.restore_params`); the optimizer state is fresh, the step is 0,
and the model's buffers take their initial values (MoE router biases start at zero, the layers'
window flags as the config sets them), except where a weights-only checkpoint holds them as
weights (an imported DeepSeek-V3's router correction biases, which its routing needs): saved
buffers win over the initial ones.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp

from jaxpar.checkpoint.weights import restore_params, stored_buffers
from jaxpar.model.transformer import initial_buffers
from jaxpar.train.step import Trainer, TrainState, make_optimizer


def initial_state(trainer: Trainer, source: Path) -> TrainState:
    """The first state of a run with ``train.init_from=source`` (module docstring)."""
    params = restore_params(source, trainer.abstract_state.params)
    abstract = trainer.abstract_state.buffers
    stored = stored_buffers(source) if jax.tree.leaves(abstract) else {}
    saved = restore_params(source, _held(abstract, stored), item="buffers") if stored else {}
    tx = make_optimizer(trainer.cfg.train, trainer.logical_axes)

    def fresh(params: dict, saved: dict) -> TrainState:
        # the config's values (window flags, zero router biases), then the saved ones over them
        buffers = _over(jax.tree.map(jnp.asarray, initial_buffers(trainer.cfg.model, abstract)),
                        saved)
        return TrainState(jnp.zeros((), jnp.int32), params, tx.init(params), buffers)

    with jax.set_mesh(trainer.mesh):
        state = jax.jit(fresh, out_shardings=trainer.state_shardings)(params, saved)
    return trainer.from_model_order(state)


def _held(wanted: dict, stored: dict) -> dict:
    """The part of the nested dict ``wanted`` whose keys the checkpoint's tree ``stored`` has."""
    return {k: _held(v, stored[k]) if isinstance(v, dict) else v
            for k, v in wanted.items() if k in stored}


def _over(base: dict, saved: dict) -> dict:
    """``base`` with each array that ``saved`` (a part of its tree) holds replaced."""
    return {k: (_over(v, saved[k]) if isinstance(v, dict) else saved[k]) if k in saved else v
            for k, v in base.items()}
