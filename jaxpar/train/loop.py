"""The training loop: data in, steps, progress, log lines, ``run_dir`` files, a final summary.

Around the steps: resume (``train.resume``), asynchronous saves (``checkpoint.every``) and one
at the end, a save and clean exit on SIGTERM/SIGINT, and the reaction to non-finite steps
(``train.on_nonfinite``), whose updates the step already dropped on device.

Under several processes each runs this loop on its own devices and rows; only process 0 speaks
(console, progress bar, ``metrics.jsonl``, ``config.yaml``). Stop decisions agree everywhere:
signals are agreed at log and save steps, non-finite steps read from the same replicated
metrics, and the data never ends.
"""

from __future__ import annotations

import dataclasses
import math
import signal
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from jaxpar.checkpoint import state as checkpoint
from jaxpar.checkpoint import weights
from jaxpar.checkpoint.weights_only import step_dir
from jaxpar.config import (
    Config,
    ConfigError,
    DistributedConfig,
    documents_masked,
    slices_line,
    to_yaml,
)
from jaxpar.data import (
    DataIterator,
    check_vocabulary,
    dataset_line,
    open_mixture,
    open_source,
)
from jaxpar.distributed import barrier
from jaxpar.hardware import peak_flops
from jaxpar.mesh import make_mesh
from jaxpar.model.flop_formula import param_count, train_flops_per_token
from jaxpar.parallel.pipeline.executor import describe_config as describe_schedule
from jaxpar.train.init_from import initial_state
from jaxpar.train.metrics import MetricsFile, fmt, log_line, mesh_text, pipeline_line, val_text
from jaxpar.train.observe import Observer, require_packages
from jaxpar.train.step import Trainer, build_trainer
from jaxpar.train.tracking import PlanFn
from jaxpar.train.validation_loss import Validation, eval_due, make_validation, validation_data


@dataclass(frozen=True)
class Summary:
    steps: int  # the step the run ended at (train.steps, unless a signal stopped it early)
    first_loss: float | None  # first and last logged loss of this process (None: none logged)
    last_loss: float | None
    tokens_per_s: float
    train_seconds: float
    compile_seconds: float
    run_dir: str
    start_step: int = 0  # the checkpoint step it resumed from (0: a fresh start)
    skipped_steps: int = 0  # updates dropped for a non-finite loss or gradient norm, whole run
    stopped_by: str | None = None  # "SIGTERM" or "SIGINT" when a signal ended it early
    checkpoint: str | None = None  # the newest checkpoint this process saved


class NonFiniteError(RuntimeError):
    """``train.on_nonfinite=stop`` met a non-finite loss or gradient norm (exit code 1)."""


