"""Every pipeline schedule side by side, as docs/pipelines.md's table: ticks, bubble, what the
first stage holds, and the W stash, at p in {4, 8} stages and m in {8, 16, 32} microbatches.

Pure Python (the schedules' own timing, no compile), a second or two:

    python scripts/schedule_table.py            # the markdown table
    python scripts/schedule_table.py --p 4 --m 16

Columns: ``ticks`` and ``bubble`` of the executed timeline (every stage runs every slot of a
round, masked ones included: :mod:`jaxpar.parallel.pipeline.schedules`); ``stage 0 holds`` the
most (microbatch, chunk) pairs the first stage keeps between a forward and its backward (its W,
when split), in layers of the model (a chunk is ``L / (v p)`` layers: 1F1B at p=4 holds 7
microbatches of a quarter of the layers each, 1.75 L); ``W stash`` the slots of what an I leaves
its W (each one chunk's weight-matmul output gradients), in the same units.
"""

from __future__ import annotations

import argparse
from fractions import Fraction

from jaxpar.parallel.pipeline.program import describe
from jaxpar.parallel.pipeline.schedules import schedule_table
from jaxpar.parallel.pipeline.timeline import peak_in_flight

# (schedule, virtual stages), in the order of the table.
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zero_bubble", 1),
             ("zero_bubble", 2), ("dualpipe_v", 2)]


def row(name: str, v: int, p: int, m: int) -> str | None:
    """One markdown row, or None where the schedule does not take these sizes."""
    if (v > 1 and m % p) or (name == "dualpipe_v" and m < 2 * p):
        return None
    info = describe(name, p, m, v)
    chunk = Fraction(1, v * p)  # of the model's layers
    first = peak_in_flight(schedule_table(name, p, m, v))[0] * chunk
    stash = info["weight_stash_slots"] * chunk
    label = name + (f" v={v}" if name in ("interleaved", "zero_bubble") else "")
    waiting = f"{float(stash):.2f} L" if stash else "-"
    return (f"| {p} | {m} | {label} | {info['ticks']} | {info['bubble']:.1%} | "
            f"{float(first):.2f} L | {waiting} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--p", type=int, nargs="*", default=[4, 8], help="stages")
    parser.add_argument("--m", type=int, nargs="*", default=[8, 16, 32], help="microbatches")
    args = parser.parse_args()
    print("| p | m | schedule | ticks | bubble | stage 0 holds | W stash |")
    print("|---|---|---|---|---|---|---|")
    for p in args.p:
        for m in args.m:
            for name, v in SCHEDULES:
                if (line := row(name, v, p, m)) is not None:
                    print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
