"""jaxpar.inspect.hlo: collectives, replica groups and buffers read from hand-written HLO text
(nothing compiled; programs compiled by XLA:CPU: ``tests/equivalence/test_hlo_compiled.py``)."""

import pytest
from helpers import only_collective as only

from jaxpar.inspect.hlo.buffers import largest_arrays
from jaxpar.inspect.hlo.collectives import (
    Collective,
    parse_collectives,
    summarize_collectives,
)
from jaxpar.inspect.hlo.groups import parse_groups

MESH = {"data": 2, "tensor": 4}
MESH_5D = {"pipe": 1, "data": 2, "fsdp": 1, "expert": 1, "context": 1, "tensor": 4}


def module(body: str, *computations: str, partitions: int = 8) -> str:
    """An SPMD module: the entry computation `body` plus any called computations."""
    called = "\n\n".join(computations)
    return (
        f"HloModule m, is_scheduled=true, num_partitions={partitions}\n\n"
        f"%add (a: f32[], b: f32[]) -> f32[] {{\n"
        f"  %a = f32[] parameter(0)\n  %b = f32[] parameter(1)\n"
        f"  ROOT %s = f32[] add(%a, %b)\n}}\n\n"
        f"{called}\n\nENTRY %main {{\n{body}\n}}\n"
    )


# ------------------------------------------------------------------------------------------
# Hand-written snippets
# ------------------------------------------------------------------------------------------


def test_tuple_shaped_all_to_all_counts_every_operand_once():
    text = module(
        "  %p = f32[4,8]{1,0} parameter(0)\n"
        "  %s0 = f32[1,8]{1,0} slice(%p), slice={[0:1], [0:8]}\n"
        "  %s1 = f32[1,8]{1,0} slice(%p), slice={[1:2], [0:8]}\n"
        "  %s2 = f32[1,8]{1,0} slice(%p), slice={[2:3], [0:8]}\n"
        "  %s3 = f32[1,8]{1,0} slice(%p), slice={[3:4], [0:8]}\n"
        "  %all-to-all = (f32[1,8]{1,0}, f32[1,8]{1,0}, f32[1,8]{1,0}, f32[1,8]{1,0}) "
        "all-to-all(%s0, %s1, %s2, %s3), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}\n"
        "  ROOT %g = f32[1,8]{1,0} get-tuple-element(%all-to-all), index=0"
    )
    c = only(parse_collectives(text, MESH))
    assert (c.kind, c.lowered_as, c.dtype) == ("all-to-all", "all-to-all", "f32")
    assert c.bytes == 4 * 8 * 4  # the operands, not the tuple twice nor one element
    assert c.wire_bytes == c.bytes * 3 // 4
    assert (c.group_size, c.axes) == (4, ("tensor",))


def test_async_all_gather_start_done_is_one_collective_of_gathered_bytes():
    layout = "{1,0:T(8,128)(2,1)S(1)}"
    text = module(
        f"  %p = bf16[4,128]{layout} parameter(0)\n"
        f"  %ags = (bf16[4,128]{layout}, bf16[16,128]{layout}) "
        f"all-gather-start(bf16[4,128]{layout} %p), channel_id=1, replica_groups=[2,4]<=[8], "
        f"dimensions={{0}}, use_global_device_ids=true, "
        f'metadata={{op_name="all-gather(weird) = x all-reduce("}}\n'
        f"  ROOT %agd = bf16[16,128]{layout} all-gather-done(%ags)"
    )
    c = only(parse_collectives(text, MESH))
    assert (c.kind, c.lowered_as, c.name) == ("all-gather", "all-gather-start", "ags")
    assert c.bytes == 16 * 128 * 2  # gathered result
    assert c.wire_bytes == c.bytes * 3 // 4
    assert (c.dtype, c.axes) == ("bf16", ("tensor",))


@pytest.mark.parametrize(
    ("dtype", "nbytes"),
    [
        ("pred", 6),
        ("s4", 3),
        ("u4", 3),
        ("s8", 6),
        ("u8", 6),
        ("f8e4m3fn", 6),
        ("f8e5m2", 6),
        ("bf16", 12),
        ("f16", 12),
        ("s16", 12),
        ("u16", 12),
        ("f32", 24),
        ("s32", 24),
        ("u32", 24),
        ("f64", 48),
        ("s64", 48),
        ("u64", 48),
        ("c64", 48),
        ("c128", 96),
    ],
)
def test_payload_bytes_follow_element_width(dtype, nbytes):
    text = module(
        f"  %p = {dtype}[2,3]{{1,0:T(2,128)}} parameter(0)\n"
        f"  ROOT %ar = {dtype}[2,3]{{1,0:T(2,128)}} all-reduce(%p), channel_id=1, "
        f"replica_groups={{{{0,4}},{{1,5}},{{2,6}},{{3,7}}}}, use_global_device_ids=true, "
        f"to_apply=%add"
    )
    c = only(parse_collectives(text, MESH))
    assert (c.dtype, c.bytes, c.axes) == (dtype, nbytes, ("data",))
    assert c.wire_bytes == nbytes  # 2(N-1)/N with N=2