class _StopSignals:
    """SIGTERM and SIGINT set a flag the loop reads after each step, to save and exit cleanly; a
    second signal interrupts at once (KeyboardInterrupt)."""

    def __init__(self) -> None:
        self.received: str | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _StopSignals:
        if threading.current_thread() is threading.main_thread():  # Python's rule for handlers
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received is not None:
            raise KeyboardInterrupt
        self.received = signal.Signals(signum).name

    def stop_agreed(self, synced_step: bool) -> bool:
        """Whether to stop after this step. Processes must stop at the same step (saves and steps
        are collective), so several agree at steps that wait anyway (``synced_step``: log or
        save); one process stops at once."""
        if jax.process_count() == 1:
            return self.received is not None
        if not synced_step:
            return False
        flags = multihost_utils.process_allgather(np.int32(self.received is not None))
        if self.received is None and np.any(flags):
            self.received = "a signal to another process"
        return bool(np.any(flags))

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def make_data_iterator(cfg: Config, split: str = "train") -> tuple[DataIterator, str]:
    """The iterator over ``split`` (all rows; a process keeps its own with
    ``with_rows(trainer.local_batch_rows())``) and a one-line description. Validation is read
    in order (train/validation_loss.py scores the same batches every time)."""
    try:
        if cfg.data.sources:  # a mixture, which shuffles itself: the iterator reads it in order
            if split != "train":  # each source's held-out split is scored on its own
                raise ConfigError("a mixture's validation is read per source "
                                  "(train/validation_loss.py: validation_data)")
            ds = open_mixture([(s.path, s.weight) for s in cfg.data.sources], cfg.train.seq_len,
                              tokenizer=cfg.data.tokenizer, seed=cfg.train.seed,
                              shuffle=cfg.data.shuffle, checksums=cfg.data.verify)
            check_vocabulary(ds.vocab_size, cfg.model.vocab_size, "data.sources")
        else:
            ds = open_source(cfg.data, cfg.data.source, split, cfg.train.seq_len,
                             vocab_size=cfg.model.vocab_size)
        it = DataIterator(ds, cfg.train.batch_size, cfg.train.seed,
                          shuffle=cfg.data.shuffle and split == "train" and not cfg.data.sources,
                          segments=documents_masked(cfg))
    except ImportError as err:  # an optional package (tokenizers, pyarrow) the data needs
        raise ConfigError(str(err).splitlines()[0]) from None
    except ValueError as err:
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(str(err).splitlines()[0]) from None
    line = ds.describe() if cfg.data.sources else dataset_line(ds)
    return it, line + ("; attention within each document" if documents_masked(cfg) else "")


def train(cfg: Config, console: Console | None = None, plan: PlanFn | None = None) -> Summary:
    """Run ``cfg`` (validated) to ``train.steps``; write ``run_dir`` files; return a summary.
    ``plan``: the cost model's numbers for a tracked run's summary (from the command line: this
    layer does not import the cost model).

    ``train.resume`` (default ``auto``) first continues from a checkpoint; later steps are
    bitwise an uninterrupted run's. The five parts are :class:`_Run`'s methods.
    """
    console = console or Console(soft_wrap=True)
    if jax.process_index() != 0:  # one voice: the other processes print nothing
        console = Console(quiet=True)
    source = checkpoint.find_checkpoint(cfg)
    if source is not None and weights.is_weights_only(source):
        raise checkpoint.CheckpointError(f"train.resume={cfg.train.resume}: {source} holds only "
                                         "weights (jaxpar import-hf); start from it with "
                                         "train.init_from")
    start_step = int(source.name) if source is not None else 0  # step directories are named so
    if start_step >= cfg.train.steps:
        console.print(f"{source} is at step {start_step} and train.steps={cfg.train.steps}: "
                      "nothing to train (raise train.steps to go on, or use another run_dir to "
                      "start over)")
        return Summary(steps=start_step, first_loss=None, last_loss=None, tokens_per_s=0.0,
                       train_seconds=0.0, compile_seconds=0.0, run_dir=str(Path(cfg.run_dir)),
                       start_step=start_step)
    init_from = _init_source(cfg, source, console)
    run = _Run.start_up(cfg, console, source, start_step, init_from, plan)
    step = start_step = run.start_step  # older than asked if the checkpoint was damaged
    try:
        with run.progress, _StopSignals() as signals:
            task = run.progress.add_task("train", total=cfg.train.steps, completed=start_step,
                                         status="")
            for step in range(start_step + 1, cfg.train.steps + 1):
                run.observer.before_step(step)
                run.step(step)
                log_now, save_now = run.log_due(step), run.save_due(step)
                stop_now = signals.stop_agreed(log_now or save_now)
                if log_now or save_now or stop_now:
                    # Reading metrics waits for the device, so it happens only here, and
                    # every step's non-finite flag is seen before anything is saved.
                    values = run.fetch()
                if log_now:
                    run.log(step, values, task)
                if run.saver is not None and (save_now or stop_now):
                    run.save(step)
                run.observer.after_step(step, run.state)  # the step's one program: waits for all
                run.progress.advance(task)
                if stop_now:
                    break
            run.train_seconds = time.perf_counter() - run.train_start
            if run.saver is not None and run.saved_step != step:
                run.save(step)
    finally:
        run.observer.close()
        if run.saver is not None:
            run.saver.close()  # whatever happened, let the save in flight finish on disk
    # No process leaves while another still writes its part of the last checkpoint.
    barrier("train_done", cfg.distributed.timeout_s)
    return run.stop(step, signals.received)


