"""Reading any HLO dump (``jaxpar inspect --hlo-file``): the HLO text newer XLA writes
(``%name#k`` tuple-element references, names holding ``#``), the memory of a buffer assignment,
and the ``--mesh`` argument. The command end to end: tests/integration/test_inspect_dump_cli.py."""

from __future__ import annotations

import pytest

from jaxpar.config import ConfigError
from jaxpar.inspect.dump import memory_from_buffers, parse_mesh
from jaxpar.inspect.hlo.collectives import parse_collectives, summarize_collectives

MESH = [("data", 2), ("tensor", 4)]
_ADD = ("%add (a: f32[], b: f32[]) -> f32[] {\n  %a = f32[] parameter(0)\n"
        "  %b = f32[] parameter(1)\n  ROOT %s = f32[] add(%a, %b)\n}\n\n")


def _module(body: str) -> str:
    return f"HloModule m, num_partitions=8\n\n{_ADD}ENTRY %main {{\n{body}\n}}\n"


# A combined all-reduce whose first element is only cut to the local shard (a reduce-scatter)
# and whose second is used whole, with each element read through a get-tuple-element ...
_COMBINED = (
    "  %pid = s32[] parameter(2)\n"
    "  %a = f32[8]{0} parameter(0)\n  %b = f32[4]{0} parameter(1)\n"
    "  %ar = (f32[8]{0}, f32[4]{0}) all-reduce(%a, %b), channel_id=1, "
    "replica_groups=[4,2]<=[2,4]T(1,0), use_global_device_ids=true, to_apply=%add\n")
WITH_GET_TUPLE_ELEMENT = _module(
    _COMBINED
    + "  %g0 = f32[8]{0} get-tuple-element(%ar), index=0\n"
    "  %g1 = f32[4]{0} get-tuple-element(%ar), index=1\n"
    "  %d0 = f32[4]{0} dynamic-slice(%g0, %pid), dynamic_slice_sizes={4}\n"
    "  %twice = f32[4]{0} add(%g1, %g1)\n"
    "  ROOT %t = (f32[4]{0}, f32[4]{0}) tuple(%d0, %twice)")
# ... and the same program as newer XLA may print it: the elements named %ar#0, %ar#1.
WITH_ELEMENT_NAMES = _module(
    _COMBINED
    + "  %d0 = f32[4]{0} dynamic-slice(%ar#0, %pid), dynamic_slice_sizes={4}\n"
    "  %twice = f32[4]{0} add(%ar#1, %ar#1)\n"
    "  ROOT %t = (f32[4]{0}, f32[4]{0}) tuple(%d0, %twice)")


def test_tuple_elements_named_with_hash_read_like_get_tuple_elements():
    old = summarize_collectives(parse_collectives(WITH_GET_TUPLE_ELEMENT, MESH))
    new = summarize_collectives(parse_collectives(WITH_ELEMENT_NAMES, MESH))
    assert new == old
    assert [(r["kind"], r["bytes"]) for r in new] == [("all-reduce", 16),
                                                      ("reduce-scatter", 32)]


def test_values_whose_names_hold_a_hash_are_defined():
    text = _module(
        "  %wide.param.3#1 = f32[8]{0} parameter(0)\n"
        "  ROOT %ar = f32[8]{0} all-reduce(%wide.param.3#1), channel_id=1, "
        "replica_groups={{0,4},{1,5},{2,6},{3,7}}, use_global_device_ids=true, to_apply=%add")
    (row,) = summarize_collectives(parse_collectives(text, MESH))
    assert (row["kind"], row["axes"], row["bytes"]) == ("all-reduce", ["data"], 32)


BUFFERS = """BufferAssignment:
allocation 0: size 400, parameter 0, shape |f32[100]| at ShapeIndex {}, maybe-live-out:
 value: <1 p0 @0> (size=400,offset=0): f32[100]{0}
allocation 1: size 80, parameter 1, shape |f32[20]| at ShapeIndex {}:
 value: <2 p1 @0> (size=80,offset=0): f32[20]{0}
allocation 2: size 12, output shape is |(f32[], f32[2])|, maybe-live-out:
 value: <3 t @0> (size=12,offset=0): (f32[], f32[2])
allocation 3: size 4, constant:
 value: <4 c @0> (size=4,offset=0): f32[]
allocation 4: size 1000, preallocated-temp:
 value: <5 x @0> (size=1000,offset=0): f32[250]{0}
allocation 5: size 64, thread-local:
 value: <6 y @0> (size=64,offset=0): f32[16]{0}
"""


def test_memory_of_a_buffer_assignment_splits_arguments_outputs_aliases_and_temp():
    assert memory_from_buffers(BUFFERS) == {
        "argument_bytes": 480, "output_bytes": 412, "alias_bytes": 400, "temp_bytes": 1000,
        "peak_bytes": 480 + 412 - 400 + 1000, "peak_source": "buffers"}


@pytest.mark.parametrize("text", ["data", "data=0", "data=2,data=4", "data=two", "=2"])
def test_a_bad_mesh_is_refused_in_one_line(text):
    with pytest.raises(ConfigError, match="--mesh"):
        parse_mesh(text)