def test_mixed_tuple_all_reduce_sums_operands_and_names_every_dtype_most_bytes_first():
    text = module(
        "  %a = s8[7]{0} parameter(0)\n  %b = bf16[3,5]{1,0} parameter(1)\n"
        "  %c = pred[9]{0} parameter(2)\n"
        "  ROOT %ar = (s8[7]{0}, bf16[3,5]{1,0}, pred[9]{0}) all-reduce(%a, %b, %c), "
        "channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, use_global_device_ids=true, "
        "to_apply=%add"
    )
    c = only(parse_collectives(text, MESH))
    assert (c.bytes, c.dtype) == (7 + 30 + 9, "bf16+pred+s8")


@pytest.mark.parametrize(
    ("groups", "axes", "size"),
    [
        ("[2,4]<=[8]", ("tensor",), 4),
        ("[4,2]<=[2,4]T(1,0)", ("data",), 2),
        ("[1,8]<=[8]", ("data", "tensor"), 8),
        ("{{0,1,2,3},{4,5,6,7}}", ("tensor",), 4),
        ("{{0,4},{1,5},{2,6},{3,7}}", ("data",), 2),
        # jax 0.10 names the mesh of the sharding's tile assignment, not the user's mesh.
        ("mesh['axis_0'=2,'axis_1'=1,'axis_2'=4] {'axis_0'}", ("data",), 2),
        ("mesh['axis_0'=2,'axis_1'=1,'axis_2'=4] {'axis_2'}", ("tensor",), 4),
        ("mesh['axis_0'=8] {'axis_0':(2)4}", ("tensor",), 4),
        ("mesh['axis_0'=4,'axis_1'=2], device_ids=([2,4]T(1,0)) {'axis_1'}", ("data",), 2),
    ],
)
def test_replica_groups_map_to_axes_of_asymmetric_mesh(groups, axes, size):
    text = module(
        "  %p = f32[16]{0} parameter(0)\n"
        f"  ROOT %ar = f32[16]{{0}} all-reduce(%p), channel_id=1, replica_groups={groups}, "
        "use_global_device_ids=true, to_apply=%add"
    )
    c = only(parse_collectives(text, MESH))
    assert (c.axes, c.group_size) == (axes, size)
    assert c.wire_bytes == 64 * 2 * (size - 1) // size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # XLA's own expansions (replica_group_test.cc, tile_assignment semantics).
        ("[4,2]<=[2,4]T(1,0)", [[0, 4], [1, 5], [2, 6], [3, 7]]),
        ("[2,4]<=[2,2,2]T(1,0,2)", [[0, 1, 4, 5], [2, 3, 6, 7]]),
        ("mesh['a'=8] {'a':(1)2,'a':(4)2}", [[0, 1, 4, 5], [2, 3, 6, 7]]),
        ("mesh['a'=6,'b'=6] {'b':(1)3}", [[0, 2, 4], [1, 3, 5]]),
        ("mesh['a'=6,'b'=6] {'a':(1)2}", [[0, 18], [1, 19]]),
        ("mesh[x=2,y=2], device_ids=(3,1,0,2) {x}", [[3, 0], [1, 2]]),
        ("@mesh<u=2,v=2> {u,v}", [[0, 1, 2, 3]]),
        ("{}", None),
    ],
)
def test_replica_group_forms_expand_like_xla(text, expected):
    groups = parse_groups(text)
    assert groups == expected if expected is None else groups[: len(expected)] == expected


def test_empty_replica_groups_span_every_axis_larger_than_one():
    text = module(
        "  %p = f32[8]{0} parameter(0)\n"
        "  ROOT %ar = f32[8]{0} all-reduce(%p), channel_id=1, replica_groups={}, "
        "use_global_device_ids=true, to_apply=%add"
    )
    c = only(parse_collectives(text, MESH_5D))
    assert (c.axes, c.group_size) == (("data", "tensor"), 8)


def test_collective_permute_ring_along_one_axis():
    pairs = ",".join(f"{{{b + i},{b + (i + 1) % 4}}}" for b in (0, 4) for i in range(4))
    text = module(
        "  %p = f32[4,4]{1,0} parameter(0)\n"
        f"  ROOT %cp = f32[4,4]{{1,0}} collective-permute(%p), channel_id=1, "
        f"source_target_pairs={{{pairs}}}"
    )
    c = only(parse_collectives(text, MESH_5D))
    assert (c.kind, c.axes, c.group_size) == ("collective-permute", ("tensor",), 4)
    assert c.bytes == c.wire_bytes == 64


