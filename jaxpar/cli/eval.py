"""``jaxpar eval``: its command line (the work is :mod:`jaxpar.evaluation.split_loss`).

As ``jaxpar generate``, the checkpoint's config is read without jax (``host_devices`` can still
choose the number of virtual CPU devices) and the mesh is one device unless ``--mesh`` or
``mesh.*`` say otherwise; the data is opened and checked before jax starts, so every input error
is one line, exit 2, before anything compiles.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

from jaxpar.cli.generate import checkpoint_command
from jaxpar.config import ConfigError

EVAL_HELP = ("score a checkpoint on a split of tokenized data, text or chat: loss, perplexity "
             "and bits per byte")


def add_eval(commands, positive_int: Callable[[str], int]) -> None:
    """The ``eval`` subcommand's arguments (``positive_int``: the CLI's N >= 1 type)."""
    sub = checkpoint_command(
        commands, "eval", EVAL_HELP,
        "DIR a directory written by jaxpar tokenize with the run's tokenizer (data.tokenizer), "
        "or anything data.source reads (text files; a chat .jsonl with data.loss_on=assistant "
        "scores the assistant's tokens), split by data.val_fraction as training splits it. "
        "The rows are train.seq_len long, train.batch_size to a batch, in file order; "
        "key=value overrides apply to the run's config (train.batch_size=16, host_devices=4, "
        "...). The mesh is one device unless --mesh or mesh.* say otherwise; any layout "
        "training runs works. docs/evaluation.md says which tokens and bytes are scored.",
        ["jaxpar eval runs/tiny --data data/tok",
         "jaxpar eval runs/tiny --data data/tok --batches 10 --mesh data=2,tensor=2 "
         "host_devices=4 --json eval.json",
         "jaxpar eval runs/sft --data jaxpar/data/toy_chat.jsonl data.loss_on=assistant"])
    sub.add_argument("--data", metavar="DIR", required=True, help="a tokenized directory "
                     "(jaxpar tokenize), or text or chat files as data.source reads them")
    sub.add_argument("--split", default="validation", choices=("validation", "train"),
                     help="which split to score (default validation)")
    sub.add_argument("--batches", type=positive_int, metavar="N", help="score the first N "
                     "batches only (default: the whole split)")
    sub.add_argument("--json", metavar="FILE", help="also write the numbers to FILE as JSON")


def run_eval(args: argparse.Namespace) -> int:
    """``jaxpar eval``: check every input, then load, compile, score, print."""
    from jaxpar.checkpoint.weights_only import saved_config, step_dir  # noqa: PLC0415
    from jaxpar.cli.generate import generation_config  # noqa: PLC0415  (imports no jax)
    from jaxpar.evaluation.split_loss import open_split  # noqa: PLC0415
    from jaxpar.mesh import use_host_devices  # noqa: PLC0415

    path = step_dir(Path(args.checkpoint))
    cfg = generation_config(args, saved_config(path))
    ds = open_split(cfg, args.data, args.split)
    out = Path(args.json).expanduser() if args.json else None
    if out is not None and not out.parent.is_dir():
        raise ConfigError(f"--json {args.json}: no directory {out.parent}")
    use_host_devices(cfg.host_devices)  # before anything starts jax's backend
    from jaxpar.checkpoint.state import read_meta  # noqa: PLC0415
    from jaxpar.evaluation.split_loss import (  # noqa: PLC0415
        check_devices,
        describe,
        evaluate,
        load_eval_state,
    )
    from jaxpar.mesh import make_mesh  # noqa: PLC0415
    from jaxpar.train.step import build_trainer  # noqa: PLC0415

    trainer = build_trainer(cfg, make_mesh(cfg, check_devices(cfg)))
    state = load_eval_state(trainer, path)
    result = evaluate(trainer, state, ds, checkpoint=str(path), batches=args.batches,
                      step=int(read_meta(path).get("step", 0)))
    print(describe(result), flush=True)
    if out is not None:
        out.write_text(json.dumps(result.to_json(), indent=1) + "\n")
    return 0
