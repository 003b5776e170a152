"""jaxpar.inspect.hlo.overlap: which collectives a schedule hides behind matmuls, read from
hand-written scheduled HLO (nothing compiled; a program compiled for a TPU:
``tests/integration/test_tpu_target.py``)."""

from __future__ import annotations

import pytest
from helpers import only_collective as only
from rich.console import Console

from jaxpar.inspect.dump import dump_report
from jaxpar.inspect.hlo.collectives import parse_collectives, summarize_collectives
from jaxpar.inspect.hlo.flops import dot_flops
from jaxpar.inspect.hlo.megascale import dcn_collectives
from jaxpar.inspect.hlo.overlap import (
    add_overlap,
    collective_windows,
    exposed_by_time,
    overlap_totals,
)
from jaxpar.inspect.report import print_dump

MESH = {"data": 2, "tensor": 4}
TENSOR = "replica_groups=[2,4]<=[8], use_global_device_ids=true"  # groups of 4 over tensor
MATMUL_FLOPS = 2 * 32 * 128 * 64  # one matmul_fusion: [32, 64] x [64, 128]

_ADD = """%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}"""
# How the TPU compiler writes a matmul: a fusion whose computation holds a convolution.
_MATMUL_FUSION = """%matmul_fusion (p0: bf16[32,64], p1: bf16[64,128]) -> f32[32,128] {
  %p0 = bf16[32,64]{1,0} parameter(0)
  %p1 = bf16[64,128]{1,0} parameter(1)
  ROOT %conv = f32[32,128]{1,0} convolution(%p0, %p1), dim_labels=bf_io->bf
}"""
_ELEMENTWISE_FUSION = """%elementwise_fusion (p0: bf16[32,64], p1: bf16[64,128]) -> f32[32,128] {
  %p0 = bf16[32,64]{1,0} parameter(0)
  %p1 = bf16[64,128]{1,0} parameter(1)
  %c = f32[32,64]{1,0} convert(%p0)
  ROOT %b = f32[32,128]{1,0} broadcast(%c), dimensions={0}
}"""
_INPUTS = ("  %w = bf16[16,128]{1,0} parameter(0)\n"
           "  %x = bf16[32,64]{1,0} parameter(1)\n"
           "  %y = bf16[64,128]{1,0} parameter(2)\n")
MATMUL = "f32[32,128]{1,0} fusion(%x, %y), kind=kOutput, calls=%matmul_fusion"
ELEMENTWISE = "f32[32,128]{1,0} fusion(%x, %y), kind=kLoop, calls=%elementwise_fusion"


def module(entry: str, *computations: str) -> str:
    """A scheduled SPMD module on 8 devices: ``entry`` (instruction lines, in schedule order)
    after the shared fusions and any other ``computations``."""
    called = "\n\n".join((_ADD, _MATMUL_FUSION, _ELEMENTWISE_FUSION, *computations))
    return (f"HloModule m, is_scheduled=true, num_partitions=8\n\n{called}\n\n"
            f"ENTRY %main {{\n{entry}\n}}\n")


def all_gather(*between: str, before: str = "", after: str = "") -> str:
    """An async all-gather over tensor (bf16[64,128] gathered), ``between`` its start and done."""
    lines = [_INPUTS.rstrip("\n")]
    lines += [f"  %before = {before}"] if before else []
    lines.append("  %ags = (bf16[16,128]{1,0}, bf16[64,128]{1,0}) all-gather-start(%w), "
                 f"channel_id=1, {TENSOR}, dimensions={{0}}")
    lines += [f"  %between.{i} = {text}" for i, text in enumerate(between)]
    lines.append("  %agd = bf16[64,128]{1,0} all-gather-done(%ags)")
    lines += [f"  %after = {after}"] if after else []
    lines.append("  ROOT %out = bf16[64,128]{1,0} copy(%agd)")
    return module("\n".join(lines))


def row_of(text: str, mesh=MESH) -> dict:
    collectives = parse_collectives(text, mesh)
    rows = summarize_collectives(collectives)
    add_overlap(rows, collectives, text)
    (row,) = rows
    return row


# --------------------------------------------------------------------------------------------
# Start ... done in one computation


