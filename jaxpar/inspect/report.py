"""``jaxpar inspect``: what the compiler made of one train step, per device, without running it.

The step is compiled from abstract arrays, so nothing is allocated and no data is read: a 64-device
layout can be checked on a laptop. :func:`inspect_step` returns the JSON-able report that
docs/design.md fixes; :func:`print_report` prints it. Every number is per device unless it says
"global". Each field: docs/inspect.md, "The report's fields".
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec
from rich.console import Console
from rich.table import Table

from jaxpar.config import Config
from jaxpar.inspect.hlo.buffers import largest_arrays
from jaxpar.inspect.hlo.collectives import (
    Collective,
    parse_collectives,
    summarize_collectives,
)
from jaxpar.inspect.hlo.megascale import dcn_collectives, program_partitions
from jaxpar.inspect.hlo.overlap import add_overlap
from jaxpar.inspect.overlap_table import print_overlap
from jaxpar.model.flop_formula import param_count, train_flops_per_token
from jaxpar.parallel.pipeline.executor import describe_config
from jaxpar.parallel.rules import param_name
from jaxpar.train.compiled import CompiledStep, compiled_step
from jaxpar.train.metrics import mesh_text, pipeline_line
from jaxpar.units import human_bytes


def inspect_step(cfg: Config, mesh: jax.sharding.Mesh) -> dict[str, Any]:
    """The JSON-able report of one compiled train step."""
    return build_report(compiled_step(cfg, mesh))


def program_collectives(cfg: Config, hlo: str) -> list[Collective]:
    """The program's collectives, and over several slices (``mesh.dcn``) each one's network.

    XLA:CPU compiles one program for all devices. The TPU compiler compiles one per slice; its sums
    over slices are megascale transfers (docs/inspect.md, "Several slices").
    """
    dcn = cfg.mesh.dcn
    devices = math.prod(cfg.mesh_shape.values())
    if dcn.slices == 1:
        return parse_collectives(hlo, cfg.mesh_shape)
    if program_partitions(hlo) == devices // dcn.slices:
        inside = {a: n // dcn.sizes()[a] for a, n in cfg.mesh_shape.items()}
        crossing = tuple(a for a, n in dcn.sizes().items() if n > 1)
        found = [dataclasses.replace(c, network="ICI") for c in parse_collectives(hlo, inside)]
        return found + [dataclasses.replace(c, network="DCN")
                        for c in dcn_collectives(hlo, crossing, dcn.slices)]
    return [dataclasses.replace(c, network="DCN" if dcn.crossing(c.axes) else "ICI")
            for c in parse_collectives(hlo, cfg.mesh_shape)]


def build_report(step: CompiledStep) -> dict[str, Any]:
    """The report of an already compiled step (the CLI keeps ``step`` for ``--hlo``)."""
    cfg, trainer, compiled = step.cfg, step.trainer, step.compiled
    devices = trainer.mesh.size
    params = param_rows(trainer.abstract_state.params)
    state = trainer.abstract_state
    memory = memory_report(compiled.memory_analysis(),
                           platform=trainer.mesh.devices.flat[0].platform)
    # What the arguments are made of, so the memory table can be read against the params table.
    memory["params_bytes"] = sum(row["bytes_per_device"] for row in params)
    memory["optimizer_bytes"] = _bytes_per_device(state.opt_state)
    hlo = compiled.as_text()
    memory["largest_arrays"] = largest_arrays(hlo)
    found = program_collectives(cfg, hlo)
    collectives = summarize_collectives(found)
    add_overlap(collectives, found, hlo)
    t, p = cfg.train, cfg.parallel
    report = {
        "devices": devices,
        "mesh": dict(cfg.mesh_shape),
        "run": {
            "device_kind": trainer.mesh.devices.flat[0].device_kind,
            "param_count": param_count(cfg.model),
            "param_bytes": _global_bytes(state.params),
            "n_layers": cfg.model.n_layers,
            "batch_size": t.batch_size,
            "seq_len": t.seq_len,
            "grad_accum": t.grad_accum,
            "dtype": t.dtype,
            "remat": t.remat,
            "remat_every": t.remat_every,
            "zero": p.zero,
            "sequence_parallel": p.sequence_parallel,
            "compile_seconds": round(step.compile_seconds, 3),
            "moe": _moe_summary(cfg),
        },
        "params": params,
        "memory": memory,
        "collectives": collectives,
        "flops": flops_report(cfg, compiled.cost_analysis(), devices),
    }
    if cfg.mesh.pipe > 1:
        report["pipeline"] = describe_config(cfg)
    return report


def _moe_summary(cfg: Config) -> dict[str, Any] | None:
    """The MoE settings behind the expert weights and all-to-alls (None: dense)."""
    moe = cfg.model.moe
    if not moe.enabled:
        return None
    return {"num_experts": moe.num_experts, "top_k": moe.top_k, "every": moe.every,
            "moe_layers": cfg.model.n_moe_layers, "dispatch": moe.dispatch,
            "router": moe.router, "capacity_factor": moe.capacity_factor}


# --------------------------------------------------------------------------------------------
# The parts of the report


def _spec_entries(spec: PartitionSpec, ndim: int) -> list[Any]:
    """One JSON entry per dimension: None, an axis name, or a list of axis names."""
    entries = list(spec) + [None] * (ndim - len(spec))  # a short spec leaves the rest unsplit
    return [list(e) if isinstance(e, tuple) else e for e in entries]


def _shard_bytes(leaf: jax.ShapeDtypeStruct) -> int:
    shape = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
    return math.prod(shape) * np.dtype(leaf.dtype).itemsize


def _bytes_per_device(tree: Any) -> int:
    return sum(_shard_bytes(leaf) for leaf in jax.tree.leaves(tree))


def _global_bytes(tree: Any) -> int:
    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def param_rows(abstract_params: Any) -> list[dict[str, Any]]:
    """``[{name, shape, spec, bytes_per_device}]`` for parameters with shardings attached."""
    rows = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(abstract_params)[0]:
        rows.append({
            "name": param_name(path),
            "shape": list(leaf.shape),
            "spec": _spec_entries(leaf.sharding.spec, len(leaf.shape)),
            "bytes_per_device": _shard_bytes(leaf),
        })
    return rows


def memory_report(stats: Any, platform: str = "cpu") -> dict[str, Any]:
    """Per-device memory of the compiled step, from ``compiled.memory_analysis()``.

    ``peak_bytes``: ``argument + output - alias + temp``, an upper bound on one step's need. XLA's
    own peak is kept as ``xla_peak_bytes``. On ``platform="tpu"`` the larger is the peak
    (``peak_source``). Why: docs/jax-notes.md, "Memory and cost analysis of compiled steps".
    """
    if stats is None:  # some backends have no analysis
        return {k: None for k in ("argument_bytes", "output_bytes", "temp_bytes", "peak_bytes")}
    argument = int(stats.argument_size_in_bytes)
    output = int(stats.output_size_in_bytes)
    alias = int(stats.alias_size_in_bytes)
    temp = int(stats.temp_size_in_bytes)
    xla_peak = int(getattr(stats, "peak_memory_in_bytes", 0)) or None
    buffers = argument + output - alias + temp
    use_xla_peak = platform == "tpu" and xla_peak is not None and xla_peak > buffers
    # Host memory (train.offload: pinned_host arrays), which the TPU compiler reports apart;
    # XLA:CPU counts it in the figures above.
    host = {k: int(getattr(stats, f"host_{k}_size_in_bytes", 0) or 0)
            for k in ("argument", "output", "alias", "temp")}
    return {
        "host_bytes": host["argument"] + host["output"] - host["alias"] + host["temp"],
        "argument_bytes": argument,
        "output_bytes": output,
        "temp_bytes": temp,
        "peak_bytes": xla_peak if use_xla_peak else buffers,
        "alias_bytes": alias,
        "generated_code_bytes": int(stats.generated_code_size_in_bytes),
        "xla_peak_bytes": xla_peak,
        "peak_source": "xla" if use_xla_peak else "buffers",
    }


def flops_report(cfg: Config, cost: Mapping[str, Any] | Sequence[Any] | None,
                 devices: int) -> dict[str, float | None]:
    """Compiled vs analytic flops of one step, per device.

    ``compiled``: ``cost_analysis()['flops']``, counting loop bodies once. ``analytic``: the step's
    useful work over the devices; ``analytic_loops_once`` counts it as XLA does. docs/inspect.md,
    "The report's fields".
    """
    if isinstance(cost, Sequence):  # older jax returned one dict per executable
        cost = cost[0] if cost else None
    compiled = float(cost["flops"]) if cost and "flops" in cost else None
    t = cfg.train
    tokens = t.batch_size * t.seq_len
    analytic = train_flops_per_token(cfg.model, t.seq_len) * tokens / devices
    # The loop body: one layer, or the train.remat_every layers of one group.
    one_layer = dataclasses.replace(cfg.model, n_layers=t.remat_every)
    pieces = cfg.loss_pieces() if cfg.mesh.pipe == 1 else 1
    # ... and one piece of the head, over the padded vocabulary as the program runs it.
    e = cfg.model.d_model
    head = 6 * e * cfg.model.vocab_size - 6 * e * cfg.vocab_rows() / pieces
    once = ((train_flops_per_token(one_layer, t.seq_len) - head) * tokens / t.grad_accum
            / devices)
    return {
        "compiled": compiled,
        "analytic": analytic,
        "ratio": compiled / analytic if compiled is not None else None,
        "analytic_loops_once": once,
        "ratio_loops_once": compiled / once if compiled is not None else None,
    }


# --------------------------------------------------------------------------------------------
# Printing


def human_flops(n: float | None) -> str:
    if n is None:
        return "n/a"
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6),
                        ("kFLOP", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n:,.0f} FLOP"


def _spec_text(spec: Sequence[Any]) -> str:
    def entry(e: Any) -> str:
        if isinstance(e, list):
            return "(" + ", ".join(repr(a) for a in e) + ")"
        return repr(e)

    return "P(" + ", ".join(entry(e) for e in spec) + ")"


def _shards(spec: Sequence[Any], mesh: Mapping[str, int]) -> int:
    """How many pieces a spec cuts an array into (the rules require even sharding)."""
    axes = [a for e in spec if e is not None for a in (e if isinstance(e, list) else [e])]
    return math.prod(mesh[a] for a in axes)


def print_report(report: Mapping[str, Any], console: Console) -> None:
    """Print the report: a header line and tables of params, memory, collectives, flops."""
    run, mesh = report["run"], report["mesh"]
    console.print(
        f"[bold]jaxpar inspect[/bold] {report['devices']} x {run['device_kind']} | mesh "
        f"{mesh_text(mesh)} | {run['param_count'] / 1e6:.2f}M params | {run['dtype']}, "
        f"remat={run['remat']}"
        + (f" (every {run['remat_every']})" if run.get("remat_every", 1) > 1 else "")
        + f", zero={run['zero']}, sequence_parallel={run['sequence_parallel']}")
    if run.get("moe"):
        moe = run["moe"]
        console.print(f"mixture of experts: {moe['moe_layers']} MoE layers of {moe['num_experts']} "
                      f"experts, top-{moe['top_k']}, {moe['dispatch']} dispatch, "
                      f"{moe['router']} router")
    accum = f", grad_accum={run['grad_accum']}" if run["grad_accum"] > 1 else ""
    console.print(f"batch {run['batch_size']} x {run['seq_len']} tokens{accum} | compiled the "
                  f"train step in {run['compile_seconds']:.1f} s (not run: no arrays allocated)")
    if run.get("target"):  # --target: compiled by the TPU compiler for a slice (inspect/tpu.py)
        cores = run["cores_per_chip"]
        devices = f"{cores} devices (TensorCores) per chip" if cores > 1 else "1 device per chip"
        console.print(f"target {run['target']}: {run['chips']} chips, {devices}, compiled ahead "
                      f"of time by {run['compiler']} on this machine; memory and collectives "
                      "are the TPU compiler's")
    _print_params(report, console)
    _print_memory(report["memory"], console, tpu=bool(run.get("target")))
    if run.get("target"):
        console.print("TPU memory is laid out in tiles (f32: 8 x 128): small or narrow arrays "
                      "take more HBM than their shape says, so argument can exceed parameters + "
                      "optimizer state. The TPU compiler's peak also counts the chip's "
                      "on-core vector memory (VMEM, 128 MiB on v5e), where it puts most "
                      "temporaries of a narrow model: below a few hundred MiB per chip it "
                      "overstates the HBM a step needs.")
    _print_collectives(report["collectives"], console, tpu=bool(run.get("target")),
                       overlap=bool(run.get("target")))
    if report.get("pipeline"):
        console.print(pipeline_line(report["pipeline"]))
    _print_flops(report["flops"], run, console)


def print_dump(report: Mapping[str, Any], console: Console) -> None:
    """Print ``inspect --hlo-file``'s report: its source, memory (if found) and collectives."""
    source = report["source"]
    console.print(f"[bold]jaxpar inspect[/bold] {source['hlo_file']} | {report['devices']} "
                  f"devices | mesh {mesh_text(report['mesh'])}")
    if report["memory"] is None:
        console.print("memory: no buffer assignment beside the dump (XLA writes "
                      "*-buffer-assignment.txt with --xla_dump_to)")
    else:
        _print_memory(report["memory"], console, title="memory per device (the dump's buffer "
                      f"assignment: {Path(source['buffer_assignment']).name})")
    _print_collectives(report["collectives"], console, overlap=True)


