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
from jaxpar.config import Config, ConfigError, load_config, slices_line, validate
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
                         "--target tpu-v5e:2x4\nExample (any XLA dump, no CONFIG):\n  jaxpar "
                         "inspect --hlo-file dump/module_0001.jit_step.after_optimizations.txt "
                         "--mesh data=4,fsdp=8", config_optional=True)
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
    sub.add_argument("--hlo-file", metavar="DUMP", help="tally an optimized HLO dump instead of "
                     "compiling a CONFIG (any program, e.g. another trainer's, from "
                     "XLA_FLAGS=--xla_dump_to=DIR): its collectives by kind and mesh axes, and "
                     "its memory when XLA's buffer assignment file lies beside it; needs --mesh")
    sub.add_argument("--mesh", metavar="AXES", help="with --hlo-file: the mesh the dump's device "
                     "ids form, names and sizes in order, row-major (e.g. data=2,fsdp=16)")
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
    sub.add_argument("--slices", metavar="N", type=positive_int, default=1,
                     help="with --target: N such slices joined by the data-center network "
                     "(libtpu's multi-slice topology); mesh.dcn says which axes span them")


def load_for_target(name: str, overrides: list[str], target: TpuTarget) -> tuple[Config, list]:
    """Read and override the config, then validate it against the TPU slice's device count.

    Key and value errors come before libtpu is loaded; the ``-1`` mesh axis resolves against
    the slice (``host_devices``, a CPU setting, plays no part).
    """
    cfg = load_config(name, overrides)
    if cfg.mesh.dcn.slices != target.slices:
        raise ConfigError(f"--slices {target.slices}: the mesh spans {cfg.mesh.dcn.slices} "
                          "slice(s) (mesh.dcn: the product of its sizes must be the slices, "
                          "e.g. mesh.dcn.data=2 for --slices 2)")
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
    if slices_line(cfg):
        print(slices_line(cfg), file=sys.stderr)
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
    """Check the output paths and the target before anything compiles, then inspect (or, with
    ``--hlo-file``, tally the dump)."""
    if args.hlo_file is not None or args.mesh is not None:
        return dump_command(args)
    if args.config is None:
        raise ConfigError("inspect needs CONFIG (or --hlo-file DUMP --mesh AXES)")
    overrides = list(args.overrides)
    check_output_dir("--json", args.json)
    check_output_dir("--hlo", args.hlo)
    check_output_dir("--png", args.png)
    if args.png:
        require_matplotlib()
    if args.devices is not None:  # last, so it wins over a host_devices override
        overrides.append(f"host_devices={args.devices}")
    if args.slices > 1 and args.target is None:
        raise ConfigError("--slices goes with --target (on CPU devices mesh.dcn alone makes "
                          "the slices)")
    if args.target is not None:  # a bad target or a missing libtpu: before the config
        target = parse_target(args.target, args.slices)
        require_libtpu()
        cfg, devices = load_for_target(args.config, overrides, target)
        return run_inspect(args, cfg, devices, target)
    return run_inspect(args, load_validated(args.config, overrides))


def dump_command(args: argparse.Namespace) -> int:
    """``--hlo-file DUMP --mesh AXES``: the dump's collectives and memory
    (:mod:`jaxpar.inspect.dump`)."""
    from rich.console import Console  # noqa: PLC0415

    from jaxpar.inspect.dump import buffer_assignment_beside, dump_report, parse_mesh  # noqa: PLC0415
    from jaxpar.inspect.report import print_dump  # noqa: PLC0415

    if args.hlo_file is None or args.mesh is None:
        raise ConfigError("--hlo-file and --mesh go together: --hlo-file DUMP --mesh data=2,fsdp=4")
    unused = [name for name, value in (("CONFIG", args.config), ("key=value", args.overrides),
                                       ("--devices", args.devices), ("--target", args.target),
                                       ("--compare", args.compare), ("--strict", args.strict),
                                       ("--hlo", args.hlo), ("--png", args.png)) if value]
    if unused:
        raise ConfigError(f"--hlo-file reads a dump, with no {', '.join(unused)}")
    check_output_dir("--json", args.json)
    dump = Path(args.hlo_file).expanduser()
    if not dump.is_file():
        raise ConfigError(f"--hlo-file {args.hlo_file}: no such file")
    mesh = parse_mesh(args.mesh)
    buffers = buffer_assignment_beside(dump)
    try:
        report = dump_report(dump.read_text(), mesh, buffers.read_text() if buffers else None)
    except ConfigError:
        raise
    except ValueError as err:  # text the reader cannot parse: one line, no traceback
        raise ConfigError(f"--hlo-file {args.hlo_file}: {err}") from None
    report["source"] = {"hlo_file": str(dump), "buffer_assignment": str(buffers or "")}
    if args.json == "-":
        print(json.dumps(report, indent=2))
        return 0
    console = Console(soft_wrap=True)
    if not console.is_terminal:
        console.width = max(console.width, 120)
    print_dump(report, console)
    if args.json:
        Path(args.json).expanduser().write_text(json.dumps(report, indent=2) + "\n")
        console.print(f"wrote the report to {args.json}")
    return 0