def test_physical_device_ids_of_other_processes_map_through_device_ids():
    # Ids outside range(n) cannot be logical; they are looked up in device_ids.
    text = module(
        "  %p = f32[8]{0} parameter(0)\n"
        "  ROOT %ar = f32[8]{0} all-reduce(%p), replica_groups={{0,2048},{1,2049}}, "
        "to_apply=%add",
        partitions=4,
    )
    c = only(parse_collectives(text, {"data": 2, "tensor": 2}, device_ids=[0, 1, 2048, 2049]))
    assert c.axes == ("data",)


# The gradient-like pattern XLA:CPU emits for a reduction whose output is sharded (captured
# from jax 0.10.2): the all-reduce feeds a fusion that only dynamic-slices it.
_SLICE_FUSION = """%fused_slice (param_0: f32[16], param_1: u32[8], param_2: u32[]) -> f32[8] {
  %param_0 = f32[16]{0} parameter(0)
  %param_1 = u32[8]{0} parameter(1)
  %param_2 = u32[] parameter(2)
  %ds.1 = u32[1]{0} dynamic-slice(%param_1, %param_2), dynamic_slice_sizes={1}
  %convert.2 = s32[1]{0} convert(%ds.1)
  %constant.10 = s32[1]{0} constant({8})
  %multiply.3 = s32[1]{0} multiply(%convert.2, %constant.10)
  %bitcast.1 = s32[] bitcast(%multiply.3)
  ROOT %ds.3 = f32[8]{0} dynamic-slice(%param_0, %bitcast.1), dynamic_slice_sizes={8}
}"""
_AR_INTO_FUSION = """  %partition-id = u32[] partition-id()
  %p = f32[16]{0} parameter(0)
  %table = u32[8]{0} constant({0, 0, 0, 0, 1, 1, 1, 1})
  %all-reduce = f32[16]{0} all-reduce(%p), channel_id=1, replica_groups={{0,4},{1,5},{2,6},{3,7}}, use_global_device_ids=true, to_apply=%add
  %bitcast_dynamic-slice_fusion = f32[8]{0} fusion(%all-reduce, %table, %partition-id), kind=kLoop, calls=%fused_slice"""  # noqa: E501


def test_all_reduce_cut_to_local_shard_is_a_reduce_scatter():
    text = module(
        _AR_INTO_FUSION + "\n  ROOT %r = f32[8]{0} copy(%bitcast_dynamic-slice_fusion)",
        _SLICE_FUSION,
    )
    c = only(parse_collectives(text, MESH))
    assert (c.kind, c.lowered_as) == ("reduce-scatter", "all-reduce+dynamic-slice")
    assert (c.bytes, c.axes, c.group_size) == (64, ("data",), 2)
    assert c.wire_bytes == 64  # it really moves an all-reduce's 2(N-1)/N, not (N-1)/N


def test_all_reduce_sliced_through_bitcast_is_a_reduce_scatter():
    text = module(
        "  %pid = u32[] partition-id()\n  %p = f32[4,8]{1,0} parameter(0)\n"
        "  %ar = f32[4,8]{1,0} all-reduce(%p), channel_id=1, replica_groups=[2,4]<=[8], "
        "use_global_device_ids=true, to_apply=%add\n"
        "  %bc = f32[32]{0} bitcast(%ar)\n  %off = s32[] convert(%pid)\n"
        "  ROOT %ds = f32[8]{0} dynamic-slice(%bc, %off), dynamic_slice_sizes={8}"
    )
    c = only(parse_collectives(text, MESH))
    assert (c.kind, c.axes) == ("reduce-scatter", ("tensor",))


def test_combined_all_reduce_sliced_per_tuple_element_is_a_reduce_scatter():
    text = module(
        "  %pid = s32[] parameter(2)\n"
        "  %a = f32[8]{0} parameter(0)\n  %b = bf16[4,4]{1,0} parameter(1)\n"
        "  %ar = (f32[8]{0}, bf16[4,4]{1,0}) all-reduce(%a, %b), channel_id=1, "
        "replica_groups=[4,2]<=[2,4]T(1,0), use_global_device_ids=true, to_apply=%add\n"
        "  %g0 = f32[8]{0} get-tuple-element(%ar), index=0\n"
        "  %g1 = bf16[4,4]{1,0} get-tuple-element(%ar), index=1\n"
        "  %d0 = f32[4]{0} dynamic-slice(%g0, %pid), dynamic_slice_sizes={4}\n"
        "  %d1 = bf16[2,4]{1,0} dynamic-slice(%g1, %pid, %pid), dynamic_slice_sizes={2,4}\n"
        "  ROOT %t = (f32[4]{0}, bf16[2,4]{1,0}) tuple(%d0, %d1)"
    )
    c = only(parse_collectives(text, MESH))
    # equal bytes of each: the first operand's dtype first
    assert (c.kind, c.axes, c.bytes, c.dtype) == ("reduce-scatter", ("data",), 32 + 32,
                                                  "f32+bf16")


