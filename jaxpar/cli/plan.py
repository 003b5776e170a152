"""``jaxpar plan``: the cost model's prediction from the config alone (no compile, no devices:
jax's backend stays off), or with ``--search`` every layout ranked, and with ``--verify K
--target TPU`` the best K compiled for a TPU slice beside the prediction."""

from __future__ import annotations

import argparse

from jaxpar.cli.common import config_command, positive_int
from jaxpar.config import Config, ConfigError, load_config

PLAN_HELP = ("predict, from the config alone (no compile), memory, collective bytes per mesh axis, "
             "flops and step time per device on a hardware profile; --search ranks every layout "
             "with the remat policy and offload that make it fit")


def add_plan(commands) -> None:
    from jaxpar.hardware import PROFILES  # noqa: PLC0415  (plain data, no jax)

    sub = config_command(commands, "plan", PLAN_HELP, "\nExamples:\n  jaxpar plan llama-1b "
                         "--search --devices 64 --hardware h100\n  jaxpar plan tiny --search "
                         "--devices 8 --hardware tpu-v5e --verify 1 --target tpu-v5e:2x4")
    sub.add_argument("--hardware", default="h100", choices=sorted(PROFILES),
                     help="hardware profile: peak flops, HBM and link bandwidths (default h100)")
    sub.add_argument("--search", action="store_true",
                     help="rank every layout of the device count (mesh, sequence parallelism, "
                     "ZeRO, pipeline schedule and microbatches) with the remat policy and "
                     "optimizer offload that make it fit; the top 15 are shown")
    sub.add_argument("--all", action="store_true", dest="show_all",
                     help="with --search: expand and show every layout, rejected ones too")
    sub.add_argument("--devices", metavar="N", type=positive_int,
                     help="device count (default: host_devices, else the mesh's product)")
    sub.add_argument("--verify", metavar="K", type=positive_int,
                     help="search, then compile the best K ahead of time for --target (about a "
                     "minute each at real widths on two cores) and print their compiled peak "
                     "memory and collective bytes (ICI, DCN) beside the predicted ones; exit 1 "
                     "if one does not fit")
    sub.add_argument("--target", metavar="TPU", help="with --verify: the TPU slice to compile "
                     "for, tpu-GENERATION:TOPOLOGY (as jaxpar inspect --target; needs pip "
                     "install -e '.[tpu]'); its devices must number --devices")
    sub.add_argument("--slices", metavar="N", type=positive_int,
                     help="with --target: N such slices over the data-center network "
                     "(mesh.dcn says which axes span them)")


def _target(args: argparse.Namespace):
    """The parsed ``--target`` for ``--verify`` (None without), or a one-line ConfigError."""
    from jaxpar.inspect.tpu import parse_target  # noqa: PLC0415  (no jax until topology)

    if args.show_all and not (args.search or args.verify):
        raise ConfigError("--all goes with --search (every layout, not just the top 15)")
    if args.verify is None:
        if args.target is not None or args.slices is not None:
            raise ConfigError("--target and --slices go with --verify K (compile the best K)")
        return None
    if args.target is None:
        raise ConfigError(f"--verify {args.verify} needs --target TPU, the slice to compile "
                          "for, e.g. --target tpu-v5e:2x4")
    return parse_target(args.target, args.slices or 1)


def plan_command(args: argparse.Namespace) -> int:
    from rich.console import Console  # noqa: PLC0415

    from jaxpar.cost.plan import plan_main  # noqa: PLC0415

    target = _target(args)
    cfg = load_config(args.config, list(args.overrides))
    console = Console(soft_wrap=True)
    if not console.is_terminal:  # a file or pipe has no width: don't squeeze tables
        console.width = max(console.width, 140)
    if target is not None:
        return verify_command(args, cfg, target, console)
    return plan_main(cfg, hardware=args.hardware, search=args.search, device_count=args.devices,
                     console=console, show_all=args.show_all)


def verify_command(args: argparse.Namespace, cfg: Config, target, console) -> int:
    """``--verify K --target TPU``: check the target against the plan, search, compile the
    best K (:mod:`jaxpar.inspect.verify`)."""
    from jaxpar.cost.plan import planned_devices, print_search  # noqa: PLC0415
    from jaxpar.hardware import get_profile  # noqa: PLC0415
    from jaxpar.inspect.tpu import require_libtpu, topology_devices  # noqa: PLC0415
    from jaxpar.inspect.verify import print_verification, verify_candidate  # noqa: PLC0415

    hw = get_profile(args.hardware)
    if hw.name != f"tpu-{target.generation}":
        raise ConfigError(f"--target {target.name} is a tpu-{target.generation} slice: plan "
                          f"for it with --hardware tpu-{target.generation} (got --hardware "
                          f"{hw.name})")
    count = planned_devices(cfg, args.devices)
    if count % target.slices:
        raise ConfigError(f"--slices {target.slices} does not divide the {count} devices "
                          "planned (--devices)")
    if cfg.mesh.dcn.slices != target.slices:
        raise ConfigError(f"--slices {target.slices}: the mesh spans {cfg.mesh.dcn.slices} "
                          "slice(s) (mesh.dcn: the product of its sizes must be the slices, "
                          "e.g. mesh.dcn.data=2 for --slices 2)")
    require_libtpu()
    devices = topology_devices(target)
    if len(devices) != count:
        raise ConfigError(f"--target {target.name}" + (f" x {target.slices} slices"
                          if target.slices > 1 else "") + f" has {len(devices)} devices, not "
                          f"the {count} planned (--devices {count})")
    candidates = print_search(cfg, count, hw, console, args.show_all)
    best = [c for c in candidates if c.fits][:args.verify]
    if not best:
        console.print("nothing to verify: no layout fits")
        return 1
    rows = []
    for c in best:
        console.print(f"compiling #{c.rank} {c.layout} for {target.name} ...", style="dim",
                      markup=False)
        rows.append(verify_candidate(c, devices, hw))
    return print_verification(rows, hw, target.name, console)
