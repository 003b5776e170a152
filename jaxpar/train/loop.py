"""The training loop: data in, steps, progress, log lines, ``run_dir`` files, a final summary.

Around the steps: resume from a checkpoint (``train.resume``), periodic asynchronous saves
(``checkpoint.every``) and one at the end, a save and a clean exit on SIGTERM/SIGINT, and the
reaction to non-finite steps (``train.on_nonfinite``), whose updates the step itself already
dropped on device.
"""

from __future__ import annotations

import math
import signal
import threading
import time
from dataclasses import dataclass
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

from jaxpar.config import Config, ConfigError, to_yaml
from jaxpar.data import DataIterator, build_dataset, describe, make_tokenizer
from jaxpar.inspect.report import pipeline_line
from jaxpar.mesh import make_mesh
from jaxpar.model.flops import param_count, train_flops_per_token
from jaxpar.parallel.pipeline import describe as describe_schedule
from jaxpar.train import checkpoint
from jaxpar.train.metrics import MetricsFile, peak_flops
from jaxpar.train.step import build_trainer


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
    """SIGTERM and SIGINT set a flag that the loop reads after each step, so it can save and exit
    cleanly; a second signal interrupts at once (KeyboardInterrupt)."""

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
        """Whether to stop after this step. Processes of one run must stop at the same step (a
        save and every step are collective), so with several they agree, at steps that wait for
        the device anyway (``synced_step``: log or save steps); one process stops at once."""
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


def make_data_iterator(cfg: Config) -> tuple[DataIterator, str]:
    """The per-process iterator over the training split, and a one-line description of it."""
    try:
        tokenizer = make_tokenizer(cfg.data.tokenizer)
        if tokenizer.vocab_size > cfg.model.vocab_size:
            raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the "
                              f"tokenizer's vocabulary ({tokenizer.vocab_size})")
        ds = build_dataset(cfg.data.source, tokenizer, cfg.train.seq_len, split="train",
                           val_fraction=cfg.data.val_fraction,
                           max_bytes=cfg.data.max_bytes or None)
        it = DataIterator(ds, cfg.train.batch_size, cfg.train.seed, jax.process_index(),
                          jax.process_count(), shuffle=cfg.data.shuffle)
    except ImportError as err:  # an optional package (tokenizers, pyarrow) the data needs
        raise ConfigError(str(err).splitlines()[0]) from None
    except ValueError as err:
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(str(err).splitlines()[0]) from None
    return it, describe(ds)


