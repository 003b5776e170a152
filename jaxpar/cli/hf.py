"""``jaxpar export`` (jaxpar's flat format, or Hugging Face's) and ``jaxpar import-hf``; the
conversions themselves live in :mod:`jaxpar.hf` and :mod:`jaxpar.checkpoint.weights`."""

from __future__ import annotations

import argparse
from pathlib import Path

EXPORT_HELP = "write a checkpoint's weights for use outside jaxpar (--format jaxpar or hf)"


IMPORT_HELP = "convert a Hugging Face model directory into a jaxpar checkpoint (train.init_from)"


def add_hf(commands) -> None:
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
    sub.add_argument("--adapters-only", action="store_true", help="hf: a LoRA run's adapters "
                     "only, as a PEFT adapter directory (default: the merged model)")
    sub = commands.add_parser("import-hf", help=IMPORT_HELP, description=IMPORT_HELP + ".")
    sub.add_argument("source", metavar="DIR", help="Llama, Mistral, Qwen2/3, Mixtral, Qwen3-MoE")
    sub.add_argument("--to", metavar="CKPT_DIR", required=True, help="output directory (new)")


def run_hf(args: argparse.Namespace) -> int:
    # export and import-hf; the Hugging Face bodies live with the conversion, as plan's does.
    if args.command == "import-hf":
        from jaxpar.hf.importer import import_hf_main  # noqa: PLC0415

        return import_hf_main(Path(args.source), Path(args.to))
    if args.adapters_only and args.format != "hf":
        from jaxpar.config import ConfigError  # noqa: PLC0415

        raise ConfigError("--adapters-only: writes PEFT's adapter directory; add --format hf")
    if args.format == "hf" and args.adapters_only:
        from jaxpar.hf.peft import export_adapters_main  # noqa: PLC0415

        return export_adapters_main(Path(args.checkpoint), Path(args.to))
    if args.format == "hf":
        from jaxpar.hf.exporter import export_hf_main  # noqa: PLC0415

        return export_hf_main(Path(args.checkpoint), Path(args.to), args.max_shard_size)
    from jaxpar.checkpoint.weights import export  # noqa: PLC0415  (imports jax and orbax)

    weights, config_json, step = export(Path(args.checkpoint), Path(args.to).expanduser())
    print(f"exported step {step}: {weights} and {config_json}")
    return 0
