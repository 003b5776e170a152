"""Measuring one layout, and the matrix of them with their 1-device baselines (benchmark.py).

A layout is measured from one compiled executable: its compile time, then ``jaxpar inspect``'s
report of it (memory, collectives, flops; :func:`jaxpar.inspect.report.build_report`) and its
comparison with the plan (:func:`jaxpar.inspect.compare.compare_with_plan`), then its step times.
The steps run through ``Trainer.step``, the jitted step as training calls it, which reuses that
executable (the first step compiles nothing); ``recompiles`` counts the compilations after the
first step (:func:`bench_timing.step_times`): 0 unless a step's arguments changed layout, dtype
or shape from one step to the next. Each timed step of a layout is followed by one of its
1-device baseline, whose times (``baseline_step``) are the denominator of ``step_vs_1dev``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from bench_timing import Stepper, random_batch, spread, step_times
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from jaxpar.config import Config, ConfigError, load_config, validate
from jaxpar.cost.estimate import estimate
from jaxpar.inspect.compare import compare_with_plan
from jaxpar.inspect.hlo.flops import dot_flops
from jaxpar.inspect.report import build_report
from jaxpar.mesh import make_mesh
from jaxpar.parallel.pipeline.executor import describe_config
from jaxpar.train.compiled import CompiledStep
from jaxpar.train.metrics import mesh_text
from jaxpar.train.step import build_trainer


def measure(cfg: Config, devices: Sequence[Any], *, steps: int, warmup: int,
            baseline: Stepper | None = None) -> dict[str, Any]:
    """Compile, inspect and time the train step of validated ``cfg`` on ``devices``, its steps
    alternated with ``baseline``'s (a 1-device run's); without one (a baseline itself) the row
    keeps its own :class:`Stepper` as ``_stepper``."""
    trainer = build_trainer(cfg, make_mesh(cfg, devices=list(devices)))
    start = time.perf_counter()
    compiled = trainer.compile_step()
    compile_s = time.perf_counter() - start
    report = build_report(CompiledStep(cfg, trainer, compiled, compile_s))
    compare = compare_with_plan(report, cfg)
    plan = estimate(cfg)
    batch = random_batch(cfg, trainer)
    times, recompiles = step_times(trainer.step, trainer.init(), batch, warmup=warmup,
                                   steps=steps, alongside=baseline)
    timing = spread(times)
    if baseline is None:  # a baseline: its step, for the layouts' steps to alternate with
        paired = {"_stepper": Stepper(trainer.step, trainer.init(), batch)}
    else:
        paired = {"baseline_step": {k: round(v, 4) for k, v in spread(baseline.times).items()}}
    tokens = cfg.train.batch_size * cfg.train.seq_len
    compiled_bytes = sum(r["compiled_bytes"] or 0 for r in compare["collectives"])
    plan_bytes = sum(r["predicted_bytes"] or 0 for r in compare["collectives"])
    return {
        "mesh": mesh_text(cfg.mesh_shape),
        "devices": len(devices),
        "compile_s": round(compile_s, 2),
        "step": {k: round(v, 4) for k, v in timing.items()},
        "tokens_per_s": round(tokens / timing["median_s"], 1),
        "recompiles": recompiles,
        "memory": {"peak_bytes": report["memory"]["peak_bytes"],
                   "temp_bytes": report["memory"]["temp_bytes"],
                   "plan_peak_bytes": compare["memory"]["predicted_peak_bytes"]},
        "collectives": {"bytes": compiled_bytes, "plan_bytes": plan_bytes,
                        "rows": compare["collectives"]},
        "flops": {"compiled_dot": dot_flops(compiled.as_text()),
                  "plan_executed": plan.flops.executed, "plan_useful": plan.flops.model,
                  "xla_cost_analysis": report["flops"]["compiled"]},
        "work_factor": _work_factor(cfg),
        "_memory_ratio": compare["memory"]["peak_ratio"],
        **paired,
    }


def _work_factor(cfg: Config) -> float:
    """Executed work / useful work of the layout's pipeline (1 without one): masked slots run."""
    if cfg.mesh.pipe == 1:
        return 1.0
    return describe_config(cfg)["executed_work_factor"]


def _ratio(num: float | None, den: float | None) -> float | None:
    return round(num / den, 3) if num and den else None


