"""Seeing where a run's time goes: a ``jax.profiler`` trace of chosen steps (``train.profile``),
and ``metrics.jsonl`` rows as TensorBoard scalars (``logging.tensorboard``) and a W&B run
(``logging.wandb``, :mod:`jaxpar.train.tracking`).

Process 0 alone writes: one process's trace shows every collective (the others wait in the
same ones), and one writer avoids duplicate events. Both trackers get the same scalars
(:func:`jaxpar.train.metrics.scalars`). tensorboardX and wandb are optional; a missing one is
a one-line config error before anything runs (:func:`require_packages`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

from jaxpar.config import Config, ConfigError
from jaxpar.train.metrics import scalars
from jaxpar.train.tracking import PlanFn, WandbRun, require_wandb

PROFILE_DIR = "profile"
TENSORBOARD_DIR = "tensorboard"


def require_packages(cfg: Config) -> None:
    """The optional packages the config asks for must be there (checked before any compile)."""
    require_tensorboard(cfg)
    require_wandb(cfg)


def require_tensorboard(cfg: Config) -> None:
    """With ``logging.tensorboard``, tensorboardX must import (checked before any compile)."""
    if not cfg.logging.tensorboard:
        return
    try:
        import tensorboardX  # noqa: F401, PLC0415  (optional extra)
    except ImportError:
        raise ConfigError("logging.tensorboard=true needs tensorboardX: pip install "
                          "'jaxpar[tensorboard]' (or set logging.tensorboard=false)") from None


class Observer:
    """One run's profiler trace, TensorBoard writer and W&B run, driven by the loop:
    :meth:`before_step`, :meth:`after_step`, :meth:`log` per row, :meth:`close` however the run
    ends. ``start_lines``: what the run prints about them."""

    def __init__(self, cfg: Config, first_step: int, say: Callable[[str], None],
                 plan: PlanFn | None = None):
        """``first_step``: this run's first step (not 1 after a resume); ``plan``: the plan's
        numbers for the W&B summary."""
        self.say = say
        run_dir = Path(cfg.run_dir)
        self.profile_dir = run_dir / PROFILE_DIR
        profile = cfg.train.profile
        speaks = jax.process_index() == 0
        self.first = profile.start_step if profile.enabled and speaks else None
        self.last = (profile.start_step or 0) + profile.steps - 1
        self.tracing = False
        start_line = (f"train.profile: steps {self.first}-{self.last} traced to "
                      f"{self.profile_dir}" if self.first is not None else None)
        if self.first is not None and self.first < first_step:
            start_line = (f"train.profile: the run resumed at step {first_step}, after "
                          f"train.profile.start_step={self.first}: no trace")
            self.first = None
        self.writer = None
        if cfg.logging.tensorboard and speaks:
            from tensorboardX import SummaryWriter  # noqa: PLC0415  (optional extra)

            # A resumed run logs again the steps after its checkpoint: purge_step hides those
            # the interrupted run wrote, as keep_through drops them from metrics.jsonl.
            self.writer = SummaryWriter(logdir=str(run_dir / TENSORBOARD_DIR),
                                        purge_step=first_step if first_step > 1 else None)
        self.tracker, wandb_line = WandbRun.open(cfg, first_step, say, plan)
        self.start_lines = [line for line in (start_line, wandb_line) if line is not None]

    def before_step(self, step: int) -> None:
        if step == self.first:
            jax.profiler.start_trace(str(self.profile_dir))
            self.tracing = True

    def after_step(self, step: int, outputs: Any) -> None:
        """Stop the trace after its last step, once the device finished it (steps dispatch
        asynchronously)."""
        if self.tracing and step == self.last:
            jax.block_until_ready(outputs)
            self._stop(f"steps {self.first}-{step}")

    def log(self, row: dict[str, Any]) -> None:
        """One row's scalars at its step, to each tracker asked for."""
        values = scalars(row)
        if self.tracker is not None:
            self.tracker.log(row["step"], values)
        if self.writer is None:
            return
        for name, number in values.items():
            self.writer.add_scalar(name, number, row["step"])
        self.writer.flush()  # a killed run keeps what it logged, as metrics.jsonl does

    def close(self) -> None:
        if self.tracing:  # a signal or an error ended the run inside the traced steps
            self._stop(f"steps {self.first}- (cut short)")
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        if self.tracker is not None:
            self.tracker.close()
            self.tracker = None

    def _stop(self, steps: str) -> None:
        jax.profiler.stop_trace()
        self.tracing = False
        traces = sorted(self.profile_dir.glob("plugins/profile/*/*.xplane.pb"))
        where = traces[-1] if traces else self.profile_dir
        self.say(f"profile of {steps} in {where} (open with xprof, or TensorBoard's profile "
                 f"plugin: tensorboard --logdir {self.profile_dir})")