def _init_source(cfg: Config, source: Path | None, console: Console) -> Path | None:
    """The checkpoint ``train.init_from`` starts from, or None. A checkpoint to resume wins:
    rerunning a fine-tuning command continues it."""
    if cfg.train.init_from is None:
        return None
    if source is not None:
        console.print(f"train.init_from={cfg.train.init_from} not used: resuming from step "
                      f"{source.name} ({source}) instead", markup=False)
        return None
    try:
        return step_dir(Path(cfg.train.init_from))
    except checkpoint.CheckpointError as err:
        raise checkpoint.CheckpointError(f"train.init_from={err}") from None


@dataclass
class _Run:
    """One run's moving parts: :meth:`start_up` (restoring a checkpoint if any), :meth:`step`
    (no waiting), :meth:`fetch` and :meth:`log` (the steps since the last look), :meth:`save`
    (asynchronous), :meth:`stop` (prints and returns the summary)."""

    cfg: Config
    console: Console
    trainer: Trainer
    data: DataIterator
    state: Any
    start_step: int
    saved_step: int | None  # the newest step on disk (None: none saved, nothing restored)
    skipped: int  # updates dropped for a non-finite loss or gradient norm, whole run
    metrics_file: MetricsFile | None  # None on every process but process 0
    peak: float | None  # dense bf16 peak FLOP/s of one device (None: unknown, MFU n/a)
    pipeline: dict | None  # parallel.pipeline.describe() when pipe > 1
    observer: Observer  # train.profile's trace, logging.tensorboard's events, logging.wandb
    step_fn: Any = None
    validation: Validation | None = None  # train.eval_every's held-out batches and eval step
    last_eval: str = ""  # the newest val_loss, kept on the progress bar between evaluations
    compile_seconds: float = 0.0
    saver: checkpoint.Saver | None = None
    progress: Progress | None = None
    losses: list[float] = field(default_factory=list)  # logged finite losses, in order
    pending: list[tuple[int, dict]] = field(default_factory=list)  # metrics not yet read
    save_seconds: list[float] = field(default_factory=list)  # how long each save blocked
    train_start: float = 0.0
    train_seconds: float = 0.0
    interval_start: float = 0.0  # when the steps since the last log line began
    interval_steps: int = 0

    # -- start-up ------------------------------------------------------------------------------

    @classmethod
    def start_up(cls, cfg: Config, console: Console, source: Path | None,
                 start_step: int, init_from: Path | None = None,
                 plan: PlanFn | None = None) -> _Run:
        """Check run_dir; build data, mesh, trainer; restore ``source`` (a checkpoint step
        directory; None: fresh, from ``init_from``'s weights if given); write ``config.yaml``;
        print the header; compile the step."""
        require_packages(cfg)  # a missing optional package: before anything is written
        if cfg.checkpoint.enabled:  # before anything is written or compiled
            checkpoint.check_run_dir_free(cfg, start_step if source is not None else None)
        data, data_line = make_data_iterator(cfg)  # data errors first: before any tracing
        held_out = validation_data(cfg, make_data_iterator)
        trainer = build_trainer(cfg, make_mesh(cfg))
        data = data.with_rows(trainer.local_batch_rows())
        validation = make_validation(cfg, trainer, held_out)
        state, skipped, restored = None, 0, None
        if source is not None:
            # Straight into this run's shardings, whatever mesh saved it; verified, and under
            # train.resume=auto an older checkpoint if this one is damaged.
            restored = checkpoint.resume(cfg, source, trainer.abstract_state,
                                         lambda line: console.print(line, markup=False))
            source, start_step = restored.path, int(restored.meta["step"])
            try:
                data.set_state(restored.data)
            except ValueError as err:
                raise checkpoint.CheckpointError(f"checkpoint {source}: {err}") from None
            # Checkpoints keep the layers in model order; an interleaved pipeline stores its own.
            state = trainer.from_model_order(restored.state)
            skipped = int(restored.meta.get("skipped_steps", 0))
        elif init_from is not None:
            state = initial_state(trainer, init_from)
            step_there = checkpoint.read_meta(init_from)["step"]
            console.print(f"weights from {init_from} (step {step_there} there); fresh optimizer, "
                          "step 0", markup=False)

        metrics_file = _run_dir_files(cfg, append=source is not None, start_step=start_step)

        device_kind = jax.devices()[0].device_kind
        pipeline = describe_schedule(cfg) if cfg.mesh.pipe > 1 else None
        run = cls(cfg=cfg, console=console, trainer=trainer, data=data, state=state,
                  start_step=start_step, saved_step=start_step if source is not None else None,
                  skipped=skipped, metrics_file=metrics_file, peak=peak_flops(device_kind),
                  pipeline=pipeline, observer=Observer(
                      cfg, start_step + 1, lambda line: console.print(line, markup=False), plan),
                  validation=validation)
        for line in start_lines(cfg, jax.device_count(), device_kind, data_line, pipeline):
            console.print(line)
        if validation is not None:
            console.print(validation.line, markup=False)
        for line in run.observer.start_lines:
            console.print(line, markup=False)
        if jax.process_count() > 1:
            console.print(f"{jax.process_count()} processes x {jax.local_device_count()} devices "
                          "(process 0 logs, writes metrics.jsonl and config.yaml)")
        if restored is not None:
            console.print(f"resumed from step {start_step} ({source}) in "
                          f"{restored.seconds:.1f} s")
        run._compile()
        return run

    def _compile(self) -> None:
        start = time.perf_counter()
        if self.state is None:
            self.state = self.trainer.init()
        self.step_fn = self.trainer.compile_step()
        if self.validation is not None:  # ahead of time too: no program compiles mid-run
            self.validation.compile()
        self.compile_seconds = time.perf_counter() - start
        steps = "train and eval steps" if self.validation is not None else "train step"
        self.console.print(f"compiled the {steps} in {self.compile_seconds:.1f} s; run_dir "
                           f"{Path(self.cfg.run_dir)}")
        self.saver = (checkpoint.Saver(self.cfg, self.trainer.abstract_state)
                      if self.cfg.checkpoint.enabled else None)
        self.progress = Progress(
            TextColumn("[progress.description]{task.description}"), BarColumn(),
            MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn(),
            TextColumn("{task.fields[status]}"), console=self.console,
            disable=not self.cfg.logging.progress or jax.process_index() != 0, transient=True)
        self.train_start = self.interval_start = time.perf_counter()

    # -- step ----------------------------------------------------------------------------------

    def step(self, step: int) -> None:
        """Dispatch one step; its metrics stay on device until :meth:`fetch`."""
        self.state, metrics = self.step_fn(self.state, self.trainer.put_batch(next(self.data)))
        self.pending.append((step, metrics))
        self.interval_steps += 1

    def log_due(self, step: int) -> bool:
        return (step % self.cfg.logging.every == 0 or step == self.cfg.train.steps
                or step == self.start_step + 1 or eval_due(self.cfg, step))

    def save_due(self, step: int) -> bool:
        every = self.cfg.checkpoint.every
        return self.saver is not None and every > 0 and step % every == 0

    def fetch(self) -> dict:
        """The newest step's metrics on the host; counts (``stop``: raises on) pending non-finite
        steps."""
        values, bad = _fetch(self.pending, self.cfg.train.on_nonfinite)
        self.skipped += bad
        self.pending.clear()
        return values

    # -- log -----------------------------------------------------------------------------------

    def log(self, step: int, values: dict, task: Any) -> None:
        """One metrics.jsonl row and console line, timed over the steps since the last."""
        t = self.cfg.train
        tokens_per_step = t.batch_size * t.seq_len
        flops_per_step = train_flops_per_token(self.cfg.model, t.seq_len) * tokens_per_step
        step_time = (time.perf_counter() - self.interval_start) / self.interval_steps
        achieved = flops_per_step / step_time / jax.device_count()
        row = {"step": step, "loss": _finite_or_none(values["loss"]),
               "grad_norm": _finite_or_none(values["grad_norm"]),
               "lr": values["lr"], "tokens_per_s": tokens_per_step / step_time,
               "step_time_s": step_time, "tflops_per_device": achieved / 1e12,
               "mfu": achieved / self.peak if self.peak else None,
               "skipped_steps": self.skipped}
        if self.pipeline is not None:  # the table's idle share: constant, every line
            row["pipeline_bubble"] = self.pipeline["bubble"]
        # A mixture of sources: each one's tokens so far (cumulative, global batches).
        row.update({f"tokens_seen/{n}": v for n, v in self.data.tokens_seen().items()})
        # Mixture of experts: aux losses, expert load, dropped slots, a2a padding.
        row.update({k: v for k, v in values.items() if k not in row and k != "nonfinite"})
        if self.validation is not None and eval_due(self.cfg, step):
            row.update(self.validation.evaluate(self.state))
            self.last_eval = val_text(row)
        if self.metrics_file is not None:
            self.metrics_file.write(row)
        self.observer.log(row)
        if row["loss"] is not None:
            self.losses.append(row["loss"])
        self.console.print(log_line(row, t.steps))
        self.progress.update(task, status=f"loss {values['loss']:.4f}{self.last_eval} | "
                             f"{row['tokens_per_s']:,.0f} tok/s")
        self.interval_start, self.interval_steps = time.perf_counter(), 0

    # -- save ----------------------------------------------------------------------------------

    def save(self, step: int) -> None:
        """Start an asynchronous checkpoint of ``step`` (layers in model order)."""
        meta = {"step": step, "seed": self.cfg.train.seed, "skipped_steps": self.skipped,
                "mesh": self.cfg.mesh_shape, "saved_at": time.time(),
                # the true vocabulary (also the config's) and the rows this layout padded it to
                "vocab_size": self.cfg.model.vocab_size, "vocab_rows": self.cfg.vocab_rows()}
        self.save_seconds.append(self.saver.save(step, self.trainer.to_model_order(self.state),
                                                 self.data.get_state(), meta))
        self.saved_step = step

    # -- stop ----------------------------------------------------------------------------------

    def stop(self, step: int, received: str | None) -> Summary:
        """The summary of a run ended at ``step`` (early if a signal was ``received``)."""
        cfg, saver = self.cfg, self.saver
        newest = (str(saver.root / str(self.saved_step)) if saver is not None and self.saved_step
                  else None)
        if saver is not None and self.save_seconds:
            blocked = 1e3 * sum(self.save_seconds) / len(self.save_seconds)
            self.console.print(f"checkpoint {newest} (keeping the newest {cfg.checkpoint.keep}; "
                               f"each save blocked the loop {blocked:.0f} ms on average)")
        run_steps, losses = step - self.start_step, self.losses
        summary = Summary(
            steps=step, first_loss=losses[0] if losses else None,
            last_loss=losses[-1] if losses else None,
            tokens_per_s=cfg.train.batch_size * cfg.train.seq_len * run_steps
            / self.train_seconds,
            train_seconds=self.train_seconds, compile_seconds=self.compile_seconds,
            run_dir=str(Path(cfg.run_dir)), start_step=self.start_step, skipped_steps=self.skipped,
            stopped_by=received if step < cfg.train.steps else None, checkpoint=newest)
        skipped = (f" | {self.skipped} updates skipped (non-finite)" if self.skipped else "")
        if summary.stopped_by is not None:
            self.console.print(
                f"[bold]stopped[/bold] by {summary.stopped_by} at step {step}/{cfg.train.steps}"
                + (f"; saved {newest}; run the same command to continue" if newest else
                   " (checkpoint.enabled=false: nothing saved)") + skipped)
            return summary
        self.console.print(
            f"[bold]done[/bold]: {run_steps} steps in {self.train_seconds:.1f} s | loss "
            f"{fmt(summary.first_loss)} -> {fmt(summary.last_loss)} | "
            f"{summary.tokens_per_s:,.0f} tokens/s{skipped} | metrics in "
            f"{Path(cfg.run_dir) / 'metrics.jsonl'}")
        return summary


