"""One train step compiled and not run: what ``jaxpar inspect`` (and its ``--hlo``) reads.

The step is compiled from abstract arrays (``Trainer.compile_step``), so no parameter, optimizer or
batch memory is allocated; the trainer comes along because it holds the shardings the report
describes.
"""

from __future__ import annotations

import dataclasses
import time

import jax

from jaxpar.config import Config
from jaxpar.train.step import Trainer, build_trainer


@dataclasses.dataclass(frozen=True)
class CompiledStep:
    """A train step compiled for inspection, with the trainer that holds its shardings."""

    cfg: Config
    trainer: Trainer
    compiled: jax.stages.Compiled
    compile_seconds: float


def compiled_step(cfg: Config, mesh: jax.sharding.Mesh) -> CompiledStep:
    """Build the trainer for ``cfg`` (validated) on ``mesh`` and compile one step, unrun."""
    trainer = build_trainer(cfg, mesh)
    start = time.perf_counter()
    compiled = trainer.compile_step()
    return CompiledStep(cfg, trainer, compiled, time.perf_counter() - start)
