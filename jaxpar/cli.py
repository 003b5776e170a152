"""``jaxpar`` command line: ``train`` and ``config``.

The config is read and checked before jax is imported, so ``host_devices`` can still choose the
number of virtual CPU devices, and a bad key or value costs no compile. Exit codes: 0 done,
2 bad usage/config/input, 1 failure while running.
"""

from __future__ import annotations

import argparse
import sys

from jaxpar.config import PRESETS_DIR, Config, ConfigError, load_config, to_yaml, validate

EPILOG = """\
CONFIG is a YAML file or a preset in configs/ ({presets}).
Overrides are dotted key=value pairs typed by the schema, e.g.
  jaxpar train tiny mesh.fsdp=2 mesh.tensor=2 parallel.sequence_parallel=true train.steps=20
Exit codes: 0 done, 2 bad usage/config/input, 1 failure while running."""


def _presets() -> str:
    names = sorted(p.stem for p in PRESETS_DIR.glob("*.yaml")) if PRESETS_DIR.is_dir() else []
    return ", ".join(names) or "none found"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse exits 2 too; keep it to one line
        self.exit(2, f"jaxpar: error: {message} (see jaxpar --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="jaxpar", description="Train transformer LMs with 5D parallelism in "
                     "JAX, and see what the compiler did.",
                     epilog=EPILOG.format(presets=_presets()),
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                     parser_class=_Parser)
    for name, text in (("train", "train a model (writes run_dir/config.yaml, metrics.jsonl)"),
                       ("config", "print the resolved, validated config as YAML")):
        sub = commands.add_parser(name, help=text, description=text,
                                  epilog=EPILOG.format(presets=_presets()),
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
        sub.add_argument("config", metavar="CONFIG", help="YAML path or preset name")
        sub.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides")
    return parser


def load_validated(name: str, overrides: list[str]) -> Config:
    """Read, override, pick the devices (before jax starts), and validate."""
    from jaxpar.mesh import device_count  # noqa: PLC0415  (imports jax)

    cfg = load_config(name, overrides)
    return validate(cfg, device_count(cfg))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = load_validated(args.config, args.overrides)
        if args.command == "config":
            print(to_yaml(cfg), end="")
            return 0
        from jaxpar.train.loop import train  # noqa: PLC0415

        train(cfg)
        return 0
    except ConfigError as err:
        print(f"jaxpar: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("jaxpar: interrupted", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
