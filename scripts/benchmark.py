"""Benchmark every parallel layout against the 1-device run of the same batch, in one process.

For a preset and a device count (virtual CPU devices by default), each layout of a named matrix
is compiled (timed), run for warm-up steps, then timed for ``--steps`` steps. Per layout it
reports the compile time, the compilations after the first step (``recompiles``: 0 unless a
step recompiled), the median and spread of the step time, tokens/s, compiled memory per
device, collective bytes per device, and compiled vs analytic flops -- and the ratios that
still mean something on a noisy, shared CPU, because both sides come from the same run:

- step time / the 1-device step of the same global batch, each timed step of the layout
  followed by one of the 1-device run, so that both come from the same minutes of a machine
  whose speed drifts (virtual devices share the same cores, so a layout that adds no redundant
  work sits near 1; a pipeline also executes its masked slots, so its target is its
  executed-work factor, shown beside it);
- compiled / analytic flops: matmul flops of the optimized HLO, loop trip counts included
  (:func:`jaxpar.inspect.hlo.flops.dot_flops`), over the plan's executed flops
  (:func:`jaxpar.cost.estimate.estimate`);
- memory / plan and bytes / plan: ``jaxpar inspect --compare``'s peak-memory ratio and the
  summed collective bytes of the compiled step over the plan's.

    python scripts/benchmark.py --quick                  # a subset, < 10 minutes on 2 cores
    python scripts/benchmark.py --layouts data,fsdp --json out.json --markdown out.md
    python scripts/benchmark.py --mfu                    # GPU/TPU: llama-1b in bf16, MFU

A layout that fails to validate (or to compile) is a row with the reason, not a crash.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from jaxpar.config import Config

DEFAULT_DEVICES = 8


class Layout(NamedTuple):
    """Config overrides for one row, on one of the MODELS (each has its own 1-device run)."""

    overrides: tuple[str, ...]
    model: str = "dense"


def _moe(cfg: Config) -> tuple[str, ...]:
    # 8 experts (so expert=8 divides them) in every second block, top-2, each half the dense
    # MLP's width, so the active flops per token stay close to the dense model's.
    return ("model.moe.num_experts=8", "model.moe.top_k=2", "model.moe.every=2",
            f"model.moe.d_ff_expert={cfg.model.d_ff // 2}")


def _long(cfg: Config) -> tuple[str, ...]:
    # Context parallelism is for long sequences: the same tokens per step as one sequence, so
    # that each of 8 devices holds a real piece of it (256 tokens with bench-cpu, not 16).
    # Blocks of 128: on XLA:CPU the 1-device run of bench-cpu's 2048-token sequence takes
    # 1.70 s with them and 2.47 s with the default 512 (the same matmul flops).
    return ("train.batch_size=1", f"train.seq_len={cfg.train.batch_size * cfg.train.seq_len}",
            "model.attention_block=128")


def _moe_long(cfg: Config) -> tuple[str, ...]:
    # The MoE model over long sequences, for the mix with context parallelism: two sequences
    # (expert parallelism splits the batch like data parallelism outside the experts) holding
    # the step's tokens.
    tokens = cfg.train.batch_size * cfg.train.seq_len
    return (*_moe(cfg), "train.batch_size=2", f"train.seq_len={tokens // 2}",
            "model.attention_block=128")


# Each model is the preset plus these overrides (computed from the preset and the command
# line's overrides), with its own 1-device baseline.
MODELS: dict[str, Callable[[Config], tuple[str, ...]]] = {
    "dense": lambda cfg: (),  # the preset's model
    "moe": _moe,
    "long": _long,
    "moe_long": _moe_long,
}
PIPE = ("mesh.pipe=2", "mesh.data=-1", "train.microbatches=4")

# "-1" takes the devices the other axes leave, so the pure layouts work for any device count.
LAYOUTS: dict[str, Layout] = {
    # Data parallelism as one runs it: ZeRO-1, each replica updating 1/N of the parameters
    # (Adam state and summed gradients split, parameters gathered after the update).
    "data": Layout(("mesh.data=-1", "parallel.zero=1")),
    # Everything replicated: every virtual device repeats the whole optimizer update on the
    # same cores, which on a GPU or TPU costs no time.
    "data_replicated": Layout(("mesh.data=-1",)),
    "fsdp": Layout(("mesh.data=1", "mesh.fsdp=-1")),
    "tensor": Layout(("mesh.data=1", "mesh.tensor=-1")),
    "tensor_sp": Layout(("mesh.data=1", "mesh.tensor=-1", "parallel.sequence_parallel=true")),
    "context_ring": Layout(("mesh.data=1", "mesh.context=-1", "parallel.context_impl=ring"),
                           "long"),
    "context_allgather": Layout(("mesh.data=1", "mesh.context=-1",
                                 "parallel.context_impl=allgather"), "long"),
    "pipe_gpipe": Layout((*PIPE, "parallel.pipeline_schedule=gpipe")),
    "pipe_1f1b": Layout((*PIPE, "parallel.pipeline_schedule=1f1b")),
    "pipe_interleaved": Layout((*PIPE, "parallel.pipeline_schedule=interleaved",
                                "parallel.virtual_stages=2")),
    "pipe_zero_bubble": Layout((*PIPE, "parallel.pipeline_schedule=zero_bubble")),
    "expert": Layout(("mesh.data=1", "mesh.expert=-1"), "moe"),
    "fsdp_tensor": Layout(("mesh.data=-1", "mesh.fsdp=2", "mesh.tensor=2")),
    # Mixes: 8 devices hold three axes of size 2.
    "pipe_fsdp_tensor_sp": Layout(("mesh.pipe=2", "mesh.data=1", "mesh.fsdp=2", "mesh.tensor=-1",
                                   "parallel.sequence_parallel=true", "train.microbatches=4",
                                   "parallel.pipeline_schedule=1f1b")),
    "expert_context_tensor": Layout(("mesh.data=1", "mesh.expert=2", "mesh.context=2",
                                     "mesh.tensor=-1"), "moe_long"),
    "pipe_expert_tensor": Layout(("mesh.pipe=2", "mesh.data=1", "mesh.expert=2",
                                  "mesh.tensor=-1", "train.microbatches=4",
                                  "parallel.pipeline_schedule=1f1b"), "moe"),
    # All five kinds (expert doubles as data parallelism outside the experts, as in
    # configs/demo-5d.yaml) need 16 devices: run with --devices 16. On 8 it is a row saying so,
    # which also shows that an invalid layout does not stop the run.
    "5d": Layout(("mesh.pipe=2", "mesh.data=1", "mesh.expert=2", "mesh.context=2",
                  "mesh.tensor=2", "parallel.sequence_parallel=true", "train.microbatches=4",
                  "parallel.pipeline_schedule=1f1b"), "moe"),
}
# Measured with bench-cpu on 2 cores: 2 min 44 s on 2026-12-03, 6 min 7 s on slower cores on
# 2026-12-04 with the 1-device steps alternated (the whole matrix: 5 min 57 s, 12 min 32 s)
# (docs/performance.md).
QUICK = ("data", "fsdp", "tensor_sp", "context_ring", "pipe_1f1b", "expert",
         "pipe_fsdp_tensor_sp")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="bench-cpu", help="preset name or YAML path")
    parser.add_argument("--devices", type=int, default=DEFAULT_DEVICES,
                        help="devices per layout (virtual CPU devices unless --mfu)")
    parser.add_argument("--layouts", help=f"comma-separated names from: {', '.join(LAYOUTS)}")
    parser.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per layout")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps after compiling")
    parser.add_argument("--json", help="write the results as JSON to this file")
    parser.add_argument("--markdown", help="write the Markdown table to this file")
    parser.add_argument("--mfu", action="store_true",
                        help="GPU/TPU only: MFU of configs/llama-1b.yaml in bf16 on all devices")
    parser.add_argument("overrides", nargs="*", help="key=value overrides for every run")
    return parser.parse_args(argv)


def chosen_layouts(args: argparse.Namespace) -> list[str]:
    """The layout names to run, in the matrix's order; unknown names are an error."""
    if args.layouts:
        names = [n.strip() for n in args.layouts.split(",") if n.strip()]
        unknown = [n for n in names if n not in LAYOUTS]
        if unknown:
            raise SystemExit(f"unknown layout(s) {', '.join(unknown)}; known: {', '.join(LAYOUTS)}")
        return names
    return list(QUICK if args.quick else LAYOUTS)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; jax must already see the devices (see ``__main__`` below)."""
    warnings.filterwarnings("ignore", message=".*libtpu.*")
    args = parse_args(argv)
    if args.mfu:
        from bench_mfu import run_mfu  # noqa: PLC0415

        return run_mfu(args.overrides, steps=args.steps, warmup=args.warmup)
    from bench_report import markdown_table  # noqa: PLC0415
    from bench_run import run_matrix  # noqa: PLC0415

    start = time.perf_counter()
    results = run_matrix(args.preset, [*args.overrides], chosen_layouts(args), LAYOUTS, MODELS,
                         devices=args.devices, steps=args.steps, warmup=args.warmup)
    results["wall_seconds"] = round(time.perf_counter() - start, 1)
    table = markdown_table(results)
    print(table)
    print(f"\n{len(results['rows'])} layouts in {results['wall_seconds']:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    if args.markdown:
        Path(args.markdown).write_text(table + "\n")
    return 0


def _early_devices(argv: list[str]) -> int | None:
    """``--devices`` read before jax starts (virtual CPU devices); None with ``--mfu``."""
    if "--mfu" in argv:
        return None  # the accelerator's own devices
    for i, arg in enumerate(argv):
        if arg.startswith("--devices="):
            return int(arg.split("=", 1)[1])
        if arg == "--devices" and i + 1 < len(argv):
            return int(argv[i + 1])
    return DEFAULT_DEVICES


if __name__ == "__main__":
    from jaxpar.mesh import use_host_devices

    # The virtual device count is fixed when jax starts a backend, so it is set before main().
    use_host_devices(_early_devices(sys.argv[1:]))
    raise SystemExit(main())
