"""The eval step (train/validation_loss.py): its loss is the train step's loss on the same
batches, on every layout, and no program compiles after start-up.

Each layout builds a trainer from the seeded initial state and compiles only its eval step
(forward only; the pipeline's is its loss-and-gradient program); the reference is the
single-device train step's own loss (``Trainer.loss_and_grads``) on the same batches, weighted
by their valid tokens. Batches are helpers.make_batches': random tokens, some targets masked.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.monitoring
import numpy as np
import pytest
from helpers import make_batches

from jaxpar.config import load_config, validate
from jaxpar.mesh import make_mesh
from jaxpar.train.step import build_trainer
from jaxpar.train.validation_loss import Validation

BASE = ["train.batch_size=8", "train.seq_len=32"]
MOE = ["train.grad_accum=2"]  # the eval step's micro-steps: capacity drops depend on them
LAYOUTS = {
    "data=2,fsdp=2,tensor=2": ("tiny", ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]),
    "data=2,context=2,tensor=2": ("tiny", ["mesh.data=2", "mesh.context=2", "mesh.tensor=2"]),
    "pipe=2,m=2": ("tiny", ["mesh.pipe=2", "mesh.data=1", "train.microbatches=2"]),
    "moe,data=2,expert=2,grad_accum=2": ("moe-tiny", ["mesh.data=2", "mesh.expert=2", *MOE]),
}
REFERENCE = {"tiny": ["mesh.data=1"], "moe-tiny": ["mesh.data=1", *MOE]}

_compiles: list[str] = []
jax.monitoring.register_event_duration_secs_listener(
    lambda event, _, **kw: _compiles.append(kw.get("fun_name", ""))
    if event == "/jax/core/compile/backend_compile_duration" else None)


@functools.cache
def _cached(preset: str, overrides: tuple[str, ...]) -> tuple[Validation, object]:
    return _validation(preset, list(overrides))


def _validation(preset: str, overrides: list[str]) -> tuple[Validation, object]:
    """A Validation over make_batches' batches on as many devices as the mesh needs, and the
    initial state (the cached ones: _cached, never given to a train step, which donates it)."""
    n = math.prod(int(o.split("=")[1]) for o in overrides if o.startswith("mesh.")) or 1
    cfg = validate(load_config(preset, [*BASE, *overrides]), n)
    trainer = build_trainer(cfg, make_mesh(cfg, devices=jax.devices()[:n]))
    validation = Validation(trainer, {"": make_batches(cfg)}, "")
    validation.compile()
    return validation, trainer.init()


def _train_step_loss(preset: str) -> float:
    """The single-device train step's loss over the same batches, token-weighted."""
    validation, state = _cached(preset, tuple(REFERENCE[preset]))
    trainer, batches = validation.trainer, validation.sets[""]
    sums = [float(trainer.loss_and_grads(state, trainer.put_batch(b))[0]) * b["mask"].sum()
            for b in batches]
    return math.fsum(sums) / sum(float(b["mask"].sum()) for b in batches)


@pytest.mark.parametrize("preset", ["tiny", "moe-tiny"])
def test_eval_loss_is_the_train_steps_loss_on_one_device(preset):
    validation, state = _cached(preset, tuple(REFERENCE[preset]))
    got = validation.evaluate(state)
    tokens = sum(float(b["mask"].sum()) for b in validation.sets[""])
    assert got["val_tokens"] == tokens
    np.testing.assert_allclose(got["val_loss"], _train_step_loss(preset), rtol=1e-6)
    assert got["val_ppl"] == pytest.approx(math.exp(got["val_loss"]))


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_eval_loss_on_a_parallel_layout_is_the_single_device_loss(name):
    preset, overrides = LAYOUTS[name]
    validation, state = _validation(preset, overrides)
    reference, ref_state = _cached(preset, tuple(REFERENCE[preset]))
    np.testing.assert_allclose(validation.evaluate(state)["val_loss"],
                               reference.evaluate(ref_state)["val_loss"], rtol=1e-5)


def test_training_and_evaluating_compile_nothing_after_start_up():
    validation, state = _validation("tiny", ["mesh.data=2", "mesh.tensor=2"])
    trainer = validation.trainer
    step = trainer.compile_step()
    batch = validation.sets[""][0]
    _compiles.clear()
    for _ in range(2):
        state, _ = step(state, trainer.put_batch(batch))
        first = validation.evaluate(state)
    again = validation.evaluate(state)
    assert _compiles == []
    assert first == again  # the same batches, the same state: the same number