def _run_dir_files(cfg: Config, append: bool, start_step: int) -> MetricsFile | None:
    """Write ``config.yaml``, open ``metrics.jsonl`` (process 0; None elsewhere)."""
    if jax.process_index() != 0:
        return None
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    # The process fields say how this process joined, not what the run is: a config.yaml loaded
    # later, by one process, must not try to join a runtime that is gone.
    joined = cfg.distributed
    run_cfg = dataclasses.replace(cfg, distributed=DistributedConfig(
        enabled=joined.enabled, timeout_s=joined.timeout_s))
    (run_dir / "config.yaml").write_text(to_yaml(run_cfg))
    metrics_file = MetricsFile(run_dir / "metrics.jsonl", append=append)
    metrics_file.keep_through(start_step)
    return metrics_file


def start_lines(cfg: Config, devices: int, device_kind: str, data_line: str,
                pipeline: Mapping[str, Any] | None) -> list[str]:
    """What a run prints before compiling: devices, mesh, model, settings, MoE, data, pipeline
    schedule, the peak behind MFU."""
    t = cfg.train
    lines = [f"[bold]jaxpar train[/bold] {devices} x {device_kind} | mesh "
             f"{mesh_text(cfg.mesh_shape)} | {param_count(cfg.model) / 1e6:.2f}M params | "
             f"{t.dtype}, remat={t.remat}"
             + (f" (every {t.remat_every})" if t.remat_every > 1 else "")
             + f", zero={cfg.parallel.zero}, "
             f"sequence_parallel={cfg.parallel.sequence_parallel}"]
    moe = cfg.model.moe
    if moe.enabled:
        lines.append(f"mixture of experts: {cfg.model.n_moe_layers} of {cfg.model.n_layers} "
                     f"blocks, {moe.num_experts} experts (top-{moe.top_k}, {moe.router} "
                     f"router, {moe.dispatch} dispatch), {cfg.mesh.expert}-way expert parallel")
    lines.append(data_line)
    if pipeline is not None:
        lines.append(pipeline_line(pipeline))
    if slices_line(cfg):
        lines.append(slices_line(cfg))
    peak = peak_flops(device_kind)
    lines.append("peak " + (f"{peak / 1e12:.0f} TFLOP/s per device (bf16 dense)" if peak else
                            f"unknown for {device_kind!r}: MFU shown as n/a"))
    return lines


def _fetch(pending: list[tuple[int, dict]], on_nonfinite: str) -> tuple[dict, int]:
    """Host copies of the newest metrics, and how many pending steps were non-finite (updates
    dropped on device). ``stop``: the first raises."""
    fetched = jax.device_get([metrics for _, metrics in pending])
    bad = 0
    for (step, _), values in zip(pending, fetched, strict=True):
        if values["nonfinite"]:
            if on_nonfinite == "stop":
                raise NonFiniteError(
                    f"non-finite loss or gradient at step {step} (loss "
                    f"{float(values['loss']):.6g}, grad_norm {float(values['grad_norm']):.6g}); "
                    "train.on_nonfinite=stop: stopped without saving this step or any after it "
                    "(lower train.lr or check the data; train.on_nonfinite=skip drops such "
                    "updates)")
            bad += 1
    # Scalars as floats; MoE's per-expert token counts stay lists.
    return {k: np.asarray(v).tolist() for k, v in fetched[-1].items()}, bad


def _finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None  # JSON has no NaN or Infinity
