"""Compiled vs planned at real model sizes: every case of the real-size matrix
(:mod:`jaxpar.inspect.real_size`), compiled on 64 virtual CPU devices (nothing is allocated),
as one table of peak memory and collective bytes per device, compiled / planned.

    python scripts/real_size.py                       # the whole matrix, ~3 minutes on 2 cores
    python scripts/real_size.py --cases fsdp,fsdp-70b --markdown out.md --json out.json
    python scripts/real_size.py --target tpu-v5p:4x4x4     # the TPU compiler's program instead

Rows outside the 10% bound are marked; the exit code is 1 when any case has one (as
``jaxpar inspect --compare --strict``), 0 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from jaxpar.mesh import use_host_devices

use_host_devices(64)  # before anything imports jax

from jaxpar.config import ConfigError  # noqa: E402
from jaxpar.inspect.real_size import CPU_CASES, compile_case, summary_rows  # noqa: E402
from jaxpar.units import human_bytes  # noqa: E402


def _markdown(rows: list[dict]) -> str:
    lines = ["| case | what | axes | compiled | planned | compiled / planned |",
             "|---|---|---|---:|---:|---:|"]
    for r in rows:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
        if r["ratio"] is None or abs(r["ratio"] - 1) > 0.1:
            ratio = f"**{ratio}**"
        lines.append(f"| {r['case']} | {r['what']} | {r['axes']} | "
                     f"{human_bytes(r['compiled']) if r['compiled'] else 'none'} | "
                     f"{human_bytes(r['planned']) if r['planned'] else 'none'} | {ratio} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", help="comma-separated case names (default: all): "
                        + ", ".join(c.name for c in CPU_CASES))
    parser.add_argument("--markdown", metavar="FILE", help="write the table as Markdown")
    parser.add_argument("--json", metavar="FILE", help="write every case's comparison as JSON")
    parser.add_argument("--target", metavar="TPU", help="compile for a TPU slice of 64 chips "
                        "instead (e.g. tpu-v5p:4x4x4; needs the tpu extra)")
    args = parser.parse_args()
    devices = None
    if args.target:
        from jaxpar.inspect.tpu import parse_target, topology_devices

        devices = topology_devices(parse_target(args.target))
    wanted = None if args.cases is None else set(args.cases.split(","))
    cases = [c for c in CPU_CASES if wanted is None or c.name in wanted]
    if wanted is not None and len(cases) != len(wanted):
        known = ", ".join(c.name for c in CPU_CASES)
        print(f"unknown case in --cases {args.cases!r}; cases: {known}", file=sys.stderr)
        return 2
    rows, out, failed = [], {}, 0
    for i, case in enumerate(cases, 1):
        start = time.perf_counter()
        try:
            report = compile_case(case, devices)
        except ConfigError as e:  # a layout this target refuses (its one-line reason)
            failed += 1
            out[case.name] = {"refused": str(e)}
            print(f"[{i}/{len(cases)}] {case.name}: REFUSED: {e}", flush=True)
            continue
        comparison = report["compare"]
        # Beside the comparison, what a reader needs to judge a row off the plan: the compiled
        # rows with their wire bytes and spellings (lowered_as), and both memory figures.
        out[case.name] = {**comparison, "compiled_collectives": report["collectives"],
                          "compiled_memory": report["memory"]}
        rows += summary_rows(case, comparison)
        bad = comparison["mismatches"]
        failed += bool(bad)
        verdict = "ok" if not bad else "OFF PLAN: " + "; ".join(bad)
        print(f"[{i}/{len(cases)}] {case.name} ({time.perf_counter() - start:.0f} s): {verdict}",
              flush=True)
    table = _markdown(rows)
    print(table)
    if args.markdown:
        Path(args.markdown).write_text(table + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    print(f"{len(cases) - failed} of {len(cases)} cases within 10% of the plan")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
