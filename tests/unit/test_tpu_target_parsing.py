"""``jaxpar inspect --target tpu-...``'s target strings and slices, without libtpu: the topology
names libtpu takes, the generations' examples, and which slices wrap around. Compiles for a TPU
slice: ``tests/integration/test_tpu_target.py``."""

from __future__ import annotations

import pytest

from jaxpar.config import ConfigError
from jaxpar.inspect.tpu import GENERATIONS, parse_target, torus_wrap


@pytest.mark.parametrize("generation, dims, wrap", [
    ("v5p", (4, 4, 4), (True, True, True)), ("v5p", (8, 8, 16), (True, True, True)),
    ("v5p", (4, 4, 2), (False, False, False)), ("v4", (2, 2, 1), (False, False, False)),
    ("v5e", (16, 16, 1), (True, True, False)), ("v5e", (8, 16, 1), (False, True, False)),
    ("v6e", (4, 4, 1), (False, False, False))])
def test_a_target_slice_wraps_where_real_slices_do(generation, dims, wrap):
    """libtpu's compile-only topology has no wraparound unless asked; real slices have it on
    full rings (without it the compiler turns a whole-slice all-gather into an all-reduce)."""
    assert torus_wrap(GENERATIONS[generation], dims) == wrap


@pytest.mark.parametrize(("text", "topology", "chips"), [
    ("tpu-v5e:2x4", "v5e:2x4", 8), ("tpu-v4:2x2x1", "v4:2x2x1", 4),
    ("tpu-v5p:2x2x1", "v5p:2x2x1", 4), ("tpu-v6e:4x4", "v6e:4x4", 16),
    ("tpu-v7x:2x2x1", "tpu7x:2x2x1", 4), ("TPU-V5E:1x1", "v5e:1x1", 1),
])
def test_parse_target_maps_to_libtpu_topology_names(text, topology, chips):
    target = parse_target(text)
    assert target.topology_name == topology and target.chips == chips
    assert target.name == text.lower()


def test_every_generation_example_parses():
    for name, generation in GENERATIONS.items():
        assert parse_target(f"tpu-{name}:{generation.example}").generation == name
    with pytest.raises(ConfigError, match="accepted: tpu-v4:2x2x1"):
        parse_target("tpu-v5e:2x4x1")