def _print_params(report: Mapping[str, Any], console: Console) -> None:
    mesh = report["mesh"]
    table = Table(title="parameters (per device: the shard this device holds)",
                  title_justify="left")
    table.add_column("parameter", no_wrap=True)
    table.add_column("global shape")
    table.add_column("PartitionSpec")
    table.add_column("global", justify="right", no_wrap=True)
    table.add_column("per device", justify="right", no_wrap=True)
    total_global = total_device = 0
    for row in report["params"]:
        global_bytes = row["bytes_per_device"] * _shards(row["spec"], mesh)
        total_global += global_bytes
        total_device += row["bytes_per_device"]
        table.add_row(row["name"], str(tuple(row["shape"])), _spec_text(row["spec"]),
                      human_bytes(global_bytes), human_bytes(row["bytes_per_device"]))
    fraction = f" (1/{total_global / total_device:.3g})" if total_device else ""
    table.add_section()
    table.add_row("total", "", "", human_bytes(total_global),
                  human_bytes(total_device) + fraction, style="bold")
    console.print(table)


def _print_memory(memory: Mapping[str, Any], console: Console, tpu: bool = False,
                  title: str = "memory per device (compiled.memory_analysis())") -> None:
    table = Table(title=title, title_justify="left")
    table.add_column("buffer", no_wrap=True)
    table.add_column("bytes", justify="right", no_wrap=True)
    table.add_column("what it holds")
    step = "params_bytes" in memory  # jaxpar's own step, not a dump of another program
    table.add_row("argument", human_bytes(memory["argument_bytes"]),
                  "train state + batch, live for the whole step" if step
                  else "the program's inputs, live for the whole call")
    if step:
        table.add_row("  parameters", human_bytes(memory.get("params_bytes")),
                      "the shards in the table above")
        table.add_row("  optimizer state", human_bytes(memory.get("optimizer_bytes")),
                      "the optimizer's moments (+ step counters)")
    table.add_row("output", human_bytes(memory["output_bytes"]),
                  "new train state + metrics" if step else "the program's outputs")
    table.add_row("alias", human_bytes(memory.get("alias_bytes")),
                  "outputs written into donated arguments (not allocated twice)")
    table.add_row("temp", human_bytes(memory["temp_bytes"]),
                  "activations, gathered weights, gradients, scratch")
    for row in memory.get("largest_arrays") or []:
        table.add_row(f"  {row['array']}", human_bytes(row["bytes"]),
                      f"one of the largest arrays: {row['instructions']} {row['opcode']} "
                      f"instruction(s) produce one")
    if memory.get("generated_code_bytes"):
        table.add_row("generated code", human_bytes(memory["generated_code_bytes"]),
                      "the executable itself")
    if tpu:
        table.add_row("TPU compiler's peak", human_bytes(memory.get("xla_peak_bytes")),
                      "memory_analysis().peak_memory_in_bytes: its peak of live buffers")
    if memory.get("host_bytes"):
        table.add_row("host memory", human_bytes(memory["host_bytes"]),
                      "pinned host buffers (train.offload), beside the device's")
    table.add_section()
    what = "argument + output - alias + temp: all buffers of the step at once"
    if tpu:  # see memory_report: on TPU neither figure covers the other
        what = "max(argument + output - alias + temp, TPU compiler's peak): an upper bound"
    table.add_row("peak", human_bytes(memory["peak_bytes"]), what, style="bold")
    console.print(table)


