"""Timing helpers shared by the scripts: a fixed random batch and the step-time loop.

Every layout of a comparison must run the same global batch, so the batch comes from a fixed
seed and the global shape alone; ``Trainer.put_batch`` lays it out for the layout's mesh.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import jax
import numpy as np

from jaxpar.config import Config
from jaxpar.train.step import Batch, Trainer


def random_batch(cfg: Config, trainer: Trainer, seed: int = 0) -> Batch:
    """The same random global batch for every layout of ``cfg``'s shape, on its devices."""
    rng = np.random.default_rng(seed)
    shape = (cfg.train.batch_size, cfg.train.seq_len)
    tokens = rng.integers(0, cfg.model.vocab_size, (shape[0], shape[1] + 1))
    return trainer.put_batch({"inputs": tokens[:, :-1].astype(np.int32),
                              "targets": tokens[:, 1:].astype(np.int32),
                              "mask": np.ones(shape, np.float32)})


def step_times(step: Any, state: Any, batch: Batch, *, warmup: int, steps: int) -> list[float]:
    """Wall seconds of ``steps`` calls of ``step`` after ``warmup`` untimed ones.

    ``block_until_ready`` on the metrics ends each timed call only when the device work is done;
    the state is threaded through so every step runs on the previous one's (donated) buffers,
    as in training.
    """
    for _ in range(warmup):
        state, metrics = step(state, batch)
    jax.block_until_ready(state)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - start)
    jax.block_until_ready(state)
    return times


def spread(times: list[float]) -> dict[str, float]:
    """Median, min, max and interquartile range of ``times`` (seconds)."""
    quartiles = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
            "iqr_s": quartiles[2] - quartiles[0], "n": len(times)}