def test_combined_all_reduce_is_split_into_its_sliced_and_whole_elements():
    # XLA's combiner merges a scalar loss all-reduce with gradients that are only sliced.
    text = module(
        "  %pid = s32[] parameter(2)\n"
        "  %a = f32[8]{0} parameter(0)\n  %s = f32[] parameter(1)\n"
        "  %ar = (f32[8]{0}, f32[]) all-reduce(%a, %s), channel_id=1, "
        "replica_groups=[4,2]<=[2,4]T(1,0), use_global_device_ids=true, to_apply=%add\n"
        "  %g0 = f32[8]{0} get-tuple-element(%ar), index=0\n"
        "  %g1 = f32[] get-tuple-element(%ar), index=1\n"
        "  %d0 = f32[4]{0} dynamic-slice(%g0, %pid), dynamic_slice_sizes={4}\n"
        "  %twice = f32[] add(%g1, %g1)\n"
        "  ROOT %t = (f32[4]{0}, f32[]) tuple(%d0, %twice)"
    )
    cs = parse_collectives(text, MESH)
    assert [(c.kind, c.name, c.bytes, c.axes) for c in cs] == [
        ("reduce-scatter", "ar[0]", 32, ("data",)),
        ("all-reduce", "ar[1]", 4, ("data",)),
    ]


def test_all_reduce_whose_full_result_is_used_stays_an_all_reduce():
    text = module(
        _AR_INTO_FUSION + "\n  %twice = f32[16]{0} add(%all-reduce, %all-reduce)\n"
        "  ROOT %t = (f32[8]{0}, f32[16]{0}) tuple(%bitcast_dynamic-slice_fusion, %twice)",
        _SLICE_FUSION,
    )
    c = only(parse_collectives(text, MESH))
    assert (c.kind, c.lowered_as, c.wire_bytes) == ("all-reduce", "all-reduce", 64)


def test_all_reduce_used_inside_a_fusion_beyond_the_slice_stays_an_all_reduce():
    fusion = _SLICE_FUSION.replace(
        "  ROOT %ds.3 = f32[8]{0} dynamic-slice(%param_0, %bitcast.1), dynamic_slice_sizes={8}",
        "  %ds.3 = f32[8]{0} dynamic-slice(%param_0, %bitcast.1), dynamic_slice_sizes={8}\n"
        "  %sum = f32[] reduce(%param_0, %param_0), dimensions={0}, to_apply=%add\n"
        "  ROOT %t = (f32[8]{0}, f32[]) tuple(%ds.3, %sum)",
    ).replace("-> f32[8] {", "-> (f32[8], f32[]) {")
    text = module(_AR_INTO_FUSION.replace("f32[8]{0} fusion", "(f32[8]{0}, f32[]) fusion"), fusion)
    assert only(parse_collectives(text, MESH)).kind == "all-reduce"


def test_slice_keeping_more_than_one_shard_stays_an_all_reduce():
    # A 4-way reduction of which each device keeps half is not a reduce-scatter.
    text = module(
        "  %pid = u32[] partition-id()\n  %p = f32[16]{0} parameter(0)\n"
        "  %ar = f32[16]{0} all-reduce(%p), channel_id=1, replica_groups=[2,4]<=[8], "
        "use_global_device_ids=true, to_apply=%add\n"
        "  ROOT %ds = f32[8]{0} dynamic-slice(%ar, %pid), dynamic_slice_sizes={8}"
    )
    assert only(parse_collectives(text, MESH)).kind == "all-reduce"


# The TPU compiler's FSDP weight gather on a v5p 4x4x4 slice (libtpu 0.0.42.1, trimmed): no
# all-gather, but each device's shard written into zeros by a fused dynamic-update-slice and
# summed by an all-reduce over the fsdp devices.
_PADDED_FUSION = """%fused_pad (param_0.1: bf16[1,64,16], param_1.1: u32[], param_2.1: bf16[2,16,16], param_3.1: s32[]) -> bf16[1,64,16] {
  %param_0.1 = bf16[1,64,16]{2,1,0:T(8,128)(2,1)} parameter(0)
  %param_2.1 = bf16[2,16,16]{2,1,0:T(8,128)(2,1)S(1)} parameter(2)
  %param_3.1 = s32[]{:T(128)} parameter(3)
  %constant.1 = s32[]{:T(128)} constant(0)
  %dynamic-slice.1 = bf16[1,16,16]{2,1,0:T(8,128)(2,1)} dynamic-slice(%param_2.1, %param_3.1, %constant.1, %constant.1), dynamic_slice_sizes={1,16,16}
  %constant.2 = u32[]{:T(128)} constant(0)
  %param_1.1 = u32[]{:T(128)S(6)} parameter(1)
  ROOT %dynamic-update-slice.1 = bf16[1,64,16]{2,1,0:T(8,128)(2,1)} dynamic-update-slice(%param_0.1, %dynamic-slice.1, %constant.2, %param_1.1, %constant.2)
}"""  # noqa: E501