def _print_collectives(rows: Sequence[Mapping[str, Any]], console: Console,
                       tpu: bool = False, overlap: bool = False) -> None:
    """The collectives table; ``overlap``: then the hidden and exposed bytes table.

    For schedules that overlap communication (a TPU target, a dump).
    """
    if not rows:
        console.print("[bold]collectives[/bold]: none (nothing is split, or one device)")
        return
    table = Table(title="collectives per device, one step (ops in the layer loop count once per "
                  "layer)", title_justify="left")
    network = any("network" in row for row in rows)  # a mesh over several slices
    for name, justify in (("kind", "left"), ("axes", "left"), ("network", "left"),
                          ("count", "right"), ("bytes", "right"), ("wire bytes", "right"),
                          ("dtypes", "left"), ("lowered as", "left")):
        if name != "network" or network:
            table.add_column(name, justify=justify, no_wrap=name != "lowered as")
    for row in rows:
        net = [row.get("network", "-")] if network else []
        table.add_row(row["kind"], ",".join(row["axes"]) or "-", *net, str(row["count"]),
                      human_bytes(row["bytes"]), human_bytes(row.get("wire_bytes")),
                      ",".join(row.get("dtypes", [])), ", ".join(row.get("lowered_as", [])))
    console.print(table)
    console.print("bytes: payload per device (all-gather: the gathered result; reduce-scatter: "
                  "the unscattered input); wire bytes: what a ring algorithm sends per device.")
    if tpu and any("all-reduce+dynamic-slice" in row.get("lowered_as", []) for row in rows):
        console.print("reduce-scatter as all-reduce+dynamic-slice: an all-reduce the TPU compiler "
                      "did not fuse into an all-reduce-scatter; each device keeps its slice, at an "
                      "all-reduce's traffic (wire bytes count that).")
    elif any("all-reduce+dynamic-slice" in row.get("lowered_as", []) for row in rows):
        console.print("reduce-scatter as all-reduce+dynamic-slice: XLA:CPU never emits a "
                      "reduce-scatter op; it all-reduces the whole array and each device keeps "
                      "its slice. Same result, at an all-reduce's traffic (wire bytes count that); "
                      "TPU fuses the pair into one reduce-scatter.")
    if overlap and all("hidden_bytes" in row for row in rows):
        print_overlap(rows, console, network)


def _print_flops(flops: Mapping[str, Any], run: Mapping[str, Any], console: Console) -> None:
    table = Table(title="flops per device, one step", title_justify="left")
    table.add_column("count")
    table.add_column("flops", justify="right", no_wrap=True)
    table.add_column("compiled / this", justify="right")

    def ratio(value: float | None) -> str:
        return f"{value:.3f}" if value is not None else "n/a"

    table.add_row("compiled (XLA cost_analysis)", human_flops(flops["compiled"]), "")
    table.add_row("analytic, whole step", human_flops(flops["analytic"]), ratio(flops["ratio"]))
    loops = f"{run.get('remat_every', 1)} of {run['n_layers']} layers" + (
        f", 1 of {run['grad_accum']} micro-steps" if run["grad_accum"] > 1 else "")
    table.add_row(f"analytic, loops once ({loops})", human_flops(flops["analytic_loops_once"]),
                  ratio(flops["ratio_loops_once"]))
    console.print(table)
    console.print("XLA counts a loop body once, not per iteration, so compare compiled with "
                  "'loops once'; above 1 is elementwise work, the one-hot embedding "
                  "and remat recomputation, which the analytic (useful) flops leave out.")
