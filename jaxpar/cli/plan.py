"""``jaxpar plan``: the cost model's prediction from the config alone (no compile, no devices:
jax's backend stays off), or with ``--search`` every layout ranked."""

from __future__ import annotations

import argparse

from jaxpar.cli.common import config_command, positive_int
from jaxpar.config import load_config

PLAN_HELP = ("predict, from the config alone (no compile), memory, collective bytes per mesh axis, "
             "flops and step time per device on a hardware profile; --search ranks every layout")


def add_plan(commands) -> None:
    from jaxpar.hardware import PROFILES  # noqa: PLC0415  (plain data, no jax)

    sub = config_command(commands, "plan", PLAN_HELP, "\nExample:\n  jaxpar plan llama-1b "
                          "--search --devices 64 --hardware h100")
    sub.add_argument("--hardware", default="h100", choices=sorted(PROFILES),
                     help="hardware profile: peak flops, HBM and link bandwidths (default h100)")
    sub.add_argument("--search", action="store_true",
                     help="rank every mesh layout of the device count by estimated step time, "
                     "with the reason each rejected layout fails")
    sub.add_argument("--devices", metavar="N", type=positive_int,
                     help="device count (default: host_devices, else the mesh's product)")


def plan_command(args: argparse.Namespace) -> int:
    from rich.console import Console  # noqa: PLC0415

    from jaxpar.cost.plan import plan_main  # noqa: PLC0415

    console = Console(soft_wrap=True)
    if not console.is_terminal:  # a file or pipe has no width: don't squeeze tables
        console.width = max(console.width, 140)
    return plan_main(load_config(args.config, list(args.overrides)), hardware=args.hardware,
                     search=args.search, device_count=args.devices, console=console)
