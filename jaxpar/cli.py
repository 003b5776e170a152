"""``jaxpar`` command line: ``train``, ``config``, ``inspect``, ``plan``, ``schedule``,
``export``, ``import-hf`` and ``generate``.

The config is read and checked before jax is imported, so ``host_devices`` can still choose the
number of virtual CPU devices, and a bad key or value costs no compile. Exit codes: 0 done,
2 bad usage/config/input, 1 failure while running.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from jaxpar.cli_generate import add_generate, run_generate
from jaxpar.config import PRESETS_DIR, Config, ConfigError, load_config, to_yaml, validate
from jaxpar.inspect.tpu import (
    TpuTarget,
    parse_target,
    report_fields,
    require_libtpu,
    topology_devices,
)

EPILOG = """\
CONFIG is a YAML file or a preset in configs/ ({presets}).
Overrides are dotted key=value pairs typed by the schema, e.g.
  jaxpar train tiny mesh.fsdp=2 mesh.tensor=2 parallel.sequence_parallel=true train.steps=20
Checkpoints go to run_dir/checkpoints (checkpoint.every, checkpoint.keep); a rerun continues
from the newest one (train.resume=auto|never|STEP|PATH); SIGTERM/SIGINT save and exit 0.
Several processes (hosts, GPUs): train joins JAX's runtime when the cluster runs several or
distributed.coordinator/num_processes/process_id are given (distributed.enabled=auto|on|off);
scripts/launch_local.py runs P processes on this machine.
Exit codes: 0 done, 2 bad usage/config/input, 1 failure while running."""


def _presets() -> str:
    names = sorted(p.stem for p in PRESETS_DIR.glob("*.yaml")) if PRESETS_DIR.is_dir() else []
    return ", ".join(names) or "none found"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse exits 2 too; keep it to one line
        self.exit(2, f"jaxpar: error: {message} (see jaxpar --help)\n")


class _SubParser(_Parser):
    """A subcommand's parser; ``intermixed=True`` lets options sit between the overrides, as in
    ``jaxpar inspect tiny --devices 64 mesh.data=8`` (argparse stops taking ``nargs='*'``
    positionals at the first option otherwise)."""

    def __init__(self, *args, intermixed: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._intermixed = intermixed
        self._in_intermixed = False

    def parse_known_args(self, args=None, namespace=None):
        if not self._intermixed or self._in_intermixed:
            return super().parse_known_args(args, namespace)
        # parse_known_intermixed_args calls parse_known_args itself (twice): plain parsing there.
        self._in_intermixed = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._in_intermixed = False


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="jaxpar", description="Train transformer LMs with 5D parallelism in "
                     "JAX, and see what the compiler did.",
                     epilog=EPILOG.format(presets=_presets()),
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                     parser_class=_SubParser)
    for name, text in (("train", "train a model (writes run_dir/config.yaml, metrics.jsonl)"),
                       ("config", "print the resolved, validated config as YAML")):
        _config_command(commands, name, text)
    _add_inspect(commands)
    _add_plan(commands)
    _add_schedule(commands)
    _add_export(commands)
    add_generate(commands, _positive_int)
    return parser


def _config_command(commands, name: str, text: str,
                    example: str | None = None) -> argparse.ArgumentParser:
    """A subcommand that reads CONFIG and ``key=value`` overrides. With an ``example`` (added to
    the epilog) it also takes options among the overrides, in any order (intermixed)."""
    options = example is not None
    sub = commands.add_parser(name, help=text, description=text + ("." if options else ""),
                              intermixed=options,
                              epilog=EPILOG.format(presets=_presets()) + (example or ""),
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    sub.add_argument("config", metavar="CONFIG", help="YAML path or preset name")
    # default=[]: else intermixed parsing calls the overrides required when CONFIG is missing.
    sub.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides",
                     **({"default": []} if options else {}))
    return sub


SCHEDULE_HELP = ("print (and with --png draw) the config's pipeline schedule: which stage does "
                 "what at every tick, its bubble and what each stage holds")


def _add_schedule(commands) -> None:
    sub = _config_command(commands, "schedule", SCHEDULE_HELP,
                          "\nExample:\n  jaxpar schedule tiny mesh.pipe=4 mesh.data=2 "
                          "model.n_layers=8 train.microbatches=8 train.batch_size=16 "
                          "parallel.pipeline_schedule=interleaved parallel.virtual_stages=2 "
                          "--png schedule.png")
    sub.add_argument("--png", metavar="FILE", help="draw the timeline (stages x ticks, "
                     "forward/backward/idle coloured) to FILE (needs matplotlib)")


def run_schedule(args: argparse.Namespace, cfg: Config) -> int:
    """Print the schedule table of ``cfg`` (validated), its bubble and stash; draw it."""
    from jaxpar.parallel.pipeline import describe  # noqa: PLC0415
    from jaxpar.parallel.pipeline_schedules import render, schedule_table  # noqa: PLC0415

    p, m, v = cfg.mesh.pipe, cfg.train.microbatches, cfg.parallel.virtual_stages
    if p == 1:
        raise ConfigError("mesh.pipe=1: no pipeline to schedule; set mesh.pipe > 1 (and "
                          "train.microbatches)")
    name = cfg.parallel.pipeline_schedule
    table, info = schedule_table(name, p, m, v), describe(name, p, m, v)
    title = (f"{name}: {p} stages" + (f" x {v} chunks" if v > 1 else "") + f", {m} "
             f"microbatches, {info['ticks']} ticks, bubble {info['bubble']:.1%}")
    print(title)
    print(render(table))
    print(f"executed: {info['steps']} steps ({', then '.join(info['stretches'])}); every stage "
          f"runs every slot, so '.' is a masked slot: work factor "
          f"{info['executed_work_factor']:.2f} x the useful work")
    print(f"each device holds at most {info['activation_slots']} arrived inputs, "
          f"{info['residual_slots']} forward residual sets and {info['gradient_slots']} output "
          "gradients between forward and backward")
    if args.png:
        from jaxpar.inspect.picture import draw_schedule  # noqa: PLC0415

        draw_schedule(table, Path(args.png).expanduser(), title)
        print(f"drew the schedule to {args.png}")
    return 0


EXPORT_HELP = "write a checkpoint's weights for use outside jaxpar (--format jaxpar or hf)"
IMPORT_HELP = "convert a Hugging Face model directory into a jaxpar checkpoint (train.init_from)"


def _add_export(commands) -> None:
    sub = commands.add_parser("export", help=EXPORT_HELP, description=EXPORT_HELP + ".",
                              epilog="CKPT is a step directory (runs/tiny/checkpoints/200), or a "
                              "run or checkpoints directory (its newest complete checkpoint).\n"
                              "Example:\n  jaxpar export runs/tiny --to exported/tiny --format hf",
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    sub.add_argument("checkpoint", metavar="CKPT", help="checkpoint step, run or checkpoints "
                     "directory")
    sub.add_argument("--to", metavar="DIR", required=True, help="output directory (created)")
    sub.add_argument("--format", choices=("jaxpar", "hf"), default="jaxpar", help="jaxpar "
                     "(default): stacked parameters by slash name; hf: what transformers loads")
    sub.add_argument("--max-shard-size", default="5GB", help="hf: largest file (500MB, 2GiB)")
    sub = commands.add_parser("import-hf", help=IMPORT_HELP, description=IMPORT_HELP + ".")
    sub.add_argument("source", metavar="DIR", help="Llama, Mistral, Qwen2/3, Mixtral, Qwen3-MoE")
    sub.add_argument("--to", metavar="CKPT_DIR", required=True, help="output directory (new)")


INSPECT_HELP = ("compile one train step without running it and show, per device, parameter "
                "shardings, memory, collectives and flops")


def _tolerance(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1), got {text!r}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value


PLAN_HELP = ("predict, from the config alone (no compile), memory, collective bytes per mesh axis, "
             "flops and step time per device on a hardware profile; --search ranks every layout")


def _add_plan(commands) -> None:
    from jaxpar.inspect.hardware import PROFILES  # noqa: PLC0415  (plain data, no jax)

    sub = _config_command(commands, "plan", PLAN_HELP, "\nExample:\n  jaxpar plan llama-1b "
                          "--search --devices 64 --hardware h100")
    sub.add_argument("--hardware", default="h100", choices=sorted(PROFILES),
                     help="hardware profile: peak flops, HBM and link bandwidths (default h100)")
    sub.add_argument("--search", action="store_true",
                     help="rank every mesh layout of the device count by estimated step time, "
                     "with the reason each rejected layout fails")
    sub.add_argument("--devices", metavar="N", type=_positive_int,
                     help="device count (default: host_devices, else the mesh's product)")


def _add_inspect(commands) -> None:
    sub = _config_command(commands, "inspect", INSPECT_HELP,
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
    sub.add_argument("--tolerance", metavar="T", type=_tolerance, default=0.1,
                     help="relative difference --strict allows (default 0.1: 10%%)")
    sub.add_argument("--png", metavar="FILE", help="draw the mesh, how each parameter group is "
                     "split over it, and the collectives per axis (needs matplotlib: "
                     "pip install -e '.[plot]')")
    devices = sub.add_mutually_exclusive_group()
    devices.add_argument("--devices", metavar="N", type=_positive_int,
                         help="compile for N virtual CPU devices (overrides host_devices); "
                         "nothing is allocated, so large layouts can be checked on a laptop")
    devices.add_argument("--target", metavar="TPU",
                         help="compile ahead of time for a TPU slice instead, with the TPU "
                         "compiler, on this machine (nothing runs; host_devices is ignored; "
                         "needs pip install -e '.[tpu]'): tpu-GENERATION:TOPOLOGY, one of "
                         "tpu-v4:2x2x1, tpu-v5e:2x4, tpu-v5p:2x2x1, tpu-v6e:4x4, tpu-v7x:2x2x1, "
                         "...; the mesh spans the slice's devices")


def load_validated(name: str, overrides: list[str], join: bool = False) -> Config:
    """Read, override, pick the devices (before jax starts), and validate. With ``join`` (only
    ``train``: inspect, plan and schedule stay one process), first join the multi-process
    runtime when the ``distributed`` section asks for it, so the mesh spans every process."""
    from jaxpar.distributed import barrier, start_distributed  # noqa: PLC0415
    from jaxpar.mesh import device_count, use_host_devices  # noqa: PLC0415

    cfg = load_config(name, overrides)
    if join:
        use_host_devices(cfg.host_devices)
        start_distributed(cfg.distributed)
    count = device_count(cfg)
    if join:
        # A process that leaves while another still sets up its devices (they swap topologies
        # through process 0) breaks that set-up: so none reports a config error before all are up.
        barrier("devices_ready", cfg.distributed.timeout_s)
    return validate(cfg, count)


def run_train(args: argparse.Namespace) -> tuple[int, str]:
    """``jaxpar train``: the exit code and, if it failed, why (under several processes, also
    the start-up barrier and the watch for other processes' failures)."""
    from jaxpar.distributed import barrier, watch_for_failures  # noqa: PLC0415

    cfg = load_validated(args.config, list(args.overrides), join=True)
    watch_for_failures()
    # Every process checked the same config: none compiles while another already failed.
    barrier("config_checked", cfg.distributed.timeout_s)
    # Imported only now: a config error costs no import of the training stack.
    from jaxpar.train.loop import NonFiniteError, train  # noqa: PLC0415

    try:
        train(cfg)
    except NonFiniteError as err:
        return 1, _print_error(err)
    return 0, ""


def _print_error(err: BaseException | str) -> str:
    """``jaxpar: error: ...`` on one line; under several processes it names the process.
    Returns the message without the prefixes."""
    label = ""
    if _multi_process():
        from jaxpar.distributed import process_label  # noqa: PLC0415

        label = process_label() + ": "
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    print(f"jaxpar: error: {label}{text}", file=sys.stderr, flush=True)
    return text


def _multi_process() -> bool:
    """Whether this process joined a multi-process runtime (without importing jax if no code
    has yet: a config error must cost no jax start-up)."""
    if "jax" not in sys.modules:
        return False
    import jax  # noqa: PLC0415

    return jax.distributed.is_initialized()


def _train_guarded(args: argparse.Namespace) -> int:
    """:func:`run_train`; a failure under several processes ends this process at once.

    A process that fails must not linger in the runtime's graceful shut-down: while it waits
    there, the others sit in a collective with it until ``distributed.timeout_s`` runs out.
    Leaving at once closes its connections, so their collectives fail within seconds."""
    import traceback  # noqa: PLC0415

    from jaxpar.distributed import (  # noqa: PLC0415
        DistributedError,
        announce_failure,
        lost_processes,
    )

    code, reason = 1, ""
    try:
        code, reason = run_train(args)
    except ConfigError as err:
        reason, code = _print_error(err), 2
    except DistributedError as err:
        reason = _print_error(err)
    except KeyboardInterrupt:
        reason = _print_error("interrupted")
    except Exception as err:  # noqa: BLE001
        if not _multi_process():
            raise
        traceback.print_exc()
        lost = lost_processes()
        cause = (f"process {', '.join(map(str, lost))} is gone; " if lost else "")
        reason = _print_error(f"{cause}{type(err).__name__}: {err}")
    if code != 0 and _multi_process():
        announce_failure(reason)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _require_matplotlib() -> None:
    """--png needs matplotlib: say so before compiling, not after."""
    import importlib.util  # noqa: PLC0415

    if importlib.util.find_spec("matplotlib") is None:
        raise ConfigError("--png needs matplotlib: pip install -e '.[plot]'")


def _check_output_dir(flag: str, path: str | None) -> None:
    """Fail before compiling, not after, when an output file cannot be created."""
    if path is not None and path != "-" and not Path(path).expanduser().parent.is_dir():
        raise ConfigError(f"{flag} {path}: directory {Path(path).parent} does not exist")


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
        from jaxpar.inspect.picture import draw_report  # noqa: PLC0415

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


def run_export(args: argparse.Namespace) -> int:
    # export and import-hf; the Hugging Face bodies live with the conversion, as plan's does.
    if args.command == "import-hf":
        from jaxpar.train.hf_import import import_hf_main  # noqa: PLC0415

        return import_hf_main(Path(args.source), Path(args.to))
    if args.format == "hf":
        from jaxpar.train.hf_export import export_hf_main  # noqa: PLC0415

        return export_hf_main(Path(args.checkpoint), Path(args.to), args.max_shard_size)
    from jaxpar.train.weights import export  # noqa: PLC0415  (imports jax and orbax)

    weights, config_json, step = export(Path(args.checkpoint), Path(args.to).expanduser())
    print(f"exported step {step}: {weights} and {config_json}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command in ("export", "import-hf"):
            return run_export(args)
        if args.command == "generate":
            return run_generate(args)
        overrides = list(args.overrides)
        target = None
        if args.command == "schedule":
            _check_output_dir("--png", args.png)
            if args.png:
                _require_matplotlib()
            return run_schedule(args, load_validated(args.config, overrides))
        if args.command == "inspect":
            _check_output_dir("--json", args.json)
            _check_output_dir("--hlo", args.hlo)
            _check_output_dir("--png", args.png)
            if args.png:
                _require_matplotlib()
            if args.devices is not None:  # last, so it wins over a host_devices override
                overrides.append(f"host_devices={args.devices}")
            if args.target is not None:  # a bad target or a missing libtpu: before the config
                target = parse_target(args.target)
                require_libtpu()
        if target is not None:
            cfg, devices = load_for_target(args.config, overrides, target)
            return run_inspect(args, cfg, devices, target)
        if args.command == "plan":  # no compile and no devices needed: jax's backend stays off
            from rich.console import Console  # noqa: PLC0415

            from jaxpar.inspect.plan import plan_main  # noqa: PLC0415

            console = Console(soft_wrap=True)
            if not console.is_terminal:  # a file or pipe has no width: don't squeeze tables
                console.width = max(console.width, 140)
            return plan_main(load_config(args.config, overrides), hardware=args.hardware,
                             search=args.search, device_count=args.devices, console=console)
        if args.command == "train":
            return _train_guarded(args)
        cfg = load_validated(args.config, overrides)
        if args.command == "config":
            print(to_yaml(cfg), end="")
            return 0
        return run_inspect(args, cfg)
    except ConfigError as err:
        print(f"jaxpar: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("jaxpar: interrupted", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