def _padded_gather(zero: str = "0", shard_rows: int = 16) -> str:
    fusion = (_PADDED_FUSION.replace("[2,16,16]", f"[2,{shard_rows},16]")
              .replace("[1,16,16]", f"[1,{shard_rows},16]")
              .replace("={1,16,16}", f"={{1,{shard_rows},16}}"))
    return module(
        f"  %w = bf16[2,{shard_rows},16]{{2,1,0}} parameter(0)\n  %layer = s32[] parameter(1)\n"
        "  %off = u32[] partition-id()\n"
        f"  %constant.371..sunk.1 = bf16[]{{:T(256)}} constant({zero})\n"
        "  %broadcast.5 = bf16[1,64,16]{2,1,0} broadcast(%constant.371..sunk.1), dimensions={}\n"
        "  %fusion.421 = bf16[1,64,16]{2,1,0} fusion(%broadcast.5, %off, %w, %layer), "
        "kind=kLoop, calls=%fused_pad\n"
        "  ROOT %all-reduce.144 = bf16[1,64,16]{2,1,0} all-reduce(%fusion.421), channel_id=8, "
        "replica_groups=mesh['axis_0'=1,'axis_1'=4,'axis_2'=1] {'axis_1'}, "
        "use_global_device_ids=true, to_apply=%add",
        fusion,
        partitions=4,
    )


def test_all_reduce_of_shards_written_into_zeros_is_an_all_gather():
    c = only(parse_collectives(_padded_gather(), {"fsdp": 4}))
    assert (c.kind, c.lowered_as, c.axes) == (
        "all-gather", "all-reduce+dynamic-update-slice", ("fsdp",))
    assert (c.bytes, c.dtype) == (64 * 16 * 2, "bf16")  # the gathered result, as all-gather's
    assert c.wire_bytes == c.bytes * 2 * 3 // 4  # but it runs as an all-reduce


def test_all_reduce_of_a_padded_shard_is_a_sum_unless_padded_with_zeros_one_nth_each():
    assert only(parse_collectives(_padded_gather(zero="1"), {"fsdp": 4})).kind == "all-reduce"
    # each device writes half the array: the writes overlap, so the sum is no gather
    assert only(parse_collectives(_padded_gather(shard_rows=32), {"fsdp": 4})).kind == "all-reduce"


def test_padded_f32_shards_summed_into_a_bf16_result_gather_the_bf16_result():
    # The embedding table on v5p 4x4x4: the f32 master shard padded at top level, the cast to
    # bf16 moved into the all-reduce (its result is bf16), here combined with a real sum.
    text = module(
        "  %p = f32[8,4]{1,0} parameter(0)\n  %loss = f32[] parameter(1)\n"
        "  %off = u32[] partition-id()\n  %z = f32[] constant(0)\n"
        "  %copy.1 = f32[] copy(%z)\n"
        "  %broadcast.1 = f32[8,16]{1,0} broadcast(%copy.1), dimensions={}\n"
        "  %dus = f32[8,16]{1,0} dynamic-update-slice(%broadcast.1, %p, %z, %off)\n"
        "  ROOT %ar = (bf16[8,16]{1,0}, f32[]) all-reduce(%dus, %loss), channel_id=31, "
        "replica_groups=[1,4]<=[4], use_global_device_ids=true, to_apply=%add",
        partitions=4,
    )
    cs = parse_collectives(text, {"fsdp": 4})
    assert [(c.kind, c.name, c.dtype, c.bytes) for c in cs] == [
        ("all-gather", "ar[0]", "bf16", 8 * 16 * 2),
        ("all-reduce", "ar[1]", "f32", 4),
    ]