def add_ratios(row: dict[str, Any], baseline: Mapping[str, Any] | None) -> None:
    """The ratios that hold on a noisy CPU: both sides of each come from this one run.

    ``work_vs_1dev`` is the matmul work all devices execute over the 1-device run's (compiled
    HLO, loops counted): virtual devices share the same cores, so it is the step-time ratio a
    layout without overhead would show. It is the executed-work factor for a pipeline (masked
    slots run), above 1 for flash-style context attention (block diagonals), and below 1 for
    experts split over devices (XLA:CPU's grouped matmul pads fewer rows per device).
    """
    ok = baseline is not None and baseline.get("status") == "ok"
    base_step = row.get("baseline_step", baseline["step"] if ok else {})
    step = _ratio(row["step"]["median_s"], base_step.get("median_s") if ok else None)
    work = _ratio(row["flops"]["compiled_dot"] * row["devices"],
                  baseline["flops"]["compiled_dot"] if ok else None)
    row["ratios"] = {
        "step_vs_1dev": step,
        "work_vs_1dev": work,
        "step_vs_1dev_per_work": round(step / work, 3) if step and work else None,
        "flops_vs_plan": _ratio(row["flops"]["compiled_dot"], row["flops"]["plan_executed"]),
        "memory_vs_plan": row.pop("_memory_ratio"),
        "bytes_vs_plan": _ratio(row["collectives"]["bytes"], row["collectives"]["plan_bytes"]),
    }


def run_one(name: str, cfg_args: tuple[str, Sequence[str]], devices: Sequence[Any], *,
            steps: int, warmup: int, baseline: Stepper | None = None) -> dict[str, Any]:
    """One row: measured, or ``status`` invalid/failed with the reason (never an exception)."""
    preset, overrides = cfg_args
    row: dict[str, Any] = {"name": name, "overrides": list(overrides)}
    try:
        cfg = validate(load_config(preset, overrides), len(devices))
    except ConfigError as err:
        return {**row, "status": "invalid", "reason": str(err)}
    try:
        row.update(measure(cfg, devices, steps=steps, warmup=warmup, baseline=baseline))
    except Exception as err:  # noqa: BLE001  (a row that says why beats a lost matrix)
        return {**row, "status": "failed", "reason": f"{type(err).__name__}: {err}"[:500]}
    return {**row, "status": "ok"}


def is_valid(cfg_args: tuple[str, Sequence[str]], devices: int) -> bool:
    """Whether the layout validates: an invalid one needs no 1-device baseline."""
    try:
        validate(load_config(*cfg_args), devices)
    except ConfigError:
        return False
    return True


def run_matrix(preset: str, overrides: list[str], names: list[str], layouts: Mapping[str, Any],
               models: Mapping[str, Callable[[Config], Sequence[str]]], *, devices: int,
               steps: int, warmup: int) -> dict[str, Any]:
    """Every named layout on the first ``devices`` devices, after the 1-device run of its model.

    ``layouts[name]`` has ``overrides`` and ``model``, a key of ``models`` (a function of the
    preset's config, with ``overrides``, giving that model's overrides); each model gets its
    own 1-device baseline, measured once, before its first valid layout.
    """
    base_cfg = load_config(preset, overrides)
    all_devices = jax.devices()
    baselines: dict[str, dict[str, Any]] = {}
    steppers: dict[str, Stepper] = {}  # each baseline's step, run alongside its layouts'
    rows: list[dict[str, Any]] = []
    with _progress() as progress:
        task = progress.add_task("benchmark", total=len(names), layout="")
        for name in names:
            layout = layouts[name]
            model = [*overrides, *models[layout.model](base_cfg)]
            cfg_args = (preset, [*model, *layout.overrides])
            if layout.model not in baselines and is_valid(cfg_args, devices):
                label = f"1-device ({layout.model})"
                progress.update(task, layout=label)
                base = run_one(label, (preset, [*model, "mesh.data=1"]), all_devices[:1],
                               steps=steps, warmup=warmup)
                if base["status"] == "ok":
                    steppers[layout.model] = base.pop("_stepper")
                    add_ratios(base, base)
                baselines[layout.model] = base
                rows.append(base)
            progress.update(task, layout=name)
            row = run_one(name, cfg_args, all_devices[:devices], steps=steps, warmup=warmup,
                          baseline=steppers.get(layout.model))
            if row["status"] == "ok":
                add_ratios(row, baselines[layout.model])
            rows.append(row)
            progress.advance(task)
    return {"preset": preset, "overrides": overrides, "devices": devices, "steps": steps,
            "warmup": warmup, "backend": jax.default_backend(),
            "device_kind": all_devices[0].device_kind, "rows": rows}


def _progress() -> Progress:
    """A progress bar on stderr, so stdout stays the table."""
    from rich.console import Console  # noqa: PLC0415

    return Progress(TextColumn("{task.description}"), BarColumn(),
                    TextColumn("{task.completed}/{task.total} {task.fields[layout]}"),
                    TimeElapsedColumn(), console=Console(stderr=True))
