"""``jaxpar`` command line: ``train``, ``config``, ``inspect``, ``plan``, ``schedule``,
``export``, ``import-hf``, ``generate``, ``eval`` and ``tokenize``.

The config is read and checked before jax is imported, so ``host_devices`` can still choose the
number of virtual CPU devices, and a bad key or value costs no compile. Exit codes: 0 done,
2 bad usage/config/input, 1 failure while running.
"""

from __future__ import annotations

import argparse
import re
import sys

from jaxpar.cli.common import (
    EPILOG,
    Parser,
    SubParser,
    config_command,
    load_validated,
    positive_int,
    presets,
)
from jaxpar.cli.eval import add_eval, run_eval
from jaxpar.cli.generate import add_generate, run_generate
from jaxpar.cli.hf import add_hf, run_hf
from jaxpar.cli.inspect import add_inspect, inspect_command
from jaxpar.cli.plan import add_plan, plan_command
from jaxpar.cli.schedule import add_schedule, schedule_command
from jaxpar.cli.tokenize import add_tokenize, tokenize_command
from jaxpar.cli.train import train_command
from jaxpar.config import Config, ConfigError, to_yaml


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="jaxpar", description="Train transformer LMs with 5D parallelism in "
                     "JAX, and see what the compiler did.",
                     epilog=EPILOG.format(presets=presets()),
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                     parser_class=SubParser)
    for name, text in (("train", "train a model (writes run_dir/config.yaml, metrics.jsonl)"),
                       ("config", "print the resolved, validated config as YAML")):
        config_command(commands, name, text)
    add_inspect(commands)
    add_plan(commands)
    add_schedule(commands)
    add_hf(commands)
    add_generate(commands, positive_int)
    add_eval(commands, positive_int)
    add_tokenize(commands)
    return parser


def print_config(args: argparse.Namespace) -> int:
    cfg = load_validated(args.config, list(args.overrides))
    # Both sizes of the vocabulary: the true one (the field) and, as a comment (the YAML still
    # loads), the rows this layout pads the embedding and head to.
    print(re.sub(r"^(  vocab_size: \d+)$", lambda m: f"{m.group(1)}  # {vocab_note(cfg)}",
                 to_yaml(cfg), count=1, flags=re.MULTILINE), end="")
    return 0


def vocab_note(cfg: Config) -> str:
    """The padded vocabulary in words, for ``jaxpar config``."""
    rows, splits = cfg.vocab_rows(), cfg.vocab_splits()
    why = (f"model.vocab_multiple={cfg.model.vocab_multiple} and of the {splits} "
           f"device{'s' if splits > 1 else ''} splitting the vocabulary")
    return (f"true size; the embedding and head hold {rows} rows in this layout ("
            + (f"padded to a multiple of {why})" if rows > cfg.model.vocab_size else
               f"no padding: a multiple of {why})"))


COMMANDS = {"train": train_command, "config": print_config, "inspect": inspect_command,
            "plan": plan_command, "schedule": schedule_command, "export": run_hf,
            "import-hf": run_hf, "generate": run_generate, "eval": run_eval,
            "tokenize": tokenize_command}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except ConfigError as err:
        print(f"jaxpar: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("jaxpar: interrupted", file=sys.stderr)
        return 1
