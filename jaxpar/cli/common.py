"""What every ``jaxpar`` command shares: the parsers (one-line errors, options among the
overrides), the argument types, reading and validating a config, and one-line error output."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from jaxpar.config import PRESETS_DIR, Config, ConfigError, load_config, validate

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


def presets() -> str:
    names = sorted(p.stem for p in PRESETS_DIR.glob("*.yaml")) if PRESETS_DIR.is_dir() else []
    return ", ".join(names) or "none found"


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse exits 2 too; keep it to one line
        self.exit(2, f"jaxpar: error: {message} (see jaxpar --help)\n")


class SubParser(Parser):
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


def config_command(commands, name: str, text: str, example: str | None = None,
                   config_optional: bool = False) -> argparse.ArgumentParser:
    """A subcommand that reads CONFIG and ``key=value`` overrides. With an ``example`` (added to
    the epilog) it also takes options among the overrides, in any order (intermixed).
    ``config_optional``: an option can stand in for CONFIG (the command checks which)."""
    options = example is not None
    sub = commands.add_parser(name, help=text, description=text + ("." if options else ""),
                              intermixed=options,
                              epilog=EPILOG.format(presets=presets()) + (example or ""),
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    sub.add_argument("config", metavar="CONFIG", help="YAML path or preset name",
                     **({"nargs": "?"} if config_optional else {}))
    # default=[]: else intermixed parsing calls the overrides required when CONFIG is missing.
    sub.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides",
                     **({"default": []} if options else {}))
    return sub


def tolerance(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1), got {text!r}")
    return value


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value


def load_validated(name: str, overrides: list[str], join: bool = False) -> Config:
    """Read, override, pick the devices (before jax starts), and validate. With ``join`` (only
    ``train``: inspect, plan and schedule stay one process), first join the multi-process
    runtime when the ``distributed`` section asks for it, so the mesh spans every process."""
    from jaxpar.distributed import barrier, start_distributed  # noqa: PLC0415
    from jaxpar.mesh import device_count, use_compiler_flags, use_host_devices  # noqa: PLC0415

    cfg = load_config(name, overrides)
    use_compiler_flags(cfg)
    if join:
        use_host_devices(cfg.host_devices)
        start_distributed(cfg.distributed)
    count = device_count(cfg)
    if join:
        # A process that leaves while another still sets up its devices (they swap topologies
        # through process 0) breaks that set-up: so none reports a config error before all are up.
        barrier("devices_ready", cfg.distributed.timeout_s)
    return validate(cfg, count)


def print_error(err: BaseException | str) -> str:
    """``jaxpar: error: ...`` on one line; under several processes it names the process.
    Returns the message without the prefixes."""
    label = ""
    if multi_process():
        from jaxpar.distributed import process_label  # noqa: PLC0415

        label = process_label() + ": "
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    print(f"jaxpar: error: {label}{text}", file=sys.stderr, flush=True)
    return text


def multi_process() -> bool:
    """Whether this process joined a multi-process runtime (without importing jax if no code
    has yet: a config error must cost no jax start-up)."""
    if "jax" not in sys.modules:
        return False
    import jax  # noqa: PLC0415

    return jax.distributed.is_initialized()


def require_matplotlib() -> None:
    """--png needs matplotlib: say so before compiling, not after."""
    import importlib.util  # noqa: PLC0415

    if importlib.util.find_spec("matplotlib") is None:
        raise ConfigError("--png needs matplotlib: pip install -e '.[plot]'")


def check_output_dir(flag: str, path: str | None) -> None:
    """Fail before compiling, not after, when an output file cannot be created."""
    if path is not None and path != "-" and not Path(path).expanduser().parent.is_dir():
        raise ConfigError(f"{flag} {path}: directory {Path(path).parent} does not exist")
