"""``jaxpar plan``: what a layout would cost on given hardware, and which layout to rent.

``jaxpar plan CONFIG [key=value ...] [--hardware h100] [--devices N]`` prints the config's own
layout's analytic cost: memory per device against HBM, each collective's bytes and link time,
flops, step time, MFU. ``--search`` ranks every layout of N devices with the levers that make
it fit (:mod:`jaxpar.cost.search`); ``--verify K --target TPU`` compiles the best K for a TPU
slice beside the plan (:mod:`jaxpar.inspect.verify`). Nothing else compiles; no jax backend
starts.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from jaxpar.config import MESH_AXES, Config, ConfigError, slices_line, validate
from jaxpar.cost.estimate import CostReport, estimate
from jaxpar.cost.search import GIB, HBM_USABLE, TOP, Candidate, MeshLayout, layouts, search
from jaxpar.hardware import HardwareProfile, get_profile
from jaxpar.model.flop_formula import matmul_params, param_count
from jaxpar.units import human_bytes

__all__ = ["GIB", "HBM_USABLE", "Candidate", "MeshLayout", "format_plan", "format_search",
           "layouts", "plan_main", "planned_devices", "print_search", "search"]


# --------------------------------------------------------------------------------------------
# Formatting


def _bytes(n: float) -> str:
    return human_bytes(n, ",.1f")


def human_seconds(s: float) -> str:
    if s >= 1:
        return f"{s:,.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:,.2f} ms"
    return f"{s * 1e6:,.1f} µs"


def human_flops(n: float) -> str:
    for unit, size in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if n >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n:,.0f} FLOP"


def _mesh_text(mesh: dict[str, int]) -> str:
    return " ".join(f"{a}={mesh[a]}" for a in MESH_AXES if mesh[a] > 1) or "1 device"


def hardware_line(cfg: Config, devices: int, hw: HardwareProfile) -> str:
    """One header line: model, batch and hardware."""
    t = cfg.train
    accum = f" in {t.grad_accum} micro-steps" if t.grad_accum > 1 else ""
    nominal = " (nominal numbers)" if hw.nominal else ""
    # a mixture's active parameters: the weights one token multiplies with (flops.matmul_params)
    active = (f" ({matmul_params(cfg.model) / 1e6:,.1f}M active)" if cfg.model.moe.enabled
              else "")
    return (f"{param_count(cfg.model) / 1e6:,.1f}M params{active} | batch {t.batch_size} x "
            f"{t.seq_len} "
            f"tokens{accum} | {t.dtype}, remat={t.remat} | {devices} x {hw.name}: "
            f"{hw.description}{nominal}, {hw.peak_flops / 1e12:,.0f} TFLOP/s, "
            f"{hw.hbm_bytes / GIB:,.0f} GiB HBM")


def format_plan(report: CostReport) -> Group:
    """Tables for one layout: memory, collectives, flops and time (``report`` with a profile)."""
    if report.time is None:
        raise ValueError("format_plan: estimate the report with a hardware profile")
    hw = get_profile(report.time.hardware)
    notes = [Text("step = compute + blocking comm (tensor, MoE all-to-all, ZeRO-1 gather, "
                  "allgather attention) + latency (count x a fixed cost per collective) + "
                  "max(0, data/fsdp/context comm - compute), at peak flops and link bandwidth: "
                  "a lower bound on the real step.", style="dim")]
    notes += [Text(f"note: {n}", style="dim") for n in report.notes]
    return Group(_memory_table(report, hw), _collectives_table(report, hw),
                 _timing_table(report), *notes)




def _memory_table(report: CostReport, hw: HardwareProfile) -> Table:
    cfg, m = report.cfg, report.memory
    usable = HBM_USABLE * hw.hbm_bytes
    memory = Table(title="memory per device", title_justify="left")
    memory.add_column("part")
    memory.add_column("bytes", justify="right")
    memory.add_column("what")
    for name, value, what in (
        ("parameters", m.params, "float32 shards (rules table)"),
        ("optimizer", m.optimizer, f"{cfg.train.optimizer} state, {cfg.train.opt_state_dtype}"
         + (" (ZeRO-1: split over data*fsdp)" if cfg.parallel.zero == 1 else "")
         + (" in host memory (train.offload.optimizer; on the device, in and out, during the "
            "update only)" if m.offloaded else "")),
        ("gradients", m.gradients, "float32, like the parameters"
         + (" (+ accumulator)" if cfg.train.grad_accum > 1 and not report.pipeline else "")),
        ("activations", m.activations, f"saved for backward, remat={cfg.train.remat}, "
         f"micro-batch {report.micro_batch}"
         + (" (and each layer's weights)" if cfg.train.remat == "none" else "")),
        ("working", m.working, "one layer's backward, logits, gathered weights"),
        *([("pipeline stash", m.stash, f"{report.pipeline['activation_slots']} stage inputs + "
            f"{report.pipeline['residual_slots']} "
            + ("chunk inputs" if cfg.parallel.pipeline_stash == "inputs" else "residual sets")
            + f" + {report.pipeline['gradient_slots']} output gradients held "
            f"({report.pipeline['schedule']})")] if report.pipeline else []),
        *([("weight copies", m.weight_copies, "the stage's weights as its matmuls read them, "
            "copied beside the stashes" if report.pipeline else "the layer stack cast to "
            f"{cfg.train.dtype} once, before the layer loop")] if m.weight_copies else []),
        *([("gradient sums", m.gradient_sums, "float32, of the weights as gathered over fsdp; "
            "reduce-scattered once per step")] if m.gradient_sums else []),
        ("batch", m.batch, "inputs, targets, mask"),
    ):
        memory.add_row(name, _bytes(value), what)
    fits = m.peak <= usable
    memory.add_row("[bold]peak[/bold]", f"[bold]{_bytes(m.peak)}[/bold]",
                   f"{'fits' if fits else '[red]does not fit[/red]'}: {_bytes(usable)} "
                   f"usable of {_bytes(hw.hbm_bytes)} HBM")
    return memory


def _collectives_table(report: CostReport, hw: HardwareProfile) -> Table:
    comms = Table(title="collectives per device, one step", title_justify="left")
    for column, justify in (("kind", "left"), ("axes", "left"), ("count", "right"),
                            ("bytes", "right"), ("wire", "right"), ("link", "left"),
                            ("time", "right"), ("what", "left")):
        comms.add_column(column, justify=justify)
    for c in report.collectives:
        dcn = report.cfg.mesh.dcn
        link, bandwidth = hw.axis_link(report.mesh, c.axes, dcn)
        seconds = c.wire_bytes / bandwidth + c.count * hw.axis_latency(report.mesh, c.axes, dcn)
        overlap = ("" if c.hidden == 1 else " [yellow](blocking)[/yellow]" if c.hidden == 0
                   else f" [yellow]({1 - c.hidden:.0%} blocking)[/yellow]")
        comms.add_row(c.kind, ",".join(c.axes), f"{c.count:,}", _bytes(c.bytes),
                      _bytes(c.wire_bytes), link, human_seconds(seconds), c.what + overlap)
    if not report.collectives:
        comms.add_row("none", "", "", "", "", "", "", "one device, or nothing split")
    return comms


def _timing_table(report: CostReport) -> Table:
    time = report.time
    f = report.flops
    timing = Table(title="flops and time per device, one step", title_justify="left")
    timing.add_column("quantity")
    timing.add_column("value", justify="right")
    timing.add_column("note")
    timing.add_row("model flops", human_flops(f.model),
                   "useful work (what MFU counts; causal attention as half the square)")
    extra = (f"+ one-hot embedding gradient {human_flops(f.embedding_one_hot)}, remat recompute "
             f"{human_flops(f.recompute)}")
    if f.attention_extra:
        extra += (f", attention beyond the causal half {human_flops(f.attention_extra)} "
                  "(masked blocks computed, flash's scores recomputed)")
    if f.expert_padding:
        extra += f", MoE rows without a token {human_flops(f.expert_padding)}"
    if f.optimizer:
        extra += f", Muon's Newton-Schulz iterations {human_flops(f.optimizer)}"
    if f.vocab_padding:
        extra += f", the padded vocabulary's head columns {human_flops(f.vocab_padding)}"
    timing.add_row("executed flops", human_flops(f.executed), extra)
    timing.add_row("compute", human_seconds(time.compute), "executed flops at peak"
                   + (f", / (1 - bubble {report.pipeline['bubble']:.1%})" if report.pipeline
                      else ""))
    for label, seconds in time.comm_by_axis.items():
        timing.add_row(f"comm {label}", human_seconds(seconds), "")
    launches = sum(c.count for c in report.collectives)
    timing.add_row("exposed comm", human_seconds(time.blocking_comm + time.exposed_comm
                                                 + time.latency),
                   f"blocking {human_seconds(time.blocking_comm)} + overlappable not hidden "
                   f"{human_seconds(time.exposed_comm)} + latency {human_seconds(time.latency)} "
                   f"({launches:,} collectives)")
    timing.add_row("[bold]step (ideal)[/bold]", f"[bold]{human_seconds(time.step)}[/bold]",
                   f"{time.tokens_per_s:,.0f} tokens/s")
    timing.add_row("[bold]MFU bound[/bold]", f"[bold]{time.mfu:.1%}[/bold]",
                   "model flops / (step x peak); real steps are slower")
    return timing


def format_search(candidates: Sequence[Candidate], rows: int | None = TOP) -> Table:
    """The first ``rows`` ranked candidates (None: all, rejected ones with reasons)."""
    table = Table(title="layouts, fastest first", title_justify="left")
    for column, justify in (("#", "right"), ("layout", "left"), ("micro", "right"),
                            ("remat", "left"), ("offload", "left"), ("step (ideal)", "right"),
                            ("MFU bound", "right"), ("peak mem", "right"),
                            ("exposed comm", "right"), ("busiest link", "left")):
        table.add_column(column, justify=justify)
    shown = [c for c in candidates if c.fits][:rows] if rows is not None else candidates
    for c in shown:
        micro = str(c.microbatches) if c.pipe > 1 else "-"
        offload = "optimizer" if c.offload else "-"
        if c.fits:
            t, m = c.report.time, c.report.memory
            busiest = max(t.comm_by_axis.items(), key=lambda kv: kv[1], default=None)
            busy = f"{busiest[0]} {human_seconds(busiest[1])}" if busiest else "-"
            table.add_row(str(c.rank), c.layout, micro, c.remat, offload, human_seconds(t.step),
                          f"{t.mfu:.1%}", _bytes(m.peak),
                          human_seconds(t.blocking_comm + t.exposed_comm + t.latency), busy)
        else:
            peak = _bytes(c.report.memory.peak) if c.report is not None else "-"
            why = ("[yellow]pruned[/yellow]: slower than the top layouts even with remat=none"
                   if c.pruned else f"[red]rejected[/red]: {c.reason}")
            table.add_row("-", f"[dim]{c.layout}[/dim]", micro, c.remat, offload, "", "", peak,
                          "", why)
    return table


def reason_counts(candidates: Sequence[Candidate], top: int = 5) -> list[tuple[int, str]]:
    """[(count, reason)] of rejections, most common first; numbers read as N so one rule's
    messages count together."""
    counts = Counter(re.sub(r"\d+(\.\d+)?", "N", c.reason) for c in candidates
                     if c.reason is not None)
    return [(n, why) for why, n in counts.most_common(top)]


# --------------------------------------------------------------------------------------------
# The command


def planned_devices(cfg: Config, device_count: int | None) -> int:
    """``--devices``, else ``host_devices``, else the product of a fully given mesh."""
    if device_count is not None:
        return device_count
    if cfg.host_devices is not None:
        return cfg.host_devices
    sizes = cfg.mesh.sizes().values()
    if all(s >= 1 for s in sizes):
        return math.prod(sizes)
    raise ConfigError("plan: how many devices? The mesh has a -1 axis and host_devices is "
                      "unset; pass --devices N")


def plan_main(cfg: Config, hardware: str = "h100", search: bool = False,
              device_count: int | None = None, console: Console | None = None,
              show_all: bool = False) -> int:
    """``jaxpar plan``: print the plan (or search); 0 when done.

    ``cfg`` need not be validated (done here for ``device_count``). ConfigError (CLI exit 2) for
    an unknown hardware name or invalid config.
    """
    console = console or Console()
    hw = get_profile(hardware)
    devices = planned_devices(cfg, device_count)
    if search:
        print_search(cfg, devices, hw, console, show_all)
        return 0
    valid = validate(cfg, devices)
    report = estimate(valid, hw)
    console.print(f"jaxpar plan | {hardware_line(valid, devices, hw)}")
    console.print(f"mesh {_mesh_text(report.mesh)} | zero={valid.parallel.zero}, "
                  f"sequence_parallel={valid.parallel.sequence_parallel} | micro-batch "
                  f"{report.micro_batch} x {valid.train.seq_len} per device")
    if slices_line(valid):
        console.print(slices_line(valid))
    console.print(format_plan(report))
    return 0



def print_search(cfg: Config, devices: int, hw: HardwareProfile, console: Console,
                 show_all: bool = False) -> list[Candidate]:
    """``plan --search``: the top layouts (``show_all``: all, rejected too), the commonest
    rejections, the fastest's overrides; returns the ranked candidates."""
    candidates = _search(cfg, devices, hw, keep=None if show_all else TOP)
    console.print(f"jaxpar plan --search | {hardware_line(cfg, devices, hw)}")
    console.print(format_search(candidates, rows=None if show_all else TOP))
    best = [c for c in candidates if c.fits]
    rejected = [c for c in candidates if c.reason is not None]
    pruned = len(candidates) - len(best) - len(rejected)
    console.print(f"{len(best)} layouts fit" + (f" (top {TOP} shown; --all for every one)"
                                                if len(best) > TOP and not show_all else "")
                  + f", {len(rejected)} rejected"
                  + (f", {pruned} pruned (slower than the top {TOP} even with remat=none)"
                     if pruned else "") + ".")
    for count, why in reason_counts(rejected):
        console.print(f"  {count:>6,} x {why}", style="dim", markup=False)
    if best:
        console.print(f"Fastest: {best[0].layout} -> " + " ".join(best[0].overrides()),
                      markup=False)
    else:
        console.print(f"[red]no layout of {devices} x {hw.name} fits[/red]: try more devices, "
                      "a smaller train.batch_size or more train.grad_accum")
    console.print("step: ideal (peak flops and link bandwidth, plus a fixed latency per "
                  "collective); ranking is what to trust, not the absolute times. MFU counts "
                  "causal attention as half the square (MaxText's count).", style="dim")
    return candidates


_search = search  # plan_main's ``search`` flag shadows the function's name
