"""``jaxpar inspect``: compile one step (for virtual CPU devices or a TPU slice) without running
it, print or write the report, compare it with the plan (``--compare``, ``--strict``)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from jaxpar.cli.common import (
    check_output_dir,
    config_command,
    load_validated,
    positive_int,
    require_matplotlib,
    tolerance,
)
from jaxpar.config import Config, load_config, validate
from jaxpar.inspect.tpu import (
    TpuTarget,
    parse_target,
    report_fields,
    require_libtpu,
    topology_devices,
)

INSPECT_HELP = ("compile one train step without running it and show, per device, parameter "
                "shardings, memory, collectives and flops")


def add_inspect(commands) -> None:
    sub = config_command(commands, "inspect", INSPECT_HELP,
                          "\nExample (a 64-device layout, compiled on this machine):\n  jaxpar "
                          "inspect tiny --devices 64 mesh.data=8 mesh.fsdp=8 "
                          "train.batch_size=64\nExample (what the TPU compiler makes of FSDP on "
                          "a v5e-8 slice):\n  jaxpar inspect tiny mesh.data=1 mesh.fsdp=8 "
                          "--target tpu-v5e:2x4")
    sub.add_argument("--json", metavar="FILE", help="write the report as JSON ('-': to stdout, "
                     "instead of the tables)")
    sub.add_argument("--hlo", metavar="FILE", help="write the optimized HLO text of the step")
    sub.add_argument("--compare", action="store_true", help="print `jaxpar plan`'s predicted "
                     "memory and collective bytes beside the compiled ones, with their ratio")
    sub.add_argument("--strict", action="store_true", help="compare (as --compare) and exit 1, "
                     "naming the rows, when a collective (kind, axes) or the peak memory differs "
                     "from the plan by more than --tolerance (rows under 1 MiB per device aside)")
    sub.add_argument("--tolerance", metavar="T", type=tolerance, default=0.1,
                     help="relative difference --strict allows (default 0.1: 10%%)")
    sub.add_argument("--png", metavar="FILE", help="draw the mesh, how each parameter group is "
                     "split over it, and the collectives per axis (needs matplotlib: "
                     "pip install -e '.[plot]')")
    devices = sub.add_mutually_exclusive_group()
    devices.add_argument("--devices", metavar="N", type=positive_int,
                         help="compile for N virtual CPU devices (overrides host_devices); "
                         "nothing is allocated, so large layouts can be checked on a laptop")
    devices.add_argument("--target", metavar="TPU",
                         help="compile ahead of time for a TPU slice instead, with the TPU "
                         "compiler, on this machine (nothing runs; host_devices is ignored; "
                         "needs pip install -e '.[tpu]'): tpu-GENERATION:TOPOLOGY, one of "
                         "tpu-v4:2x2x1, tpu-v5e:2x4, tpu-v5p:2x2x1, tpu-v6e:4x4, tpu-v7x:2x2x1, "
                         "...; the mesh spans the slice's devices")


def load_for_target(name: str, overrides: list[str], target: TpuTarget) -> tuple[Config, list]:
    """Read and override the config, then validate it against the TPU slice's device count.

    Key and value errors come before libtpu is loaded; the ``-1`` mesh axis resolves against
    the slice (``host_devices``, a CPU setting, plays no part).
    """
    cfg = load_config(name, overrides)
    devices = topology_devices(target)
    return validate(cfg, len(devices)), devices


def run_inspect(args: argparse.Namespace, cfg: Config, devices: list | None = None,
                target: TpuTarget | None = None) -> int:
    """Compile, report, write files. ``devices`` (with ``target``): the TPU slice's devices."""
    from rich.console import Console  # noqa: PLC0415

    from jaxpar.inspect.compare import compare_with_plan, mismatches, print_comparison  # noqa: PLC0415
    from jaxpar.inspect.report import build_report, print_report  # noqa: PLC0415
    from jaxpar.mesh import make_mesh  # noqa: PLC0415
    from jaxpar.train.compiled import compiled_step  # noqa: PLC0415

    json_to_stdout = args.json == "-"
    step = compiled_step(cfg, make_mesh(cfg, devices=devices))
    report = build_report(step)
    if target is not None:
        report["run"].update(report_fields(target, devices))
    if args.compare or args.strict:  # --strict compares
        report["compare"] = compare_with_plan(report, cfg)
        report["compare"]["mismatches"] = mismatches(report["compare"], args.tolerance)
    # With --json - stdout carries only the JSON; anything else said goes to stderr.
    console = Console(stderr=json_to_stdout, soft_wrap=True)
    if not console.is_terminal:  # a file or pipe has no width: don't squeeze the tables to 80
        console.width = max(console.width, 120)
    if json_to_stdout:
        print(json.dumps(report, indent=2))
    else:
        print_report(report, console)
        if "compare" in report:
            print_comparison(report["compare"], console, args.tolerance)
    if args.json and not json_to_stdout:
        Path(args.json).expanduser().write_text(json.dumps(report, indent=2) + "\n")
        console.print(f"wrote the report to {args.json}")
    if args.hlo:
        Path(args.hlo).expanduser().write_text(step.compiled.as_text())
        console.print(f"wrote the optimized HLO to {args.hlo}")
    if args.png:
        from jaxpar.pictures.figures import draw_report  # noqa: PLC0415

        draw_report(report, Path(args.png).expanduser())
        console.print(f"drew the report to {args.png}")
    if args.strict:
        return _strict_verdict(report["compare"]["mismatches"], args.tolerance,
                               sys.stderr if json_to_stdout else sys.stdout)
    return 0


def _strict_verdict(rows: list[str], tolerance: float, out) -> int:
    """``inspect --compare --strict``: exit 1 naming every row off the plan, else 0."""
    if not rows:
        print(f"strict: every collective and the peak memory within {tolerance:.0%} of the plan",
              file=out)
        return 0
    print(f"strict: {len(rows)} row(s) differ from the plan by more than {tolerance:.0%}: "
          + "; ".join(rows), file=sys.stderr)
    return 1


def inspect_command(args: argparse.Namespace) -> int:
    """Check the output paths and the target before anything compiles, then inspect."""
    overrides = list(args.overrides)
    check_output_dir("--json", args.json)
    check_output_dir("--hlo", args.hlo)
    check_output_dir("--png", args.png)
    if args.png:
        require_matplotlib()
    if args.devices is not None:  # last, so it wins over a host_devices override
        overrides.append(f"host_devices={args.devices}")
    if args.target is not None:  # a bad target or a missing libtpu: before the config
        target = parse_target(args.target)
        require_libtpu()
        cfg, devices = load_for_target(args.config, overrides, target)
        return run_inspect(args, cfg, devices, target)
    return run_inspect(args, load_validated(args.config, overrides))
