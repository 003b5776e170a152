"""Exposed communication of a compiled step, by the overlap rule and weighted by time.

``jaxpar inspect`` counts a collective hidden when any matmul is scheduled between its start
and done. A tiny matmul then hides a large transfer. This script reads a scheduled program's
HLO text (``jaxpar inspect --hlo FILE``, or another trainer's dump) and prints, per collective
row, the bytes exposed by that rule and by time: each window hides the share of its transfer
that its matmuls take at the chip's peak flops, over one link of the chip's profile
(:mod:`jaxpar.hardware`). Both are estimates from the schedule, not measurements::

    jaxpar inspect mixtral-8x7b --target tpu-v5p:4x4x2 ... --hlo step.hlo
    python scripts/exposure_by_time.py step.hlo --mesh fsdp=4,expert=8 --hardware tpu-v5p
"""

from __future__ import annotations

import argparse
from pathlib import Path

from jaxpar.hardware import PROFILES
from jaxpar.inspect.hlo.collectives import parse_collectives, summarize_collectives
from jaxpar.inspect.hlo.overlap import add_overlap, exposed_by_time

GIB = 2**30


def mesh_of(text: str) -> dict[str, int]:
    """``fsdp=4,expert=8`` as a mesh shape."""
    return {name: int(size) for name, size in (part.split("=") for part in text.split(","))}


def rows(hlo_text: str, mesh: dict[str, int], hardware: str) -> list[dict]:
    """One row per (kind, axes): bytes, exposed by the rule and exposed by time, per step."""
    profile = PROFILES[hardware]
    collectives = parse_collectives(hlo_text, mesh)
    table = summarize_collectives(collectives)
    add_overlap(table, collectives, hlo_text)
    by_time = exposed_by_time(collectives, hlo_text, profile.peak_flops,
                              profile.fast_bytes_per_s)
    for row in table:
        key = (row["kind"], tuple(row["axes"]), row.get("network") or "")
        row["exposed_by_time"] = round(by_time.get(key, 0.0))
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("hlo", type=Path, help="a scheduled program's HLO text")
    parser.add_argument("--mesh", required=True, help="its mesh, e.g. fsdp=4,expert=8")
    parser.add_argument("--hardware", default="tpu-v5p", choices=sorted(PROFILES))
    args = parser.parse_args()
    table = rows(args.hlo.read_text(), mesh_of(args.mesh), args.hardware)
    print(f"{'kind':20} {'axes':14} {'GiB':>8} {'exposed (rule)':>15} {'exposed (time)':>15}")
    for row in table:
        print(f"{row['kind']:20} {','.join(row['axes']):14} {row['bytes'] / GIB:8.2f} "
              f"{row['exposed_bytes'] / GIB:15.2f} {row['exposed_by_time'] / GIB:15.2f}")
    total = {k: sum(r[k] for r in table) / GIB for k in ("bytes", "exposed_bytes",
                                                          "exposed_by_time")}
    print(f"{'total':35} {total['bytes']:8.2f} {total['exposed_bytes']:15.2f} "
          f"{total['exposed_by_time']:15.2f}")


if __name__ == "__main__":
    main()
