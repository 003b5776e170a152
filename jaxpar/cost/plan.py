"""``jaxpar plan``: what a layout would cost on given hardware, and which layout to rent.

``jaxpar plan CONFIG [key=value ...] [--hardware h100] [--devices N]`` prints the analytic cost
(:func:`jaxpar.cost.estimate.estimate`) of the config's own layout: memory per device against the
device's HBM, every collective with its bytes and link time, flops, step time and MFU.

``--search`` instead tries every layout of N devices that jaxpar can run today -- each ordered
factorisation ``data x fsdp x context x tensor = N`` (``data x fsdp x expert x context x tensor``
for a mixture-of-experts model; for a dense one ``expert`` would only be data parallelism under
another name), with sequence parallelism off and on where ``tensor > 1``, with ZeRO-3 and (where
data x fsdp > 1) ZeRO-1 -- keeping everything else in the config (context parallelism uses its
``context_impl``; ``pipe`` stays 1, as it is not implemented yet). A layout is rejected when
:func:`jaxpar.config.validate` refuses it (the reason is its error message) or when its peak
memory does not fit in ``HBM_USABLE`` of the device's HBM ("needs X GiB > Y GiB HBM"); the rest
are ranked by estimated step time, then by memory. Nothing is compiled and jax never starts a
backend, so planning 512 GPUs takes about a second on a laptop.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from jaxpar.config import MESH_AXES, Config, ConfigError, MeshConfig, slices_line, validate
from jaxpar.cost.estimate import CostReport, estimate
from jaxpar.hardware import HardwareProfile, get_profile
from jaxpar.model.flops import matmul_params, param_count
from jaxpar.units import human_bytes

HBM_USABLE = 0.9  # headroom for the runtime, XLA's scratch and allocator fragmentation
GIB = 2**30


# --------------------------------------------------------------------------------------------
# Search


@dataclass(frozen=True)
class Candidate:
    """One layout tried by :func:`search`."""

    data: int
    fsdp: int
    context: int
    tensor: int
    sequence_parallel: bool
    zero: int
    report: CostReport | None  # None when validation rejected the layout
    reason: str | None  # why it was rejected; None when it fits
    rank: int | None = None  # 1 = fastest; None when rejected
    expert: int = 1

    @property
    def fits(self) -> bool:
        return self.reason is None

    @property
    def layout(self) -> str:
        parts = [f"{a}={n}" for a, n in (("data", self.data), ("fsdp", self.fsdp),
                                          ("expert", self.expert), ("context", self.context),
                                          ("tensor", self.tensor))
                 if n > 1] or ["data=1"]
        if self.sequence_parallel:
            parts.append("sp")
        parts.append(f"zero={self.zero}")
        return " ".join(parts)

    def overrides(self) -> list[str]:
        """The ``key=value`` overrides that select this layout (for ``jaxpar train``)."""
        return [f"mesh.data={self.data}", f"mesh.fsdp={self.fsdp}",
                *([f"mesh.expert={self.expert}"] if self.expert > 1 else []),
                f"mesh.context={self.context}", f"mesh.tensor={self.tensor}",
                f"parallel.sequence_parallel={str(self.sequence_parallel).lower()}",
                f"parallel.zero={self.zero}"]


def _factorisations(n: int, parts: int) -> Iterator[tuple[int, ...]]:
    """Ordered tuples of ``parts`` positive ints whose product is ``n``."""
    if parts == 1:
        yield (n,)
        return
    for first in range(1, n + 1):
        if n % first == 0:
            for rest in _factorisations(n // first, parts - 1):
                yield (first, *rest)


def layouts(device_count: int, moe: bool = False
            ) -> Iterator[tuple[int, int, int, int, int, bool, int]]:
    """(data, fsdp, expert, context, tensor, sequence_parallel, zero) for every layout of the
    devices; ``expert`` is 1 unless ``moe``."""
    for sizes in _factorisations(device_count, 5 if moe else 4):
        data, fsdp, expert, context, tensor = sizes if moe else (*sizes[:2], 1, *sizes[2:])
        for sp in (False, True) if tensor > 1 else (False,):
            # ZeRO-1 splits over data and fsdp: without either it is ZeRO-3 again.
            for zero in (3, 1) if data * fsdp > 1 else (3,):
                yield data, fsdp, expert, context, tensor, sp, zero


def search(cfg: Config, device_count: int, hardware: str | HardwareProfile
           ) -> list[Candidate]:
    """Every layout of ``device_count`` devices, ranked (fitting ones first, by step time)."""
    hw = get_profile(hardware)
    usable = HBM_USABLE * hw.hbm_bytes
    tried: list[Candidate] = []
    for data, fsdp, expert, context, tensor, sp, zero in layouts(device_count,
                                                                 cfg.model.moe.enabled):
        # The config's slices stay: a layout whose axes they do not divide is rejected.
        mesh = MeshConfig(pipe=1, data=data, fsdp=fsdp, expert=expert, context=context,
                          tensor=tensor, dcn=cfg.mesh.dcn)
        parallel = dataclasses.replace(cfg.parallel, sequence_parallel=sp, zero=zero)
        variant = dataclasses.replace(cfg, mesh=mesh, parallel=parallel)
        report, reason = None, None
        try:
            report = estimate(validate(variant, device_count), hw)
        except ConfigError as err:
            reason = str(err)
        if report is not None and report.memory.peak > usable:
            reason = (f"needs {report.memory.peak / GIB:.1f} GiB > {usable / GIB:.1f} GiB HBM "
                      f"({HBM_USABLE:.0%} of {hw.hbm_bytes / GIB:.0f} GiB usable)")
        tried.append(Candidate(data, fsdp, context, tensor, sp, zero, report, reason,
                               expert=expert))

    def order(c: Candidate) -> tuple:
        if c.fits:
            return (0, c.report.time.step, c.report.memory.peak)
        return (1, 0 if c.report is not None else 1, c.report.memory.peak if c.report else 0)

    ranked = sorted(tried, key=order)
    return [dataclasses.replace(c, rank=i + 1) if c.fits else c for i, c in enumerate(ranked)]


_search = search  # plan_main's ``search`` flag shadows the function's name


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
    """Tables for one layout: memory, collectives, flops and time (``report`` estimated with a
    hardware profile)."""
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
         + (" (+ accumulator)" if cfg.train.grad_accum > 1 else "")),
        ("activations", m.activations, f"saved for backward, remat={cfg.train.remat}, "
         f"micro-batch {report.micro_batch}"
         + (" (and each layer's weights)" if cfg.train.remat == "none" else "")),
        ("working", m.working, "one layer's backward, logits, gathered weights"),
        *([("pipeline stash", m.stash, f"{report.pipeline['activation_slots']} stage inputs + "
            f"{report.pipeline['gradient_slots']} output gradients held "
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
        overlap = "" if c.overlapped else " [yellow](blocking)[/yellow]"
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


def format_search(candidates: Sequence[Candidate]) -> Table:
    """One row per layout: ranked ones by step time, then the rejected ones with the reason."""
    table = Table(title="layouts, fastest first", title_justify="left")
    for column, justify in (("#", "right"), ("layout", "left"), ("step (ideal)", "right"),
                            ("MFU bound", "right"), ("tokens/s", "right"), ("peak mem", "right"),
                            ("exposed comm", "right"), ("busiest link", "left")):
        table.add_column(column, justify=justify)
    for c in candidates:
        if c.fits:
            t, m = c.report.time, c.report.memory
            busiest = max(t.comm_by_axis.items(), key=lambda kv: kv[1], default=None)
            busy = f"{busiest[0]} {human_seconds(busiest[1])}" if busiest else "-"
            table.add_row(str(c.rank), c.layout, human_seconds(t.step), f"{t.mfu:.1%}",
                          f"{t.tokens_per_s:,.0f}", _bytes(m.peak),
                          human_seconds(t.blocking_comm + t.exposed_comm + t.latency), busy)
        else:
            peak = _bytes(c.report.memory.peak) if c.report is not None else "-"
            table.add_row("-", f"[dim]{c.layout}[/dim]", "", "", "", peak, "",
                          f"[red]rejected[/red]: {c.reason}")
    return table


# --------------------------------------------------------------------------------------------
# The command


def _devices(cfg: Config, device_count: int | None) -> int:
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
              device_count: int | None = None, console: Console | None = None) -> int:
    """``jaxpar plan``: print the plan (or the ranked search); 0 when done.

    ``cfg`` is loaded but need not be validated (this validates it for ``device_count``). An
    unknown hardware name or an invalid config raises ConfigError (the CLI's exit code 2).
    """
    console = console or Console()
    hw = get_profile(hardware)
    devices = _devices(cfg, device_count)
    if search:
        candidates = _search(cfg, devices, hw)
        console.print(f"jaxpar plan --search | {hardware_line(cfg, devices, hw)}")
        console.print(format_search(candidates))
        best = [c for c in candidates if c.fits]
        rejected = len(candidates) - len(best)
        if best:
            console.print(f"{len(best)} layouts fit, {rejected} rejected. Fastest: "
                          f"{best[0].layout} -> " + " ".join(best[0].overrides()))
        else:
            console.print(f"[red]no layout of {devices} x {hw.name} fits[/red] "
                          f"({rejected} rejected): try more devices, remat=full, a smaller "
                          "train.batch_size or more train.grad_accum")
        console.print("step: ideal (peak flops and link bandwidth, plus a fixed latency per "
                      "collective); ranking is what to trust, not the absolute times. MFU counts "
                      "causal attention as half the square (MaxText's count).", style="dim")
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

