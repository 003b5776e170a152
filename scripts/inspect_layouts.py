"""Record what the compiler makes of the benchmark's layouts, to prove a change left the program
alone: ``jaxpar inspect --json`` of each layout (collectives, flops, memory per device), written
to one JSON file; ``--compare`` then diffs two recordings.

    python scripts/inspect_layouts.py --json before.json          # the quick layouts, bench-cpu
    git checkout other-commit && python scripts/inspect_layouts.py --json after.json
    python scripts/inspect_layouts.py --compare before.json after.json   # exit 1 if they differ

The layouts are ``scripts/benchmark.py``'s (``--layouts`` picks, default its ``--quick`` set),
each compiled by the ``jaxpar`` of the current checkout (``python -m jaxpar.cli``) for 8
virtual CPU devices, nothing run. Compile time is left out of the record: it is not the program.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmark import LAYOUTS, MODELS, QUICK  # noqa: E402

KEPT = ("collectives", "flops", "memory")


def record(preset: str, names: list[str], devices: int) -> dict:
    from jaxpar.config import load_config  # noqa: PLC0415

    cfg = load_config(preset, [])
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    out = {}
    for name in names:
        layout = LAYOUTS[name]
        overrides = [*MODELS[layout.model](cfg), *layout.overrides]
        result = subprocess.run(
            [sys.executable, "-m", "jaxpar.cli", "inspect", preset, *overrides, "--devices",
             str(devices), "--json", "-"], capture_output=True, text=True, env=env)
        if result.returncode != 0:
            out[name] = {"error": result.stderr.strip().splitlines()[-1:]}
        else:
            report = json.loads(result.stdout)
            out[name] = {key: report[key] for key in KEPT}
        print(f"{name}: {'recorded' if 'error' not in out[name] else out[name]['error']}",
              file=sys.stderr)
    return out


def differences(before: dict, after: dict, path: str = "") -> list[str]:
    """Every path where the two recordings differ (a value, or a key only one side has)."""
    if isinstance(before, dict) and isinstance(after, dict):
        found = []
        for key in sorted(set(before) | set(after), key=str):
            if key not in before or key not in after:
                found.append(f"{path}/{key}: only in {'after' if key in after else 'before'}")
            else:
                found += differences(before[key], after[key], f"{path}/{key}")
        return found
    return [] if before == after else [f"{path}: {before!r} -> {after!r}"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="bench-cpu")
    parser.add_argument("--layouts", help=f"comma-separated, from: {', '.join(LAYOUTS)}")
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--json", metavar="FILE", help="write the recording here")
    parser.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"),
                        help="diff two recordings; exit 1 if they differ")
    args = parser.parse_args(argv)
    if args.compare:
        before, after = (json.loads(Path(p).read_text()) for p in args.compare)
        found = differences(before, after)
        for line in found:
            print(line)
        print(f"{len(before)} layouts: " + ("identical collectives, flops and memory" if not found
                                            else f"{len(found)} differences"))
        return 1 if found else 0
    names = args.layouts.split(",") if args.layouts else list(QUICK)
    recording = record(args.preset, names, args.devices)
    text = json.dumps(recording, indent=1, sort_keys=True)
    if args.json:
        Path(args.json).write_text(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