def test_all_gather_with_a_matmul_fusion_between_start_and_done_is_hidden():
    text = all_gather(MATMUL)
    window = collective_windows(text)["ags"]
    assert (window.start, window.done, window.matmuls) == ("ags", "agd", ("between.0",))
    assert window.hidden and window.flops == MATMUL_FLOPS
    row = row_of(text)
    assert row["bytes"] == 64 * 128 * 2
    assert (row["hidden_bytes"], row["exposed_bytes"], row["hidden_count"]) == (row["bytes"], 0, 1)
    assert row["window_matmul_flops"] == MATMUL_FLOPS


@pytest.mark.parametrize("window_seconds, exposed_share", [(1.0, 0.0), (0.5, 0.5), (4.0, 0.0)])
def test_time_weighting_hides_the_share_of_the_transfer_the_window_matmuls_take(
        window_seconds, exposed_share):
    text = all_gather(MATMUL)
    (c,) = parse_collectives(text, MESH)
    # The transfer takes one second at this bandwidth; the matmul window_seconds at this peak.
    out = exposed_by_time([c], text, peak_flops=MATMUL_FLOPS / window_seconds,
                          link_bytes_per_s=c.wire_bytes)
    assert out == {("all-gather", ("tensor",), ""): pytest.approx(exposed_share * c.bytes)}


def test_time_weighting_leaves_a_window_without_matmuls_exposed():
    text = all_gather(ELEMENTWISE)
    (c,) = parse_collectives(text, MESH)
    assert exposed_by_time([c], text, 1.0, 1.0) == {("all-gather", ("tensor",), ""): c.bytes}


def test_all_gather_with_only_elementwise_fusions_between_is_exposed():
    row = row_of(all_gather(ELEMENTWISE, ELEMENTWISE))
    assert (row["hidden_bytes"], row["exposed_bytes"]) == (0, row["bytes"])
    assert (row["hidden_count"], row["window_matmul_flops"]) == (0, 0)


def test_matmuls_before_the_start_or_after_the_done_hide_nothing():
    window = collective_windows(all_gather(ELEMENTWISE, before=MATMUL, after=MATMUL))["ags"]
    assert not window.hidden and (window.matmuls, window.flops) == ((), 0)


def test_synchronous_all_reduce_is_exposed_even_beside_a_matmul():
    text = module(_INPUTS
                  + f"  %mm = {MATMUL}\n"
                  f"  %ar = f32[32,128]{{1,0}} all-reduce(%mm), channel_id=1, {TENSOR}, "
                  "to_apply=%add\n"
                  f"  ROOT %mm.1 = {MATMUL}")
    assert collective_windows(text) == {}  # no window: synchronous
    row = row_of(text)
    assert (row["kind"], row["hidden_bytes"]) == ("all-reduce", 0)
    assert row["exposed_bytes"] == row["bytes"] == 32 * 128 * 4


_WRAPPED_REDUCE_SCATTER = f"""%wrapped_reduce_scatter (p: f32[64,128]) -> f32[16,128] {{
  %p = f32[64,128]{{1,0}} parameter(0)
  ROOT %rs = f32[16,128]{{1,0}} reduce-scatter(%p), channel_id=2, {TENSOR}, dimensions={{0}}, to_apply=%add
}}"""  # noqa: E501


@pytest.mark.parametrize("between", [MATMUL, ELEMENTWISE], ids=["matmul", "elementwise"])
def test_async_start_wrapping_a_reduce_scatter_is_one_collective_hidden_by_a_matmul(between):
    # The done names the wrapped computation too (calls=), as XLA may print it: the reduce-scatter
    # still runs once per call, and the window closes at the done reached through the update.
    calls = "calls=%wrapped_reduce_scatter"
    text = module(_INPUTS
                  + "  %g = f32[64,128]{1,0} parameter(3)\n"
                  "  %rs-start = ((f32[64,128]{1,0}), f32[16,128]{1,0}) "
                  f"async-start(%g), {calls}\n"
                  f"  %mm = {between}\n"
                  "  %rs-update = ((f32[64,128]{1,0}), f32[16,128]{1,0}) "
                  f"async-update(%rs-start), {calls}\n"
                  f"  ROOT %rs-done = f32[16,128]{{1,0}} async-done(%rs-update), {calls}",
                  _WRAPPED_REDUCE_SCATTER)
    c = only(parse_collectives(text, MESH))
    assert (c.kind, c.name, c.executions, c.axes) == ("reduce-scatter", "rs", 1, ("tensor",))
    window = collective_windows(text)["rs"]
    assert (window.start, window.done) == ("rs-start", "rs-done")
    row = row_of(text)
    hidden = between == MATMUL
    assert row["hidden_bytes"] == (64 * 128 * 4 if hidden else 0)
    assert row["hidden_bytes"] + row["exposed_bytes"] == row["bytes"] == 64 * 128 * 4


