"""Mixed precision's config errors, before any compile: bf16 gradient sums that XLA:CPU cannot
compile, and bf16 sums the partitioner would take in float32 anyway. The bounds of bf16 against
float32: ``tests/equivalence/test_mixed_precision.py``."""

from __future__ import annotations

import jax
import pytest

from jaxpar.config import ConfigError, load_config, validate
from jaxpar.mesh import make_mesh
from jaxpar.train.step import build_trainer


def test_bfloat16_gradient_sums_are_a_config_error_on_xla_cpu():
    # XLA:CPU aborts compiling them (train/step.py: check_reduce_dtype), checked on data=2.
    cfg = validate(load_config("tiny", ["mesh.data=2", "parallel.reduce_dtype=bfloat16"]), 2)
    with pytest.raises(ConfigError, match="parallel.reduce_dtype=bfloat16: XLA:CPU"):
        build_trainer(cfg, make_mesh(cfg, devices=jax.devices()[:2]))


def test_bfloat16_sums_the_partitioner_would_ignore_are_refused():
    cfg = load_config("tiny", ["mesh.data=1", "mesh.fsdp=8", "parallel.reduce_dtype=bfloat16"])
    with pytest.raises(ConfigError, match="needs train.dtype=bfloat16"):
        validate(cfg, 8)
    validate(load_config("tiny", ["mesh.data=1", "mesh.fsdp=8", "train.dtype=bfloat16",
                                  "parallel.reduce_dtype=bfloat16"]), 8)
