"""scripts/peak_buffers.py on a made-up XLA dump: the temp values alive at once, one per offset
(a loop's carried values share their buffer), at the schedule's busiest point."""

from __future__ import annotations

import importlib.util

from helpers import SCRIPTS

ASSIGNMENT = """allocation 0: size 64, parameter 0, shape |f32[16]| at ShapeIndex {}:
 value: <1 param.0 @0> (size=64,offset=0): f32[16]{0}
allocation 1: size 7340032, page 0, preallocated-temp:
 value: <2 fusion.1 @0> (size=4194304,offset=0): bf16[2,1024,1024]{2,1,0}
 value: <3 while.1{2} (phi) @0> (size=2097152,offset=4194304): f32[512,1024]{1,0}
 value: <4 wide.param.1{2} (phi) @0> (size=2097152,offset=4194304): f32[512,1024]{1,0}
 value: <5 copy.2 @0> (size=1048576,offset=6291456): f32[256,1024]{1,0}
 value: <6 add.3 @0> (size=1048576,offset=0): f32[256,1024]{1,0}
"""
LIVE_RANGES = """HloLiveRange (max 9):
  InstructionSequence:
    0:param.0
  BufferLiveRange:
    param.0{}:0-9
    fusion.1{}:1-4
    while.1{2}:2-6
    wide.param.1{2}:3-5
    copy.2{}:3-3
    add.3{}:6-8
"""


def _script():
    spec = importlib.util.spec_from_file_location("peak_buffers", SCRIPTS / "peak_buffers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_busiest_point_counts_a_shared_buffer_once(tmp_path, capsys):
    script = _script()
    values, top = script.temp_values(ASSIGNMENT, LIVE_RANGES, min_bytes=2**20)
    assert top == 7340032 and len(values) == 5  # the parameter is not temp
    at, total, here = script.peak(values)
    # At time 3: fusion.1 (4 MiB), the loop's carried value once (2 MiB) and copy.2 (1 MiB).
    assert (at, total) == (3, 7 * 2**20)
    assert [v.name for v in here] == ["fusion.1{}", "while.1{2}", "copy.2{}"]
    prefix = "module_0000.jit_train_step.tpu_after_optimizations"
    (tmp_path / f"{prefix}-buffer-assignment.txt").write_text(ASSIGNMENT)
    (tmp_path / f"{prefix}-live-range.txt").write_text(LIVE_RANGES)
    script.main([str(tmp_path)])
    out = capsys.readouterr().out
    assert "temp allocation 0.01 GiB" in out and "bf16[2,1024,1024]" in out