# --------------------------------------------------------------------------------------------
# Loops and calls

# A collective-matmul ring: each iteration sends a chunk round the tensor ring while it
# multiplies, `for (i = 0; i < 4; i++)`.
_RING = """%ring_body (t: (s32[], bf16[16,128], bf16[32,64], bf16[64,128])) -> (s32[], bf16[16,128], bf16[32,64], bf16[64,128]) {
  %t = (s32[], bf16[16,128]{1,0}, bf16[32,64]{1,0}, bf16[64,128]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %chunk = bf16[16,128]{1,0} get-tuple-element(%t), index=1
  %x = bf16[32,64]{1,0} get-tuple-element(%t), index=2
  %y = bf16[64,128]{1,0} get-tuple-element(%t), index=3
  %cps = (bf16[16,128]{1,0}, bf16[16,128]{1,0}, u32[], u32[]) collective-permute-start(%chunk), channel_id=3, source_target_pairs={{0,1},{1,2},{2,3},{3,0},{4,5},{5,6},{6,7},{7,4}}
  %mm = BETWEEN
  %cpd = bf16[16,128]{1,0} collective-permute-done(%cps)
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %out = (s32[], bf16[16,128]{1,0}, bf16[32,64]{1,0}, bf16[64,128]{1,0}) tuple(%next, %cpd, %x, %y)
}

%ring_cond (t: (s32[], bf16[16,128], bf16[32,64], bf16[64,128])) -> pred[] {
  %t = (s32[], bf16[16,128]{1,0}, bf16[32,64]{1,0}, bf16[64,128]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}"""  # noqa: E501
_RING_ENTRY = (_INPUTS + "  %zero = s32[] constant(0)\n"
               "  %init = (s32[], bf16[16,128]{1,0}, bf16[32,64]{1,0}, bf16[64,128]{1,0}) "
               "tuple(%zero, %w, %x, %y)\n"
               "  ROOT %loop = (s32[], bf16[16,128]{1,0}, bf16[32,64]{1,0}, bf16[64,128]{1,0}) "
               "while(%init), condition=%ring_cond, body=%ring_body")


@pytest.mark.parametrize("between", [MATMUL, ELEMENTWISE], ids=["matmul", "elementwise"])
def test_permute_ring_in_a_while_loop_counts_every_iteration(between):
    text = module(_RING_ENTRY, _RING.replace("BETWEEN", between))
    row = row_of(text)
    per_iteration = 16 * 128 * 2
    assert (row["kind"], row["axes"], row["count"]) == ("collective-permute", ["tensor"], 4)
    assert row["bytes"] == 4 * per_iteration
    if between == MATMUL:
        assert (row["hidden_bytes"], row["hidden_count"]) == (4 * per_iteration, 4)
        assert row["window_matmul_flops"] == 4 * MATMUL_FLOPS
    else:
        assert (row["hidden_bytes"], row["exposed_bytes"]) == (0, 4 * per_iteration)


_DOT_LOOP = """%dot_body (t: (s32[], bf16[32,64], bf16[64,128])) -> (s32[], bf16[32,64], bf16[64,128]) {
  %t = (s32[], bf16[32,64]{1,0}, bf16[64,128]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %x = bf16[32,64]{1,0} get-tuple-element(%t), index=1
  %y = bf16[64,128]{1,0} get-tuple-element(%t), index=2
  %d = f32[32,128]{1,0} dot(%x, %y), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %o = (s32[], bf16[32,64]{1,0}, bf16[64,128]{1,0}) tuple(%i, %x, %y)
}

%dot_cond (t: (s32[], bf16[32,64], bf16[64,128])) -> pred[] {
  %t = (s32[], bf16[32,64]{1,0}, bf16[64,128]{1,0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

%called_matmul (x: bf16[32,64], y: bf16[64,128]) -> f32[32,128] {
  %x = bf16[32,64]{1,0} parameter(0)
  %y = bf16[64,128]{1,0} parameter(1)
  ROOT %mm = f32[32,128]{1,0} fusion(%x, %y), kind=kOutput, calls=%matmul_fusion
}"""  # noqa: E501
_DOT_WHILE = ("(s32[], bf16[32,64]{1,0}, bf16[64,128]{1,0}) while(%init), condition=%dot_cond, "
              'body=%dot_body, backend_config={"known_trip_count":{"n":"3"}}')
