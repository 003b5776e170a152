"""Timing helpers shared by the scripts: a fixed random batch and the step-time loop.

Every layout of a comparison must run the same global batch, so the batch comes from a fixed
seed and the global shape alone; ``Trainer.put_batch`` lays it out for the layout's mesh.

A layout's timed steps alternate with steps of its 1-device baseline (a :class:`Stepper` kept
from the baseline's own measurement): their ratio then compares two runs of the same minutes of
a shared machine, whose speed drifts by more than the differences measured (the same 1-device
step took 0.85 s on one day and 1.2-1.3 s on another on these 2 cores).

Compilations are counted by a listener on jax's backend-compile event (every XLA compile in
this process, whatever triggers it): :func:`step_times` reports how many happened after the
first step, i.e. whether a step recompiled (a state whose layout or dtype changed after one
step, an argument that is not the same shape every time).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any

import jax
import jax.monitoring
import numpy as np

from jaxpar.config import Config, documents_masked
from jaxpar.train.step import Batch, Trainer


def random_batch(cfg: Config, trainer: Trainer, seed: int = 0) -> Batch:
    """The same random global batch for every layout of ``cfg``'s shape, on its devices."""
    rng = np.random.default_rng(seed)
    shape = (cfg.train.batch_size, cfg.train.seq_len)
    tokens = rng.integers(0, cfg.model.vocab_size, (shape[0], shape[1] + 1))
    batch = {"inputs": tokens[:, :-1].astype(np.int32), "targets": tokens[:, 1:].astype(np.int32),
             "mask": np.ones(shape, np.float32)}
    if documents_masked(cfg):  # random rows hold no documents: one per row, as unmasked
        batch["segment_ids"] = np.zeros(shape, np.int32)
    return trainer.put_batch(batch)


COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_compiles = [0]  # backend compilations in this process since the listener was registered


def _count_compile(event: str, _seconds: float, **_: Any) -> None:
    if event == COMPILE_EVENT:
        _compiles[0] += 1


jax.monitoring.register_event_duration_secs_listener(_count_compile)


@dataclasses.dataclass
class Stepper:
    """A compiled step with its state and batch, run one timed step at a time; ``times`` holds
    the seconds of the steps :func:`step_times` ran alongside its own."""

    step: Any
    state: Any
    batch: Batch
    times: list[float] = dataclasses.field(default_factory=list)

    def run(self) -> float:
        start = time.perf_counter()
        self.state, metrics = self.step(self.state, self.batch)
        jax.block_until_ready(metrics)
        return time.perf_counter() - start


def step_times(step: Any, state: Any, batch: Batch, *, warmup: int, steps: int,
               alongside: Stepper | None = None) -> tuple[list[float], int]:
    """Wall seconds of ``steps`` calls of ``step`` after ``warmup`` untimed ones, and the
    number of compilations after the first call (0: no step recompiled). With ``alongside``,
    each timed step is followed by one of its steps, timed into ``alongside.times``.

    ``block_until_ready`` on the metrics ends each timed call only when the device work is done;
    the state is threaded through so every step runs on the previous one's (donated) buffers,
    as in training.
    """
    times, by_first = [], _compiles[0]
    if alongside is not None:
        alongside.times = []
    for i in range(warmup + steps):
        start = time.perf_counter()
        state, metrics = step(state, batch)  # compiles, if at all, before it returns
        if i == 0:
            by_first = _compiles[0]
        if i >= warmup:
            jax.block_until_ready(metrics)
            times.append(time.perf_counter() - start)
            if alongside is not None:
                alongside.times.append(alongside.run())
        elif i == warmup - 1:
            jax.block_until_ready(state)
    jax.block_until_ready(state)
    return times, _compiles[0] - by_first


def spread(times: list[float]) -> dict[str, float]:
    """Median, min, max and interquartile range of ``times`` (seconds)."""
    quartiles = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
            "iqr_s": quartiles[2] - quartiles[0], "n": len(times)}
