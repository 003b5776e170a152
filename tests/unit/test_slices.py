"""Meshes over several slices (``mesh.dcn``, docs/multi-host.md#several-slices): the config's
checks, the device order (each slice's devices together, the dcn factor outermost on its axis),
which collectives the plan sends over the data-center network, and the start-up line."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxpar.config import ConfigError, load_config, slices_line, validate
from jaxpar.hardware import get_profile
from jaxpar.mesh import make_mesh


def config(*overrides: str, devices: int = 8):
    return validate(load_config("tiny", list(overrides)), devices)


def device_ids(cfg) -> np.ndarray:
    return np.vectorize(lambda d: d.id)(make_mesh(cfg).devices).reshape(
        [n for n in cfg.mesh_shape.values() if n > 1])


@pytest.mark.parametrize(("overrides", "message"), [
    (("mesh.data=4", "mesh.tensor=2", "mesh.dcn.data=3"),
     "mesh.dcn.data=3 does not divide mesh.data=4"),
    (("mesh.dcn.fsdp=0",), "mesh.dcn.fsdp=0: must be >= 1"),
    (("mesh.dcn.slices=2",), "unknown key mesh.dcn.slices"),
])
def test_a_dcn_that_does_not_split_its_axis_is_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message):
        config(*overrides)


def test_each_slice_holds_consecutive_devices_and_the_dcn_factor_is_outermost():
    # data=4 over 2 slices of 4 devices: data 0-1 in slice 0 (devices 0-3), 2-3 in slice 1.
    ids = device_ids(config("mesh.data=4", "mesh.tensor=2", "mesh.dcn.data=2"))
    np.testing.assert_array_equal(ids, [[0, 1], [2, 3], [4, 5], [6, 7]])
    # Four slices of two devices over data x fsdp: slice (d, f) is devices 2(2d + f), +1.
    ids = device_ids(config("mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "mesh.dcn.data=2",
                            "mesh.dcn.fsdp=2"))
    np.testing.assert_array_equal(ids, np.arange(8).reshape(2, 2, 2))
    # tensor over slices: its pairs straddle them, everything else stays inside one.
    ids = device_ids(config("mesh.data=4", "mesh.tensor=2", "mesh.dcn.tensor=2"))
    np.testing.assert_array_equal(ids, [[0, 4], [1, 5], [2, 6], [3, 7]])
    assert sorted(d.id for d in jax.devices()[:8]) == list(range(8))


def test_the_plan_sends_only_the_crossing_axes_over_dcn():
    tpu = get_profile("tpu-v5p")
    cfg = config("mesh.data=4", "mesh.fsdp=2", "mesh.dcn.data=2")
    dcn, mesh = cfg.mesh.dcn, cfg.mesh_shape
    assert tpu.axis_link(mesh, "data", dcn)[0] == "DCN"
    assert tpu.axis_link(mesh, ("data", "fsdp"), dcn)[0] == "DCN"
    assert tpu.axis_link(mesh, "fsdp", dcn) == ("ICI", tpu.fast_bytes_per_s)
    assert tpu.axis_latency(mesh, "data", dcn) == tpu.slow_latency_s
    # Without slices the span rule holds: 8 chips fit in one slice.
    assert tpu.axis_link(mesh, "data")[0] == "ICI"


def test_the_start_up_line_warns_of_a_per_layer_axis_over_dcn():
    assert slices_line(config()) is None
    line = slices_line(config("mesh.data=4", "mesh.fsdp=2", "mesh.dcn.data=2"))
    assert line.startswith("2 slices (mesh.dcn data=2)") and "warning" not in line
    line = slices_line(config("mesh.data=4", "mesh.tensor=2", "mesh.dcn.tensor=2"))
    assert line.startswith("warning: mesh.dcn puts tensor over the data-center network")