def train(cfg: Config, console: Console | None = None) -> Summary:
    """Run ``cfg`` (validated) to ``train.steps``; write ``run_dir`` files; return a summary.

    With ``train.resume`` (default ``auto``) it first continues from a checkpoint, and the steps
    after it are bitwise the steps an uninterrupted run takes.
    """
    console = console or Console(soft_wrap=True)
    t, log_every = cfg.train, cfg.logging.every
    run_dir = Path(cfg.run_dir)
    source = checkpoint.find_checkpoint(cfg)
    start_step = int(checkpoint.read_meta(source)["step"]) if source is not None else 0
    if start_step >= t.steps:
        console.print(f"{source} is at step {start_step} and train.steps={t.steps}: nothing to "
                      "train (raise train.steps to go on, or use another run_dir to start over)")
        return Summary(steps=start_step, first_loss=None, last_loss=None, tokens_per_s=0.0,
                       train_seconds=0.0, compile_seconds=0.0, run_dir=str(run_dir),
                       start_step=start_step)
    if cfg.checkpoint.enabled:  # before anything is written or compiled
        checkpoint.check_run_dir_free(cfg, start_step if source is not None else None)
    data, data_line = make_data_iterator(cfg)
    mesh = make_mesh(cfg)
    trainer = build_trainer(cfg, mesh)

    skipped = 0
    if source is not None:
        # Straight into this run's shardings, whatever mesh saved it.
        restored = checkpoint.restore(source, trainer.abstract_state)
        try:
            data.set_state(restored.data)
        except ValueError as err:
            raise checkpoint.CheckpointError(f"checkpoint {source}: {err}") from None
        # Checkpoints keep the layers in model order; an interleaved pipeline stores its own.
        state = trainer.from_model_order(restored.state)
        skipped = int(restored.meta.get("skipped_steps", 0))

    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    metrics_file = MetricsFile(run_dir / "metrics.jsonl", append=source is not None)
    metrics_file.keep_through(start_step)

    device = jax.devices()[0]
    peak = peak_flops(device.device_kind)
    flops_per_step = train_flops_per_token(cfg.model, t.seq_len) * t.batch_size * t.seq_len
    tokens_per_step = t.batch_size * t.seq_len
    mesh_line = " ".join(f"{a}={s}" for a, s in cfg.mesh_shape.items() if s > 1) or "1 device"
    console.print(f"[bold]jaxpar train[/bold] {jax.device_count()} x {device.device_kind} | "
                  f"mesh {mesh_line} | {param_count(cfg.model) / 1e6:.2f}M params | "
                  f"{t.dtype}, remat={t.remat}, zero={cfg.parallel.zero}, "
                  f"sequence_parallel={cfg.parallel.sequence_parallel}")
    moe = cfg.model.moe
    if moe.enabled:
        console.print(f"mixture of experts: {cfg.model.n_moe_layers} of {cfg.model.n_layers} "
                      f"blocks, {moe.num_experts} experts (top-{moe.top_k}, {moe.router} "
                      f"router, {moe.dispatch} dispatch), {cfg.mesh.expert}-way expert parallel")
    console.print(data_line)
    pipeline = (describe_schedule(cfg.parallel.pipeline_schedule, cfg.mesh.pipe, t.microbatches,
                                  cfg.parallel.virtual_stages) if cfg.mesh.pipe > 1 else None)
    if pipeline is not None:
        console.print(pipeline_line(pipeline))
    console.print("peak " + (f"{peak / 1e12:.0f} TFLOP/s per device (bf16 dense)" if peak else
                             f"unknown for {device.device_kind!r}: MFU shown as n/a"))
    if source is not None:
        console.print(f"resumed from step {start_step} ({source}) in {restored.seconds:.1f} s")

    start = time.perf_counter()
    if source is None:
        state = trainer.init()
    step_fn = trainer.compile_step()
    compile_seconds = time.perf_counter() - start
    console.print(f"compiled the train step in {compile_seconds:.1f} s; run_dir {run_dir}")

    saver = checkpoint.Saver(cfg) if cfg.checkpoint.enabled else None
    every = cfg.checkpoint.every
    saved_step = start_step if source is not None else None  # no need to save it again
    save_seconds: list[float] = []

    def save(step: int) -> None:
        nonlocal saved_step
        meta = {"step": step, "seed": t.seed, "skipped_steps": skipped,
                "mesh": cfg.mesh_shape, "saved_at": time.time()}
        save_seconds.append(saver.save(step, trainer.to_model_order(state), data.get_state(),
                                       meta))
        saved_step = step

    losses: list[float] = []
    pending: list[tuple[int, dict]] = []  # (step, metrics on device) not yet looked at
    progress = Progress(TextColumn("[progress.description]{task.description}"), BarColumn(),
                        MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn(),
                        TextColumn("{task.fields[status]}"), console=console,
                        disable=not cfg.logging.progress, transient=True)
    train_start = interval_start = time.perf_counter()
    interval_steps, step = 0, start_step
    try:
        with progress, _StopSignals() as signals:
            task = progress.add_task("train", total=t.steps, completed=start_step, status="")
            for step in range(start_step + 1, t.steps + 1):
                state, metrics = step_fn(state, trainer.put_batch(next(data)))
                pending.append((step, metrics))
                interval_steps += 1
                log_now = step % log_every == 0 or step == t.steps or step == start_step + 1
                save_now = saver is not None and every > 0 and step % every == 0
                stop_now = signals.stop_agreed(log_now or save_now)
                if log_now or save_now or stop_now:
                    # Reading metrics waits for the device, so it happens only here, and
                    # every step's non-finite flag is seen before anything is saved.
                    values, bad = _fetch(pending, t.on_nonfinite)
                    skipped += bad
                    pending.clear()
                if log_now:
                    now = time.perf_counter()
                    step_time = (now - interval_start) / interval_steps
                    achieved = flops_per_step / step_time / jax.device_count()
                    row = {"step": step, "loss": _finite_or_none(values["loss"]),
                           "grad_norm": _finite_or_none(values["grad_norm"]),
                           "lr": values["lr"], "tokens_per_s": tokens_per_step / step_time,
                           "step_time_s": step_time, "tflops_per_device": achieved / 1e12,
                           "mfu": achieved / peak if peak else None, "skipped_steps": skipped}
                    if pipeline is not None:  # the table's idle share: constant, every line
                        row["pipeline_bubble"] = pipeline["bubble"]
                    # Mixture of experts: aux losses, expert load, dropped slots, a2a padding.
                    row.update({k: v for k, v in values.items()
                                if k not in row and k != "nonfinite"})
                    metrics_file.write(row)
                    if row["loss"] is not None:
                        losses.append(row["loss"])
                    console.print(_log_line(row, t.steps))
                    progress.update(task, status=f"loss {values['loss']:.4f} | "
                                    f"{row['tokens_per_s']:,.0f} tok/s")
                    interval_start, interval_steps = time.perf_counter(), 0
                if saver is not None and (save_now or stop_now):
                    save(step)
                progress.advance(task)
                if stop_now:
                    break
            train_seconds = time.perf_counter() - train_start
            if saver is not None and saved_step != step:
                save(step)
    finally:
        if saver is not None:
            saver.close()  # whatever happened, let the save in flight finish on disk

    newest = str(saver.root / str(saved_step)) if saver is not None and saved_step else None
    if saver is not None and save_seconds:
        console.print(f"checkpoint {newest} (keeping the newest {cfg.checkpoint.keep}; each "
                      f"save blocked the loop {1e3 * sum(save_seconds) / len(save_seconds):.0f}"
                      " ms on average)")
    run_steps = step - start_step
    summary = Summary(steps=step, first_loss=losses[0] if losses else None,
                      last_loss=losses[-1] if losses else None,
                      tokens_per_s=tokens_per_step * run_steps / train_seconds,
                      train_seconds=train_seconds, compile_seconds=compile_seconds,
                      run_dir=str(run_dir), start_step=start_step, skipped_steps=skipped,
                      stopped_by=signals.received if step < t.steps else None,
                      checkpoint=newest)
    skipped_text = f" | {skipped} updates skipped (non-finite)" if skipped else ""
    if summary.stopped_by is not None:
        console.print(f"[bold]stopped[/bold] by {summary.stopped_by} at step {step}/{t.steps}"
                      + (f"; saved {newest}; run the same command to continue" if newest else
                         " (checkpoint.enabled=false: nothing saved)") + skipped_text)
        return summary
    console.print(f"[bold]done[/bold]: {run_steps} steps in {train_seconds:.1f} s | loss "
                  f"{_fmt(summary.first_loss)} -> {_fmt(summary.last_loss)} | "
                  f"{summary.tokens_per_s:,.0f} tokens/s{skipped_text} | metrics in "
                  f"{run_dir / 'metrics.jsonl'}")
    return summary


