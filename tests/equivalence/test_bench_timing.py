"""scripts/benchmark.py's step timing: the compilations after the first step are counted (a
small jitted function; the benchmark itself on tiny layouts: ``tests/integration/
test_benchmark.py``)."""

from __future__ import annotations

from helpers import benchmark_script as _benchmark


def test_step_times_counts_the_compilations_after_the_first_step():
    """A step whose state grows every call compiles every call: each one after the first
    counts."""
    import jax
    import jax.numpy as jnp

    _benchmark()  # scripts/ on the path
    from bench_timing import step_times

    step = jax.jit(lambda state, batch: (jnp.concatenate([state, batch]), {"n": state.sum()}))
    times, recompiles = step_times(step, jnp.zeros(1), jnp.ones(1), warmup=1, steps=2)
    assert len(times) == 2 and recompiles == 2
    _, recompiles = step_times(jax.jit(lambda s, b: (s + b, {})), jnp.zeros(1), jnp.ones(1),
                               warmup=1, steps=2)
    assert recompiles == 0
