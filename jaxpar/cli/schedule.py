"""``jaxpar schedule``: a pipeline schedule as a table of stages x ticks (and a picture), its
bubble and what each stage holds; no compile."""

from __future__ import annotations

import argparse
from pathlib import Path

from jaxpar.cli.common import check_output_dir, config_command, load_validated, require_matplotlib
from jaxpar.config import Config, ConfigError

SCHEDULE_HELP = ("print (and with --png draw) the config's pipeline schedule: which stage does "
                 "what at every tick, its bubble and what each stage holds")


SCHEDULE_EXAMPLE = ("\nExample:\n  jaxpar schedule tiny mesh.pipe=4 mesh.data=2 model.n_layers=8 "
                    "train.microbatches=8 train.batch_size=16 "
                    "parallel.pipeline_schedule=interleaved parallel.virtual_stages=2 "
                    "--png schedule.png")


def add_schedule(commands) -> None:
    sub = config_command(commands, "schedule", SCHEDULE_HELP, SCHEDULE_EXAMPLE)
    sub.add_argument("--png", metavar="FILE", help="draw the timeline (stages x ticks, "
                     "forward/backward/idle coloured) to FILE (needs matplotlib)")


def run_schedule(args: argparse.Namespace, cfg: Config) -> int:
    """Print the schedule table of ``cfg`` (validated), its bubble and stash; draw it."""
    from jaxpar.parallel.pipeline.executor import describe_config  # noqa: PLC0415
    from jaxpar.parallel.pipeline.schedules import schedule_table  # noqa: PLC0415
    from jaxpar.parallel.pipeline.timeline import render  # noqa: PLC0415

    p, v = cfg.mesh.pipe, cfg.parallel.virtual_stages
    if p == 1:
        raise ConfigError("mesh.pipe=1: no pipeline to schedule; set mesh.pipe > 1 (and "
                          "train.microbatches)")
    name, info = cfg.parallel.pipeline_schedule, describe_config(cfg)
    # train.grad_accum is folded in: the step runs one schedule over all its microbatches.
    table = schedule_table(name, p, info["microbatches"], v, cfg.parallel.pipeline_overlap)
    accum = cfg.train.grad_accum
    folded = (f" ({accum} micro-steps x {cfg.train.microbatches}: train.grad_accum folded in)"
              if accum > 1 else "")
    title = (f"{name}: {p} stages" + (f" x {v} chunks" if v > 1 else "") + f", "
             f"{info['microbatches']} microbatches{folded}, {info['ticks']} ticks, "
             f"bubble {info['bubble']:.1%}")
    print(title)
    print(render(table))
    # The output keeps the word 'steps' (a contract); the code calls them rounds.
    print(f"executed: {info['steps']} steps ({', then '.join(info['stretches'])}); every stage "
          f"runs every slot, so '.' is a masked slot: work factor "
          f"{info['executed_work_factor']:.2f} x the useful work")
    waits = info["weight_stash_slots"]
    print(f"each device holds at most {info['activation_slots']} arrived inputs, "
          f"{info['residual_slots']} forward residual sets and {info['gradient_slots']} output "
          "gradients between forward and backward"
          + (f", and {waits} W stashes (what an I leaves its W: each weight matmul's output "
             "gradient)" if waits else ""))
    if args.png:
        from jaxpar.pictures.figures import draw_schedule  # noqa: PLC0415

        draw_schedule(table, Path(args.png).expanduser(), title)
        print(f"drew the schedule to {args.png}")
    return 0


def schedule_command(args: argparse.Namespace) -> int:
    check_output_dir("--png", args.png)
    if args.png:
        require_matplotlib()
    return run_schedule(args, load_validated(args.config, list(args.overrides)))
