"""``train.init_from``: a run that starts from another checkpoint's weights.

Parameters are read straight into this run's shardings and dtype
(:func:`jaxpar.checkpoint.weights.restore_params`); optimizer state is fresh, step 0. Buffers
take initial values (router biases zero, window flags per config), but buffers a weights-only
checkpoint saved win (an imported DeepSeek-V3's router correction biases). Under
``train.lora`` the checkpoint gives the base; adapters start fresh (B zero).
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.checkpoint.weights import restore_params, stored_buffers
from jaxpar.model.lora import adapter_part, base_part, merged
from jaxpar.model.transformer import create_model, initial_buffers
from jaxpar.train.step import (
    Trainer,
    TrainState,
    lora_of,
    make_optimizer,
    stored_params,
    trained,
)


def initial_state(trainer: Trainer, source: Path) -> TrainState:
    """The first state of a run with ``train.init_from=source`` (module docstring)."""
    cfg, lora = trainer.cfg, lora_of(trainer.cfg) is not None
    wanted = trainer.abstract_state.params
    params = restore_params(source, base_part(wanted) if lora else wanted,
                            vocab_size=cfg.model.vocab_size)
    abstract = trainer.abstract_state.buffers
    stored = stored_buffers(source) if jax.tree.leaves(abstract) else {}
    saved = restore_params(source, _held(abstract, stored), item="buffers") if stored else {}
    tx = make_optimizer(cfg.train, trained(cfg, trainer.logical_axes))
    adapters = _fresh_adapters(trainer) if lora else {}

    def fresh(params: dict, adapters: dict, saved: dict) -> TrainState:
        params = merged(params, adapters)
        # the config's values (window flags, zero router biases), then the saved ones over them
        buffers = _over(jax.tree.map(jnp.asarray, initial_buffers(trainer.cfg.model, abstract)),
                        saved)
        return TrainState(jnp.zeros((), jnp.int32), params, tx.init(trained(cfg, params)),
                          buffers)

    with jax.set_mesh(trainer.mesh):
        state = jax.jit(fresh, out_shardings=trainer.state_shardings)(params, adapters, saved)
    return trainer.from_model_order(state)


def _fresh_adapters(trainer: Trainer) -> dict:
    """A fresh LoRA run's adapters, laid out as the run keeps them (base weights are not
    outputs: the compiler drops them)."""
    cfg = trainer.cfg

    def make() -> dict:
        _, params, _ = nnx.split(create_model(cfg.model, cfg.train.seed, lora_of(cfg),
                                              vocab_rows=cfg.vocab_rows()), nnx.Param, ...)
        return adapter_part(stored_params(nnx.to_pure_dict(params), cfg.train.param_dtype))

    with jax.set_mesh(trainer.mesh):
        return jax.jit(make, out_shardings=adapter_part(trainer.state_shardings.params))()


def _held(wanted: dict, stored: dict) -> dict:
    """The part of ``wanted`` whose keys the checkpoint's tree ``stored`` has."""
    return {k: _held(v, stored[k]) if isinstance(v, dict) else v
            for k, v in wanted.items() if k in stored}


def _over(base: dict, saved: dict) -> dict:
    """``base`` with each array ``saved`` holds replaced."""
    return {k: (_over(v, saved[k]) if isinstance(v, dict) else saved[k]) if k in saved else v
            for k, v in base.items()}
