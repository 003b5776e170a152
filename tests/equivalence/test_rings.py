"""The ring gather and reduce-scatter (parallel/point_to_point.py) equal JAX's own collectives."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from helpers import assert_grads_and_params_match, run_layout
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.parallel.point_to_point import ring_all_gather, ring_reduce_scatter

AXES = [("fsdp",), ("data", "fsdp")]


def mesh() -> jax.sharding.Mesh:
    return jax.make_mesh((2, 2, 2), ("data", "fsdp", "other"))


def run(fn, x: jax.Array, in_spec: P, out_specs) -> tuple:
    m = mesh()
    mapped = jax.shard_map(fn, mesh=m, in_specs=in_spec, out_specs=out_specs, check_vma=False)
    return jax.jit(mapped)(jax.device_put(x, NamedSharding(m, in_spec)))


@pytest.mark.parametrize("axes", AXES)
@pytest.mark.parametrize("axis", [0, 1])
def test_ring_all_gather_is_all_gather(axes, axis):
    x = jax.random.normal(jax.random.key(0), (8, 12, 5))
    spec = P(*([None] * axis), axes)
    ring, reference = run(lambda a: (ring_all_gather(a, axes, axis),
                                     lax.all_gather(a, axes, axis=axis, tiled=True)),
                          x, spec, P())
    np.testing.assert_array_equal(ring, reference)
    np.testing.assert_array_equal(ring, x)


@pytest.mark.parametrize("axes", AXES)
@pytest.mark.parametrize("axis", [0, 1])
def test_ring_reduce_scatter_is_psum_scatter(axes, axis):
    # Each device's own [8, 12, 8] block of x: its partial sums of the whole array.
    x = jax.random.normal(jax.random.key(1), (32, 12, 8))
    ring, reference = run(
        lambda a: (ring_reduce_scatter(a, axes, axis),
                   lax.psum_scatter(a, axes, scatter_dimension=axis, tiled=True)),
        x, P(axes), (P(axes), P(axes)))
    np.testing.assert_allclose(ring, reference, rtol=1e-6, atol=1e-6)


def test_ring_sends_one_nth_of_the_array_per_step():
    from jaxpar.inspect.hlo.collectives import parse_collectives

    m = mesh()
    fn = jax.shard_map(lambda a: ring_all_gather(a, ("fsdp",), 0), mesh=m,
                       in_specs=P("fsdp"), out_specs=P(), check_vma=False)
    x = jax.device_put(np.zeros((8, 16), np.float32), NamedSharding(m, P("fsdp")))
    text = jax.jit(fn).lower(x).compile().as_text()
    ops = parse_collectives(text, {"data": 2, "fsdp": 2, "other": 2})
    # One send of a [4, 16] float32 block (the loop of n - 1 = 1 step).
    assert [(c.kind, c.axes, c.bytes) for c in ops] == [("collective-permute", ("fsdp",), 256)]


# --------------------------------------------------------------------------------------------
# parallel.fsdp_gather=ring in a train step: the weights split over tensor too gathered in rings

RING = ("mesh.data=1", "mesh.fsdp=4", "mesh.tensor=2", "parallel.fsdp_gather=ring")


def test_ring_gathered_weights_give_the_single_device_loss_and_gradients():
    got, ref = run_layout(RING), run_layout(("mesh.data=1",))
    assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    assert_grads_and_params_match(got, ref)


def test_ring_gathers_are_sends_over_fsdp_where_all_gathers_were():
    ring = run_layout(RING)["collectives"]
    plain = run_layout(RING[:-1] + ("parallel.fsdp_gather=all_gather",))["collectives"]
    sends = [c for c in ring if c.kind == "collective-permute" and c.axes == ("fsdp",)]
    gathered = sum(c.bytes * c.executions for c in plain
                   if c.kind == "all-gather" and c.axes == ("fsdp",))
    left = sum(c.bytes * c.executions for c in ring
               if c.kind == "all-gather" and c.axes == ("fsdp",))
    sent = sum(c.bytes * c.executions for c in sends)
    # Each gather of n = 4 becomes 3 sends of a quarter: 3/4 of the bytes, as a ring sends.
    assert sends and sent == pytest.approx(0.75 * (gathered - left), rel=0.01)