_CALL = "f32[32,128]{1,0} call(%x, %y), to_apply=%called_matmul"


@pytest.mark.parametrize(("between", "flops"), [
    ((_DOT_WHILE,), 3 * MATMUL_FLOPS),  # a loop in the window: its body x its trip count
    ((_CALL,), MATMUL_FLOPS),  # a call of a computation that holds a matmul fusion
    ((_DOT_WHILE, _CALL), 4 * MATMUL_FLOPS),
], ids=["while", "call", "both"])
def test_matmuls_inside_loops_and_calls_between_start_and_done_hide_it(between, flops):
    entry = all_gather(*between).replace(
        "  %ags =", "  %zero = s32[] constant(0)\n"
        "  %init = (s32[], bf16[32,64]{1,0}, bf16[64,128]{1,0}) tuple(%zero, %x, %y)\n  %ags =")
    text = entry.replace("ENTRY %main", _DOT_LOOP + "\n\nENTRY %main")
    window = collective_windows(text)["ags"]
    assert window.hidden and len(window.matmuls) == len(between)
    assert window.flops == flops
    assert dot_flops(text) == flops  # the same matmuls, counted once per step


def test_a_collective_inside_a_loop_in_another_collectives_window_keeps_its_own_window():
    # The ring's permutes (hidden by their own matmul) sit in the all-gather's window: the
    # all-gather is hidden by the ring's 4 matmuls.
    ring = _RING.replace("BETWEEN", MATMUL)
    text = all_gather("(s32[], bf16[16,128]{1,0}, bf16[32,64]{1,0}, bf16[64,128]{1,0}) "
                      "while(%init), condition=%ring_cond, body=%ring_body")
    text = text.replace("  %ags =", "  %zero = s32[] constant(0)\n"
                        "  %init = (s32[], bf16[16,128]{1,0}, bf16[32,64]{1,0}, "
                        "bf16[64,128]{1,0}) tuple(%zero, %w, %x, %y)\n  %ags =")
    text = text.replace("ENTRY %main", ring + "\n\nENTRY %main")
    windows = collective_windows(text)
    assert windows["ags"].flops == 4 * MATMUL_FLOPS
    assert windows["cps"].flops == MATMUL_FLOPS and windows["cps"].done == "cpd"


def test_a_matmul_in_several_windows_of_a_row_counts_once_in_the_rows_flops():
    # Two gathers in flight over one matmul (as the two permutes of an unrolled collective-matmul
    # step): both windows hold %second, the row's window flops count it once.
    start = ("(bf16[16,128]{1,0}, bf16[64,128]{1,0}) all-gather-start(%w), channel_id=ID, "
             f"{TENSOR}, dimensions={{0}}")
    text = module(_INPUTS
                  + f"  %ags = {start.replace('ID', '1')}\n  %first = {MATMUL}\n"
                  f"  %ags.2 = {start.replace('ID', '2')}\n  %second = {MATMUL}\n"
                  "  %agd = bf16[64,128]{1,0} all-gather-done(%ags)\n"
                  "  %agd.2 = bf16[64,128]{1,0} all-gather-done(%ags.2)\n"
                  "  ROOT %out = (bf16[64,128]{1,0}, bf16[64,128]{1,0}) tuple(%agd, %agd.2)")
    windows = collective_windows(text)
    assert windows["ags"].matmuls == ("first", "second")
    assert windows["ags.2"].matmuls == ("second",)
    row = row_of(text)
    assert (row["count"], row["hidden_count"]) == (2, 2)
    assert row["window_matmul_flops"] == 2 * MATMUL_FLOPS  # not 3: %second once


