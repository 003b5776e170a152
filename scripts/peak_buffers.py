"""What is alive at the compiler's memory peak of a train step, from an XLA dump.

``memory_analysis()`` gives the temp total; the compiler's own buffer assignment says what it
is made of. Compile with ``XLA_FLAGS=--xla_dump_to=DIR`` (libtpu honours it too and writes the
TPU program's files; ``LIBTPU_INIT_ARGS`` refuses the flag), e.g.::

    XLA_FLAGS=--xla_dump_to=/tmp/dump jaxpar inspect llama3-70b --target tpu-v5p:4x4x4 ...
    python scripts/peak_buffers.py /tmp/dump

This reads ``*jit_train_step*after_optimizations-buffer-assignment.txt`` (each value of the
temp allocation with its offset and size) and ``*-live-range.txt`` (each value's live range
over the scheduled program, loop bodies included), finds the point of the schedule where the
live values add up the most (one per offset: a loop's carried values share their buffer) and
prints them grouped by shape, largest first. Values under ``--min-mib`` are left out of the
sum (thousands of small ones, a few MiB in all).
"""

from __future__ import annotations

import argparse
import glob
import re
from collections import defaultdict
from typing import NamedTuple

VALUE = re.compile(r"value: <\d+ ([\w.\-#]+)(\{[\d,]*\})?(?: \(phi\))? @\d+> "
                   r"\(size=(\d+),offset=(\d+)\): (\S+)")
RANGE = re.compile(r"^\s+([\w.\-#]+\{[\d,]*\}):(\d+)-(\d+)", re.M)
TEMP = re.compile(r"allocation \d+: size [1-9]\d*, (?:page 0, )?preallocated-temp")


class Value(NamedTuple):
    name: str
    size: int
    offset: int
    start: int
    end: int
    shape: str


def temp_values(assignment: str, live_ranges: str, min_bytes: int) -> tuple[list[Value], int]:
    """The temp allocation's values of at least ``min_bytes`` with their live ranges, and the
    allocation's size."""
    start = TEMP.search(assignment).start()
    end = assignment.find("\nallocation", start)
    block = assignment[start:end if end > 0 else len(assignment)]
    ranges = {m.group(1): (int(m.group(2)), int(m.group(3)))
              for m in RANGE.finditer(live_ranges)}
    values, top = [], 0
    for name, index, size, offset, shape in VALUE.findall(block):
        key, size, offset = name + (index or "{}"), int(size), int(offset)
        top = max(top, offset + size)
        if key in ranges and size >= min_bytes:
            values.append(Value(key, size, offset, *ranges[key], shape.split("{")[0]))
    return values, top


def peak(values: list[Value]) -> tuple[int, int, list[Value]]:
    """(time, bytes, values) where the live values, one per offset, add up the most."""
    starts, ends = defaultdict(list), defaultdict(list)
    for v in values:
        starts[v.start].append(v)
        ends[v.end].append(v)
    live: dict[int, list[Value]] = defaultdict(list)
    best, at = 0, 0
    for t in range(max((v.end for v in values), default=0) + 1):
        for v in starts[t]:
            live[v.offset].append(v)
        total = sum(max(v.size for v in vs) for vs in live.values() if vs)
        if total > best:
            best, at = total, t
        for v in ends[t]:
            live[v.offset].remove(v)
    here = {}
    for v in values:
        if v.start <= at <= v.end:
            here.setdefault(v.offset, v)
    return at, best, sorted(here.values(), key=lambda v: -v.size)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("dump", help="the --xla_dump_to directory")
    parser.add_argument("--rows", type=int, default=25, help="shapes to print")
    parser.add_argument("--min-mib", type=float, default=1.0)
    args = parser.parse_args(argv)

    def one(suffix: str) -> str:
        with open(glob.glob(f"{args.dump}/*jit_train_step*{suffix}")[0]) as f:
            return f.read()

    values, top = temp_values(one("after_optimizations-buffer-assignment.txt"),
                              one("after_optimizations-live-range.txt"),
                              int(args.min_mib * 2**20))
    at, total, here = peak(values)
    print(f"temp allocation {top / 2**30:.2f} GiB; values of {args.min_mib:g} MiB or more "
          f"alive at once: at most {total / 2**30:.2f} GiB (schedule time {at})")
    groups: dict[str, list[Value]] = defaultdict(list)
    for v in here:
        groups[v.shape].append(v)
    for shape, vs in sorted(groups.items(), key=lambda g: -sum(v.size for v in g[1]))[
            :args.rows]:
        names = " ".join(v.name for v in vs[:3])
        print(f"{sum(v.size for v in vs) / 2**20:10.1f} MiB {len(vs):3d} x {shape:48s} {names}")


if __name__ == "__main__":
    main()