def _fetch(pending: list[tuple[int, dict]], on_nonfinite: str) -> tuple[dict, int]:
    """Host copies of the newest step's metrics, and how many pending steps were non-finite
    (their updates were dropped on device). With ``stop``, the first one raises."""
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


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"


def _log_line(row: dict, total_steps: int) -> str:
    mfu = f"{row['mfu']:.1%}" if row["mfu"] is not None else "n/a"
    grad_norm = "n/a" if row["grad_norm"] is None else f"{row['grad_norm']:.3f}"
    skipped = f" | skipped {row['skipped_steps']}" if row["skipped_steps"] else ""
    moe = ""
    if "moe_aux_loss" in row:
        moe = (f" | moe aux {row['moe_aux_loss']:.3f} z {row['moe_z_loss']:.2f} | load min/max "
               f"{row['expert_load_min_max']:.2f} | dropped {row['dropped_fraction']:.1%}")
    return (f"step {row['step']:>{len(str(total_steps))}}/{total_steps} | loss "
            f"{_fmt(row['loss'])} | grad_norm {grad_norm} | lr {row['lr']:.2e}{skipped} | "
            f"{row['tokens_per_s']:,.0f} tok/s | {row['tflops_per_device']:.4f} TFLOP/s/device | "
            f"MFU {mfu}{moe}")

