"""Every test process sees 8 virtual CPU devices; this must run before jax starts a backend.

The tests come in three tiers, one folder each: ``unit/`` compiles no model, step or jitted
function and starts no process (each test well under a second), ``equivalence/`` compiles and
runs programs in the test process (layouts against one device, HLO and memory of compiled
steps), ``integration/`` goes through the command line, several processes, Hugging Face
transformers or TPU targets. Each test gets its folder's marker (``pytest -m unit``); shared
code lives in ``helpers.py`` and ``hf_models.py`` beside this file, which is on ``sys.path`` for
every tier. No test file imports another.
"""

import os
import sys
from pathlib import Path

import pytest

# LLVM's optimisation of the CPU kernels is most of a compile and buys nothing for programs of
# tiny models that run a few steps: level 0 takes a third off the suite (measured on
# test_mla_layouts.py: 94 s -> 64 s). XLA's own passes (sharding, buffers) are untouched.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8"
                           + " --xla_backend_optimization_level=0").strip()
os.environ["JAX_PLATFORMS"] = "cpu"

TESTS = Path(__file__).resolve().parent
if str(TESTS) not in sys.path:  # `from helpers import ...` in every tier, any import mode
    sys.path.insert(0, str(TESTS))

TIERS = ("unit", "equivalence", "integration")


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        path = Path(item.path).resolve()
        if not path.is_relative_to(TESTS):
            continue
        tier = path.relative_to(TESTS).parts[0]
        if tier not in TIERS:
            raise pytest.UsageError(f"{path.relative_to(TESTS.parent)}: a test file belongs in "
                                    f"one of tests/{{{','.join(TIERS)}}}/")
        item.add_marker(getattr(pytest.mark, tier))


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs(request):
    """After each test file, drop what its module-level caches and jax's own caches hold.

    A worker runs dozens of files; without this every compiled step, trainer and state a file
    cached stays alive until the worker exits, and a worker's memory grew past 5 GB by half-way
    through the suite, until XLA's compiler aborted for want of memory near the end of the run.
    """
    yield
    import gc

    import helpers
    import jax

    for namespace in (vars(request.module), vars(helpers)):
        for value in list(namespace.values()):
            if callable(getattr(value, "cache_clear", None)):
                value.cache_clear()
    jax.clear_caches()
    gc.collect()
