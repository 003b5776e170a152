"""The training loop: data in, steps, progress, log lines, ``run_dir`` files, a final summary."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np
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
from jaxpar.mesh import make_mesh
from jaxpar.model.flops import param_count, train_flops_per_token
from jaxpar.train.metrics import MetricsFile, peak_flops
from jaxpar.train.step import build_trainer


@dataclass(frozen=True)
class Summary:
    steps: int
    first_loss: float
    last_loss: float
    tokens_per_s: float
    train_seconds: float
    compile_seconds: float
    run_dir: str


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
    """Run ``cfg`` (validated) to ``train.steps``; write ``run_dir`` files; return a summary."""
    console = console or Console(soft_wrap=True)
    t, log_every = cfg.train, cfg.logging.every
    data, data_line = make_data_iterator(cfg)
    mesh = make_mesh(cfg)
    trainer = build_trainer(cfg, mesh)

    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    metrics_file = MetricsFile(run_dir / "metrics.jsonl")

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
    console.print("peak " + (f"{peak / 1e12:.0f} TFLOP/s per device (bf16 dense)" if peak else
                             f"unknown for {device.device_kind!r}: MFU shown as n/a"))

    start = time.perf_counter()
    state = trainer.init()
    step_fn = trainer.compile_step()
    compile_seconds = time.perf_counter() - start
    console.print(f"compiled the train step in {compile_seconds:.1f} s; run_dir {run_dir}")

    losses: list[float] = []
    progress = Progress(TextColumn("[progress.description]{task.description}"), BarColumn(),
                        MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn(),
                        TextColumn("{task.fields[status]}"), console=console,
                        disable=not cfg.logging.progress, transient=True)
    train_start = interval_start = time.perf_counter()
    interval_steps = 0
    with progress:
        task = progress.add_task("train", total=t.steps, status="")
        for step in range(1, t.steps + 1):
            state, metrics = step_fn(state, trainer.put_batch(next(data)))
            interval_steps += 1
            if step % log_every == 0 or step == t.steps or step == 1:
                values = {k: np.asarray(v).tolist() for k, v in jax.device_get(metrics).items()}
                now = time.perf_counter()
                step_time = (now - interval_start) / interval_steps
                achieved = flops_per_step / step_time / jax.device_count()
                row = {"step": step, "loss": values["loss"], "grad_norm": values["grad_norm"],
                       "lr": values["lr"], "tokens_per_s": tokens_per_step / step_time,
                       "step_time_s": step_time, "tflops_per_device": achieved / 1e12,
                       "mfu": achieved / peak if peak else None}
                # Mixture of experts: aux losses, expert load, dropped slots, all-to-all padding.
                row.update({k: v for k, v in values.items() if k not in row})
                if not np.isfinite(row["loss"]):
                    raise FloatingPointError(f"loss is {row['loss']} at step {step}; "
                                             "lower train.lr or check the data")
                metrics_file.write(row)
                losses.append(row["loss"])
                console.print(_log_line(row, t.steps))
                progress.update(task, status=f"loss {row['loss']:.4f} | "
                                f"{row['tokens_per_s']:,.0f} tok/s")
                interval_start, interval_steps = time.perf_counter(), 0
            progress.advance(task)
    train_seconds = time.perf_counter() - train_start

    summary = Summary(steps=t.steps, first_loss=losses[0], last_loss=losses[-1],
                      tokens_per_s=tokens_per_step * t.steps / train_seconds,
                      train_seconds=train_seconds, compile_seconds=compile_seconds,
                      run_dir=str(run_dir))
    console.print(f"[bold]done[/bold]: {summary.steps} steps in {train_seconds:.1f} s | loss "
                  f"{summary.first_loss:.4f} -> {summary.last_loss:.4f} | "
                  f"{summary.tokens_per_s:,.0f} tokens/s | metrics in "
                  f"{run_dir / 'metrics.jsonl'}")
    return summary


def _log_line(row: dict, total_steps: int) -> str:
    mfu = f"{row['mfu']:.1%}" if row["mfu"] is not None else "n/a"
    moe = ""
    if "moe_aux_loss" in row:
        moe = (f" | moe aux {row['moe_aux_loss']:.3f} z {row['moe_z_loss']:.2f} | load min/max "
               f"{row['expert_load_min_max']:.2f} | dropped {row['dropped_fraction']:.1%}")
    return (f"step {row['step']:>{len(str(total_steps))}}/{total_steps} | loss {row['loss']:.4f} | "
            f"grad_norm {row['grad_norm']:.3f} | lr {row['lr']:.2e} | "
            f"{row['tokens_per_s']:,.0f} tok/s | {row['tflops_per_device']:.4f} TFLOP/s/device | "
            f"MFU {mfu}{moe}")