def test_tpu_all_reduce_scatter_fusion_is_one_reduce_scatter():
    # Trimmed from a v5e:2x4 compile (libtpu 0.0.42.1) of a data-sharded sum.
    tiled = "{1,0:T(8,128)(2,1)}"
    called = f"""%all-reduce-scatter (input: bf16[2048,1024]) -> bf16[1024,1024] {{
  %input = bf16[2048,1024]{{1,0:T(8,128)(2,1)S(1)}} parameter(0)
  %all-reduce.1 = bf16[2048,1024]{tiled} all-reduce(%input), channel_id=1, replica_groups={{{{0,4}},{{1,5}},{{2,6}},{{3,7}}}}, use_global_device_ids=true, to_apply=%add, frontend_attributes={{from-cross-replica-sharding="true"}}, backend_config={{"flag_configs":[]}}
  %constant.shard_id_table = u32[8]{{0:T(128)}} constant({{0, 0, 0, 0, 1, 1, 1, 1}})
  %partition-id.1 = u32[] partition-id()
  %dynamic-slice.3 = u32[1]{{0:T(128)}} dynamic-slice(%constant.shard_id_table, %partition-id.1), dynamic_slice_sizes={{1}}
  %bitcast.1 = u32[]{{:T(128)}} bitcast(%dynamic-slice.3)
  %constant.12 = u32[] constant(1024)
  %multiply.3 = u32[]{{:T(128)}} multiply(%bitcast.1, %constant.12)
  %constant.13 = u32[] constant(0)
  ROOT %dynamic-slice.4 = bf16[1024,1024]{tiled} dynamic-slice(%all-reduce.1, %multiply.3, %constant.13), dynamic_slice_sizes={{1024,1024}}
}}"""  # noqa: E501
    text = module(
        f"  %reduce.1 = bf16[2048,1024]{{1,0:T(8,128)(2,1)S(1)}} parameter(0)\n"
        f"  ROOT %fusion = bf16[1024,1024]{tiled} fusion(%reduce.1), kind=kCustom, "
        f'calls=%all-reduce-scatter, backend_config={{"collective_algorithm_config":'
        f'{{"emitter":"SingleInputAllReduceScatterFusion","debug":"\\n(x)"}}}}',
        called,
    )
    c = only(parse_collectives(text, MESH))
    assert (c.kind, c.lowered_as, c.name) == (
        "reduce-scatter",
        "all-reduce-scatter-fusion",
        "fusion",
    )
    assert (c.dtype, c.bytes, c.axes, c.group_size) == ("bf16", 2048 * 1024 * 2, ("data",), 2)
    assert c.wire_bytes == c.bytes // 2  # a real reduce-scatter: (N-1)/N


@pytest.mark.parametrize("rows_in, rows_out", [(64, 256), (256, 64)],
                         ids=["dispatch", "combine"])
def test_ragged_all_to_all_payload_is_the_smaller_of_its_buffers(rows_in, rows_out):
    # One of the two buffers is sized for the worst case (every row to one device); on
    # average a device moves at most the smaller: the rows it sends, or those it gets back.
    text = module(
        f"  %in = bf16[{rows_in},32]{{1,0}} parameter(0)\n"
        f"  %out = bf16[{rows_out},32]{{1,0}} parameter(1)\n"
        "  %io = s64[4]{0} parameter(2)\n  %ss = s64[4]{0} parameter(3)\n"
        "  %oo = s64[4]{0} parameter(4)\n  %rs = s64[4]{0} parameter(5)\n"
        f"  ROOT %r = bf16[{rows_out},32]{{1,0}} ragged-all-to-all(%in, %out, %io, %ss, %oo, "
        "%rs), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}"
    )
    c = only(parse_collectives(text, MESH))
    assert (c.kind, c.bytes, c.wire_bytes, c.axes) == (
        "ragged-all-to-all",
        64 * 32 * 2,
        64 * 32 * 2 * 3 // 4,
        ("tensor",),
    )


# A scanned loop: an all-reduce in the body, `i < N` in the condition.
_LOOP_BODY_AND_CONDITION = """%body (t: (s32[], f32[8])) -> (s32[], f32[8]) {
  %t = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %x = f32[8]{0} get-tuple-element(%t), index=1
  %ar = f32[8]{0} all-reduce(%x), channel_id=1, replica_groups=[2,4]<=[8], use_global_device_ids=true, to_apply=%add
  ROOT %out = (s32[], f32[8]{0}) tuple(%i, %ar)
}

%cond (t: (s32[], f32[8])) -> pred[] {
  %n = s32[]{:T(128)} constant(N)
  %t = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}"""  # noqa: E501


def test_collective_in_while_body_runs_once_per_known_iteration():
    body = _LOOP_BODY_AND_CONDITION.replace("constant(N)", "constant(3)")
    loop = ("  %init = (s32[], f32[8]{0}) parameter(0)\n"
            "  ROOT %w = (s32[], f32[8]{0}) while(%init), condition=%cond, body=%body")
    known = ', backend_config={"known_trip_count":{"n":"3"}}'
    c = only(parse_collectives(module(loop + known, body), MESH))
    assert (c.kind, c.axes, c.executions) == ("all-reduce", ("tensor",), 3)  # not sliced
    (row,) = summarize_collectives([c])
    assert (row["count"], row["instructions"], row["bytes"]) == (3, 1, 3 * 32)
    # Without a known trip count the loop body is counted once.
    assert only(parse_collectives(module(loop, body), MESH)).executions == 1