def test_a_start_without_its_done_in_the_computation_has_a_window_to_its_end():
    text = module(_INPUTS
                  + "  %ags = (bf16[16,128]{1,0}, bf16[64,128]{1,0}) all-gather-start(%w), "
                  f"channel_id=1, {TENSOR}, dimensions={{0}}\n"
                  f"  %mm = {MATMUL}\n"
                  "  ROOT %out = ((bf16[16,128]{1,0}, bf16[64,128]{1,0}), f32[32,128]{1,0}) "
                  "tuple(%ags, %mm)")
    window = collective_windows(text)["ags"]
    assert window.done is None and window.hidden and window.flops == MATMUL_FLOPS


# --------------------------------------------------------------------------------------------
# The TPU compiler's async collective fusions (libtpu 0.0.42.1 on v5e)

_TPU_CHAIN = {
    "start": f"""%ag_start_fusion (p0: bf16[4,128]) -> (bf16[4,128], bf16[16,128], u32[]) {{
  %p0 = bf16[4,128]{{1,0}} parameter(0)
  %ag.1 = bf16[16,128]{{1,0}} all-gather(%p0), channel_id=7, {TENSOR}, dimensions={{0}}
  ROOT %cc.1 = (bf16[4,128]{{1,0}}, bf16[16,128]{{1,0}}, u32[]) custom-call(%ag.1), custom_call_target="AsyncCollectiveStart"
}}""",  # noqa: E501
    "carry": f"""%ag_carry_fusion (p0: bf16[4,128], p1: bf16[32,64], p2: bf16[64,128]) -> (f32[32,128], bf16[16,128]) {{
  %p0 = bf16[4,128]{{1,0}} parameter(0)
  %p1 = bf16[32,64]{{1,0}} parameter(1)
  %p2 = bf16[64,128]{{1,0}} parameter(2)
  %conv = f32[32,128]{{1,0}} convolution(%p1, %p2), dim_labels=bf_io->bf
  %ag.2 = bf16[16,128]{{1,0}} all-gather(%p0), channel_id=7, {TENSOR}, dimensions={{0}}
  ROOT %t = (f32[32,128]{{1,0}}, bf16[16,128]{{1,0}}) tuple(%conv, %ag.2)
}}""",  # noqa: E501
    "done": f"""%ag_done_fusion (p0: bf16[4,128]) -> bf16[16,128] {{
  %p0 = bf16[4,128]{{1,0}} parameter(0)
  %ag.3 = bf16[16,128]{{1,0}} all-gather(%p0), channel_id=7, {TENSOR}, dimensions={{0}}
  ROOT %cc.3 = bf16[16,128]{{1,0}} custom-call(%p0, %ag.3), custom_call_target="AsyncCollectiveDone"
}}""",  # noqa: E501
}
_TPU_ENTRY = (
    "  %w = bf16[4,128]{1,0} parameter(0)\n"
    "  %x = bf16[32,64]{1,0} parameter(1)\n  %y = bf16[64,128]{1,0} parameter(2)\n"
    "  %start = (bf16[4,128]{1,0}, bf16[16,128]{1,0}, u32[]) fusion(%w), kind=kCustom, "
    "calls=%ag_start_fusion\n"
    "  %carry = (f32[32,128]{1,0}, bf16[16,128]{1,0}) fusion(%w, %x, %y), kind=kOutput, "
    "calls=%ag_carry_fusion\n"
    "  %done = bf16[16,128]{1,0} fusion(%w), kind=kCustom, calls=%ag_done_fusion\n"
    "  ROOT %out = (f32[32,128]{1,0}, bf16[16,128]{1,0}) tuple(%carry, %done)")


@pytest.mark.parametrize("order", [("start", "carry", "done"), ("done", "carry", "start")],
                         ids=["start-first", "done-first"])
def test_tpu_async_collective_fusion_carried_through_a_matmul_fusion_is_hidden(order):
    # The collective is counted once, at whichever placement comes first in the text; each
    # placement belongs to the start fusion's window.
    text = module(_TPU_ENTRY, *(_TPU_CHAIN[k] for k in order))
    c = only(parse_collectives(text, MESH))
    window = collective_windows(text)[c.name]
    assert (window.start, window.done, window.matmuls) == ("start", "done", ("carry",))
    row = row_of(text)
    assert (row["bytes"], row["hidden_bytes"], row["exposed_bytes"]) == (16 * 128 * 2,) * 2 + (0,)


