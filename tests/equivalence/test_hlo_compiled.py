"""jaxpar.inspect.hlo.collectives on real programs compiled by XLA:CPU on a (data=2, tensor=4)
mesh (hand-written snippets: ``tests/unit/test_hlo_text.py``)."""

import os

# Eight virtual CPU devices, before jax starts its backend (a no-op if another module did first;
# the compiled tests then skip rather than fail).
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from helpers import only_collective as only  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jaxpar.inspect.hlo.collectives import Collective, parse_collectives  # noqa: E402


@pytest.fixture(scope="module")
def mesh() -> Mesh:
    if jax.device_count() < 8:
        pytest.skip("needs 8 (virtual) devices; jax was initialised before this module")
    return jax.make_mesh((2, 4), ("data", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def compiled(mesh: Mesh, f, *args) -> list[Collective]:
    with jax.set_mesh(mesh):
        text = jax.jit(f).lower(*args).compile().as_text()
    return parse_collectives(text, dict(mesh.shape), [d.id for d in mesh.devices.flat])


def put(mesh: Mesh, shape: tuple[int, ...], spec: P) -> jax.Array:
    return jax.device_put(jnp.ones(shape, jnp.float32), NamedSharding(mesh, spec))


def test_compiled_matmul_over_sharded_contraction_all_reduces_over_tensor(mesh):
    x, w = put(mesh, (8, 16), P("data", "tensor")), put(mesh, (16, 32), P("tensor", None))
    c = only(compiled(mesh, lambda x, w: x @ w, x, w))
    assert (c.kind, c.lowered_as, c.axes, c.group_size) == (
        "all-reduce",
        "all-reduce",
        ("tensor",),
        4,
    )
    assert c.bytes == 4 * 32 * 4  # the per-device partial product f32[4,32]


def test_compiled_groups_hold_mesh_positions_not_device_ids(mesh):
    # Device ids [0,2,4,6,1,3,5,7]: were the groups device ids, `tensor` would read as `data`.
    devices = np.array(jax.devices()[:8]).reshape(4, 2).T
    permuted = Mesh(devices, ("data", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    x, w = put(permuted, (8, 16), P("data", "tensor")), put(permuted, (16, 32), P("tensor", None))
    c = only(compiled(permuted, lambda x, w: x @ w, x, w))
    assert (c.kind, c.axes) == ("all-reduce", ("tensor",))


def test_compiled_psum_scatter_is_a_reduce_scatter_over_tensor(mesh):
    f = jax.shard_map(
        lambda a: lax.psum_scatter(a, "tensor", scatter_dimension=1, tiled=True),
        in_specs=P("data", None),
        out_specs=P("data", "tensor"),
    )
    c = only(compiled(mesh, f, put(mesh, (8, 16), P("data", None))))
    assert (c.kind, c.lowered_as, c.axes) == ("reduce-scatter", "reduce-scatter", ("tensor",))
    assert c.bytes == 4 * 16 * 4  # the unscattered input
    assert c.wire_bytes == c.bytes * 3 // 4


def test_compiled_sharded_reduction_is_all_reduce_plus_dynamic_slice_over_data(mesh):
    # XLA:CPU emits all-reduce(f32[16]) over `data` and a fusion that dynamic-slices f32[8].
    x = put(mesh, (8, 16), P("data", None))
    with jax.set_mesh(mesh):
        f = jax.jit(lambda a: a.sum(0), out_shardings=NamedSharding(mesh, P("data")))
        text = f.lower(x).compile().as_text()
    assert " reduce-scatter(" not in text
    c = only(parse_collectives(text, dict(mesh.shape)))
    assert (c.kind, c.lowered_as, c.axes) == (
        "reduce-scatter",
        "all-reduce+dynamic-slice",
        ("data",),
    )
    assert (c.bytes, c.wire_bytes) == (16 * 4, 16 * 4)


def test_compiled_ppermute_ring_is_a_collective_permute_over_data(mesh):
    f = jax.shard_map(
        lambda a: lax.ppermute(a, "data", perm=[(0, 1), (1, 0)]),
        in_specs=P("data", "tensor"),
        out_specs=P("data", "tensor"),
    )
    c = only(compiled(mesh, f, put(mesh, (8, 16), P("data", "tensor"))))
    assert (c.kind, c.axes, c.group_size, c.bytes) == ("collective-permute", ("data",), 2, 64)


def test_compiled_all_to_all_over_tensor(mesh):
    f = jax.shard_map(
        lambda a: lax.all_to_all(a, "tensor", 0, 1, tiled=True),
        in_specs=P("data", "tensor"),
        out_specs=P("data", "tensor"),
    )
    c = only(compiled(mesh, f, put(mesh, (8, 32), P("data", "tensor"))))
    assert (c.kind, c.axes, c.group_size) == ("all-to-all", ("tensor",), 4)
    assert c.bytes == 4 * 8 * 4  # the local f32[4,8], split into a tuple on CPU
