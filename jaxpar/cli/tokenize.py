"""``jaxpar tokenize``: a corpus into shards of token ids, once, with a progress bar (the work is
:mod:`jaxpar.data.pretokenize`'s); ``--verify DIR`` checks a finished directory's checksums."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from jaxpar.cli.common import positive_int, tolerance
from jaxpar.config import ConfigError

if TYPE_CHECKING:  # the data package imports numpy: only when the command runs
    from rich.console import Console
    from rich.progress import Progress

    from jaxpar.data.pretokenize import TokenizeStats
    from jaxpar.data.shards import TokenIndex

TOKENIZE_HELP = ("tokenize a corpus once into shards of token ids, which train reads by random "
                 "access (data.source=DIR)")
EXAMPLES = """\
SOURCE is anything data.source accepts: stdlib, a file, directory or glob of .txt .md .py .jsonl
.parquet files, or a Hugging Face datasets directory (save_to_disk). Ctrl-C keeps every finished
shard; the same command with --resume goes on from them.
Examples:
  jaxpar tokenize ~/corpus/ --to data/corpus --tokenizer tokenizer.json
  jaxpar tokenize a.jsonl b.parquet --field content --to data/ab --val-fraction 0.005
  jaxpar tokenize --verify data/corpus     # every shard against its sha256
  jaxpar train tiny data.source=data/corpus data.tokenizer=tokenizer.json
Exit codes: 0 done, 2 bad usage or input, 1 interrupted or failed while running."""


def add_tokenize(commands) -> None:
    sub = commands.add_parser("tokenize", help=TOKENIZE_HELP, description=TOKENIZE_HELP + ".",
                              epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub.add_argument("sources", nargs="*", metavar="SOURCE", help="what to tokenize, in order")
    sub.add_argument("--to", metavar="DIR", help="output directory: new or empty, or the one to "
                     "--resume")
    sub.add_argument("--tokenizer", default="byte", metavar="T",
                     help="byte (default) or a tokenizer.json; train's data.tokenizer must match")
    sub.add_argument("--field", default="text", help="the JSON field, Parquet or datasets column "
                     "that holds the text (default text)")
    sub.add_argument("--val-fraction", type=tolerance, default=0.01, metavar="F",
                     help="documents held out in a validation split, by a hash of their key "
                     "(default 0.01, as data.val_fraction)")
    sub.add_argument("--workers", type=positive_int, default=_cores(), metavar="N",
                     help=f"tokenizer processes (default: the cores, {_cores()})")
    # No default here: the data package's, imported only when the command runs.
    sub.add_argument("--shard-tokens", type=positive_int, metavar="N", help="a shard ends "
                     "after the document that brings it to N tokens (default 2**27)")
    sub.add_argument("--resume", action="store_true", help="go on with an interrupted run in "
                     "DIR (same SOURCE and options), without redoing its finished shards")
    sub.add_argument("--verify", metavar="DIR", help="check every shard of a tokenized DIR "
                     "against its size and sha256 in index.json, and exit")


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def tokenize_command(args: argparse.Namespace) -> int:
    try:
        if args.verify is not None:
            if args.sources or args.to:
                raise ConfigError("--verify DIR takes no SOURCE and no --to")
            return _verify(Path(args.verify))
        if not args.sources or not args.to:
            raise ConfigError("jaxpar tokenize needs SOURCE... and --to DIR (or --verify DIR)")
        return _tokenize(args)
    except (ImportError, ValueError) as err:  # optional packages, sources, directories
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(str(err).splitlines()[0]) from None


def _tokenize(args: argparse.Namespace) -> int:
    from rich.console import Console  # noqa: PLC0415

    from jaxpar.data.pretokenize import DEFAULT_SHARD_TOKENS, TokenizeOptions, tokenize  # noqa: PLC0415

    options = TokenizeOptions(
        sources=tuple(args.sources), directory=Path(args.to).expanduser(),
        tokenizer=args.tokenizer, text_field=args.field, val_fraction=args.val_fraction,
        shard_tokens=args.shard_tokens or DEFAULT_SHARD_TOKENS, workers=args.workers,
        resume=args.resume)
    console = Console(soft_wrap=True)
    bar = _progress_bar(console)
    task = bar.add_task("tokenize", total=None, tokens=0, shards=0)
    done = {"shards": 0}

    def on_progress(stats: TokenizeStats) -> None:
        done["shards"] = stats.shards
        bar.update(task, completed=stats.text_bytes, tokens=stats.tokens, shards=stats.shards)

    try:
        with bar:
            index = tokenize(options, on_progress)
    except KeyboardInterrupt:
        print(f"jaxpar: interrupted: {done['shards']} finished shard(s) kept in {args.to}; the "
              "same command with --resume goes on from them", file=sys.stderr)
        return 1
    console.print(summary(str(options.directory), index), markup=False, highlight=False)
    return 0


def _progress_bar(console: Console) -> Progress:
    from rich.progress import (  # noqa: PLC0415
        FileSizeColumn,
        Progress,
        ProgressColumn,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
        TransferSpeedColumn,
    )
    from rich.text import Text  # noqa: PLC0415

    class TokensPerSecond(ProgressColumn):
        def render(self, task) -> Text:
            elapsed = task.elapsed or 0.0
            rate = task.fields["tokens"] / elapsed if elapsed > 0 else 0.0
            return Text(f"{task.fields['tokens']:,} tokens, {rate:,.0f} tokens/s")

    # Bytes of text read, not of files: a .parquet or .jsonl file's size says little about it.
    return Progress(SpinnerColumn(), TextColumn("{task.description}"), FileSizeColumn(),
                    TransferSpeedColumn(), TokensPerSecond(),
                    TextColumn("{task.fields[shards]} shards"), TimeElapsedColumn(),
                    console=console, disable=not console.is_terminal)


def summary(directory: str, index: TokenIndex) -> str:
    splits = "; ".join(f"{name} {sum(s.documents for s in shards):,} documents, "
                       f"{sum(s.tokens for s in shards):,} tokens in {len(shards)} shard(s)"
                       for name, shards in index.splits.items())
    return (f"tokenized into {directory}: {splits} ({index.dtype} ids, tokenizer "
            f"{index.tokenizer.name}); train from it with data.source={directory}")


def _verify(directory: Path) -> int:
    from jaxpar.data.shards import check_shards, read_index  # noqa: PLC0415

    label = f"--verify {directory}"
    index = read_index(directory, label)
    checked = check_shards(directory, index, None, checksums=True, label=label)
    print(f"{directory}: {checked} shard(s), every size and sha256 matches its index.json")
    return 0