def test_tpu_async_collective_fusion_carried_through_elementwise_work_is_exposed():
    chain = dict(_TPU_CHAIN, carry=_TPU_CHAIN["carry"].replace(
        "convolution(%p1, %p2), dim_labels=bf_io->bf", "broadcast(%p1), dimensions={0}"))
    row = row_of(module(_TPU_ENTRY, *chain.values()))
    assert (row["hidden_bytes"], row["exposed_bytes"]) == (0, 16 * 128 * 2)


# --------------------------------------------------------------------------------------------
# Over the data-center network, flops, rows and the printed table

_MEGASCALE = ('frontend_attributes={_xla_host_transfer_handler_name="xla_megascale_runtime",'
              '_xla_host_transfer_rendezvous="all-reduce.1_0",'
              '_xla_megascale_transfer_type="ALL_REDUCE"}')


@pytest.mark.parametrize(("position", "hidden"), [(5, True), (6, True), (7, False)],
                         ids=["before-send-done", "before-recv-done", "after-recv-done"])
def test_transfer_over_slices_runs_from_send_to_the_receive_done(position, hidden):
    lines = [_INPUTS.rstrip("\n"), "  %g = f32[128]{0} parameter(3)",
             "  %after-all = token[] after-all()",
             "  %send = (f32[128]{0}, u32[], token[]) send(%g, %after-all), channel_id=3, "
             f"is_host_transfer=true, {_MEGASCALE}",
             "  %recv = (f32[128]{0}, u32[], token[]) recv(%after-all), channel_id=2, "
             f"is_host_transfer=true, {_MEGASCALE}",
             "  %send-done = token[] send-done(%send), channel_id=3, is_host_transfer=true",
             "  %recv-done = (f32[128]{0}, token[]) recv-done(%recv), channel_id=2, "
             "is_host_transfer=true",
             "  ROOT %out = f32[128]{0} copy(%g)"]
    lines.insert(position, f"  %mm = {MATMUL}")
    text = module("\n".join(lines))
    (c,) = dcn_collectives(text, ("data",), 2)
    window = collective_windows(text)[c.name]
    assert (window.start, window.done, window.hidden) == ("send", "recv-done", hidden)


def test_convolution_written_for_a_dot_counts_only_the_taps_inside_the_input():
    # The TPU compiler writes `bse,ekd->bskd` as a convolution whose window (size 4, padded 3 on
    # each side) mostly overhangs a size-1 spatial input: one tap per output is real.
    text = module(
        "  %a = f32[32,64,1]{2,1,0} parameter(0)\n  %b = bf16[64,4,8]{2,1,0} parameter(1)\n"
        "  ROOT %c = f32[32,4,8]{2,1,0} convolution(%a, %b), window={size=4 pad=3_3 "
        "rhs_reversal=1}, dim_labels=bf0_i0o->b0f")
    assert dot_flops(text) == 2 * 32 * 4 * 8 * 64


def test_rows_add_hidden_and_exposed_up_to_their_bytes_and_the_dump_prints_them():
    # A hidden all-gather and a synchronous all-reduce in one dump.
    text = all_gather(MATMUL).replace(
        "  ROOT %out = bf16[64,128]{1,0} copy(%agd)",
        f"  %ar = bf16[64,128]{{1,0}} all-reduce(%agd), channel_id=2, {TENSOR}, to_apply=%add\n"
        "  ROOT %out = bf16[64,128]{1,0} copy(%ar)")
    report = dump_report(text, list(MESH.items()))
    rows = {r["kind"]: r for r in report["collectives"]}
    assert rows["all-gather"]["hidden_bytes"] == rows["all-gather"]["bytes"] == 16384
    assert rows["all-reduce"]["exposed_bytes"] == rows["all-reduce"]["bytes"] == 16384
    assert overlap_totals(report["collectives"]) == {
        "bytes": 32768, "hidden_bytes": 16384, "exposed_bytes": 16384, "hidden_fraction": 0.5}
    report["source"] = {"hlo_file": "dump.txt", "buffer_assignment": ""}
    console = Console(record=True, width=160)
    print_dump(report, console)
    text = console.export_text()
    assert "collectives hidden behind matmuls" in text
    assert "collectives: 32.00 KiB, 50.0% hidden, 16.00 KiB exposed" in text