def test_nested_loops_multiply_their_trip_counts():
    inner = """%inner (t: f32[8]) -> f32[8] {
  %t = f32[8]{0} parameter(0)
  ROOT %ar = f32[8]{0} all-reduce(%t), channel_id=1, replica_groups=[2,4]<=[8], use_global_device_ids=true, to_apply=%add
}

%outer (t: f32[8]) -> f32[8] {
  %t = f32[8]{0} parameter(0)
  ROOT %w = f32[8]{0} while(%t), condition=%cond, body=%inner, backend_config={"known_trip_count":{"n":"4"}}
}

%cond (t: f32[8]) -> pred[] {
  %t = f32[8]{0} parameter(0)
  ROOT %c = pred[] constant(true)
}"""  # noqa: E501
    text = module(
        "  %x = f32[8]{0} parameter(0)\n"
        '  ROOT %w = f32[8]{0} while(%x), condition=%cond, body=%outer, '
        'backend_config={"known_trip_count":{"n":"2"}}',
        inner,
    )
    assert only(parse_collectives(text, MESH)).executions == 8


def test_summary_has_one_row_per_kind_and_axes():
    def c(kind, axes, nbytes, lowered_as):
        return Collective(kind, lowered_as, "x", "f32", nbytes, nbytes // 2, 2, axes)

    rows = summarize_collectives(
        [
            c("reduce-scatter", ("data",), 8, "reduce-scatter"),
            c("all-reduce", ("tensor",), 4, "all-reduce"),
            c("reduce-scatter", ("data",), 16, "all-reduce+dynamic-slice"),
            c("all-reduce", ("data", "tensor"), 2, "all-reduce-start"),
            c("reduce-scatter", ("data",), 8, "reduce-scatter"),
        ]
    )
    assert rows == [
        {
            "kind": "all-reduce",
            "count": 1,
            "instructions": 1,
            "bytes": 2,
            "wire_bytes": 1,
            "axes": ["data", "tensor"],
            "lowered_as": ["all-reduce-start"],
            "dtypes": ["f32"],
        },
        {
            "kind": "all-reduce",
            "count": 1,
            "instructions": 1,
            "bytes": 4,
            "wire_bytes": 2,
            "axes": ["tensor"],
            "lowered_as": ["all-reduce"],
            "dtypes": ["f32"],
        },
        {
            "kind": "reduce-scatter",
            "count": 3,
            "instructions": 3,
            "bytes": 32,
            "wire_bytes": 16,
            "axes": ["data"],
            "lowered_as": ["all-reduce+dynamic-slice", "reduce-scatter"],
            "dtypes": ["f32"],
        },
    ]


# ------------------------------------------------------------------------------------------
# Real programs compiled by XLA:CPU on a (data=2, tensor=4) mesh
# ------------------------------------------------------------------------------------------


def test_instruction_wrapped_over_lines_is_read_whole():
    # The layout of XLA's documentation (shapes.md), with an all-gather in place of the fusion.
    text = module(
        "  %fusion.32 = bf16[4,128]{1,0:T(8,128)(2,1)S(1)} parameter(0)\n"
        "  ROOT %ag = bf16[16,128]{1,0:T(8,128)(2,1)S(1)}\n"
        "            all-gather(bf16[4,128]{1,0:T(8,128)(2,1)S(1)} %fusion.32),\n"
        "            channel_id=1, replica_groups=[2,4]<=[8], dimensions={0},\n"
        "            use_global_device_ids=true"
    )
    c = only(parse_collectives(text, MESH))
    assert (c.kind, c.bytes, c.axes) == ("all-gather", 16 * 128 * 2, ("tensor",))


def test_loop_without_known_trip_count_reads_i_less_than_n_from_its_condition():
    # TPU's compiler records no known_trip_count; scan's loop is `for (i = 0; i < 4; i++)`.
    body = _LOOP_BODY_AND_CONDITION.replace("constant(N)", "constant(4)")
    loop = ("  %zero = s32[] constant(0)\n  %start = s32[]{:T(128)} copy(%zero)\n"
            "  %x = f32[8]{0} parameter(0)\n"
            "  %init = (s32[], f32[8]{0}) tuple(%start, %x)\n"
            "  ROOT %w = (s32[], f32[8]{0}) while(%init), condition=%cond, body=%body")
    assert only(parse_collectives(module(loop, body), MESH)).executions == 4
    # A counter that starts at another constant runs from there (libtpu 0.0.52's post-SPMD
    # collective matmuls run their first step before the loop); one that starts at no
    # constant is not guessed at.
    from_one = loop.replace("constant(0)", "constant(1)")
    assert only(parse_collectives(module(from_one, body), MESH)).executions == 3
    unknown = loop.replace("copy(%zero)", "parameter(1)")
    assert only(parse_collectives(module(unknown, body), MESH)).executions == 1


def test_loop_whose_body_adds_k_to_its_counter_runs_n_over_k_times():
    # TPU's windowed-einsum loops (collective matmuls) are unrolled by two: `i < 16`, `i += 2`
    # runs 8 times, not 16 (tpu-v5p:4x4x2, fsdp=32: the weight-gradient permute rings).
    def loop(bound: int, step: int, reversed_add: bool = False) -> str:
        add = "add(%two, %i)" if reversed_add else "add(%i, %two)"
        body = (_LOOP_BODY_AND_CONDITION.replace("constant(N)", f"constant({bound})")
                .replace("  ROOT %out = (s32[], f32[8]{0}) tuple(%i, %ar)",
                         f"  %two = s32[]{{:T(128)}} constant({step})\n"
                         f"  %next = s32[]{{:T(128)}} {add}\n"
                         "  ROOT %out = (s32[], f32[8]{0}) tuple(%next, %ar)"))
        entry = ("  %zero = s32[] constant(0)\n  %x = f32[8]{0} parameter(0)\n"
                 "  %init = (s32[], f32[8]{0}) tuple(%zero, %x)\n"
                 "  ROOT %w = (s32[], f32[8]{0}) while(%init), condition=%cond, body=%body")
        return module(entry, body)

    assert only(parse_collectives(loop(16, 2), MESH)).executions == 8
    assert only(parse_collectives(loop(16, 2, reversed_add=True), MESH)).executions == 8
    assert only(parse_collectives(loop(5, 2), MESH)).executions == 3  # i = 0, 2, 4
    assert only(parse_collectives(loop(4, 1), MESH)).executions == 4


def test_one_channel_placed_in_several_computations_is_one_collective():
    # TPU places an async all-gather in its start fusion and in the fusions it overlaps with.
    start = """%start_fusion (p: f32[4]) -> f32[16] {
  %p = f32[4]{0} parameter(0)
  ROOT %ag = f32[16]{0} all-gather(%p), channel_id=7, replica_groups=[2,4]<=[8], dimensions={0}, use_global_device_ids=true
}

%overlap_fusion (p: f32[4]) -> f32[16] {
  %p = f32[4]{0} parameter(0)
  ROOT %ag.1 = f32[16]{0} all-gather(%p), channel_id=7, replica_groups=[2,4]<=[8], dimensions={0}, use_global_device_ids=true
}"""  # noqa: E501
    text = module(
        "  %x = f32[4]{0} parameter(0)\n"
        "  %a = f32[16]{0} fusion(%x), kind=kCustom, calls=%start_fusion\n"
        "  %b = f32[16]{0} fusion(%x), kind=kCustom, calls=%overlap_fusion\n"
        "  ROOT %t = (f32[16]{0}, f32[16]{0}) tuple(%a, %b)",
        start,
    )
    c = only(parse_collectives(text, MESH))
    assert (c.kind, c.bytes, c.axes) == ("all-gather", 64, ("tensor",))


def test_unfused_collectives_sharing_a_channel_id_are_all_counted():
    # XLA:CPU gives every ppermute of a shard_map channel_id=1.
    pairs = "source_target_pairs={{0,4},{4,0},{1,5},{5,1},{2,6},{6,2},{3,7},{7,3}}"
    text = module(
        "  %x = f32[4]{0} parameter(0)\n"
        f"  %a = f32[4]{{0}} collective-permute(%x), channel_id=1, {pairs}\n"
        f"  ROOT %b = f32[4]{{0}} collective-permute(%a), channel_id=1, {pairs}"
    )
    assert len(parse_collectives(text, MESH)) == 2


def test_largest_arrays_are_buffers_outside_fusions_biggest_first():
    hlo = """HloModule m, entry_computation_layout={()->f32[8]}

%fused_computation (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  %huge = f32[4096,4096]{1,0} broadcast(f32[8]{0} %p), dimensions={}
  ROOT %r = f32[8]{0} slice(f32[4096,4096]{1,0} %huge), slice={[0:8], [0:1]}
}

ENTRY %main (a: f32[1024,1024]) -> f32[8] {
  %a = f32[1024,1024]{1,0} parameter(0)
  %t = f32[1024,1024]{0,1} transpose(f32[1024,1024]{1,0} %a), dimensions={1,0}
  %u = f32[1024,1024]{1,0} add(f32[1024,1024]{1,0} %t, f32[1024,1024]{1,0} %t)
  %b = bf16[512,512]{1,0} convert(f32[512,512]{1,0} %a)
  %v = f32[8]{0} slice(f32[1024,1024]{1,0} %u), slice={[0:8], [0:1]}
  ROOT %f = f32[8]{0} fusion(f32[8]{0} %v), kind=kLoop, calls=%fused_computation
}
"""
    rows = largest_arrays(hlo, count=2)
    # Not the fused broadcast (never a buffer), not the parameter (the caller's buffer).
    assert rows == [
        {"array": "f32[1024,1024]", "bytes": 4 * 2**20, "instructions": 2, "opcode": "transpose"},
        {"array": "bf16[512,512]", "bytes": 2**19, "instructions": 1, "opcode": "convert"}]
