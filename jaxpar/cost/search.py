"""``jaxpar plan --search``: every layout of N devices with the memory levers that make it fit,
ranked by estimated step time.

A *layout* is how work is split: the mesh (ordered factorisations of N; ``expert`` only for
MoE), sequence parallelism, ZeRO-3 or ZeRO-1, ``parallel.context_impl``, and with ``pipe > 1``
schedule, microbatches and ``parallel.pipeline_fsdp``. *Levers* trade memory for time:
``train.remat``, ``train.offload.optimizer``, ``parallel.pipeline_stash``.

Two rules keep it near one estimate per layout. A lever never speeds a step up, so a layout's
*probe* (no remat, nothing offloaded, residuals stashed) bounds its variants from below.
Layouts expand in probe order; once ``keep`` fit and the next probe is slower than the
``keep``-th, the rest are *pruned*. The top ``keep`` are exact under the model; the count that
fit is a lower bound when some were pruned. Details: docs/plan.md, "Search and verify".
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Iterator
from dataclasses import dataclass

from jaxpar.config import Config, ConfigError, MeshConfig, validate
from jaxpar.config.schema import ParallelConfig, TrainConfig
from jaxpar.cost.estimate import CostReport, estimate
from jaxpar.hardware import HardwareProfile, get_profile

HBM_USABLE = 0.9  # headroom for the runtime, XLA's scratch and allocator fragmentation
GIB = 2**30
TOP = 15  # layouts `plan --search` shows (and expands in full) unless --all


def schema_values(cls: type, name: str) -> tuple:
    """The values a ``Literal`` field of a config dataclass allows, in the schema's order."""
    return typing.get_args(typing.get_type_hints(cls)[name])


def pipeline_fsdp_values() -> tuple[str, ...]:
    """``parallel.pipeline_fsdp``'s values (read from the schema, as the remat policies)."""
    return schema_values(ParallelConfig, "pipeline_fsdp")


# The schedules whose backward runs whole, which a stage can run again from the chunk's input
# (parallel.pipeline_stash=inputs: config/validation.py refuses the others).
WHOLE_BACKWARD = ("gpipe", "1f1b", "interleaved")


@dataclass(frozen=True)
class MeshLayout:
    """A candidate layout of ``jaxpar plan --search``: how the work is split, the mesh sizes and
    the parallel settings that go with them."""

    data: int
    fsdp: int
    context: int
    tensor: int
    sequence_parallel: bool = False
    zero: int = 3
    expert: int = 1
    pipe: int = 1
    schedule: str | None = None  # parallel.pipeline_schedule; None without a pipeline
    virtual_stages: int = 1
    microbatches: int = 1
    pipeline_fsdp: str | None = None  # None: the config's
    pipeline_stash: str | None = None  # None: the config's
    context_impl: str | None = None  # parallel.context_impl; None without context
    ulysses_size: int = 0  # the hybrid's inner factor

    def apply(self, cfg: Config, remat: str, offload: bool) -> Config:
        """``cfg`` with this layout and these levers."""
        mesh = MeshConfig(pipe=self.pipe, data=self.data, fsdp=self.fsdp, expert=self.expert,
                          context=self.context, tensor=self.tensor, dcn=cfg.mesh.dcn)
        pipeline = {"pipeline_schedule": self.schedule} if self.schedule else {}
        if self.pipe == 1:  # the config's pipeline-only settings would be refused here
            pipeline.update(pipeline_fsdp=ParallelConfig.pipeline_fsdp,
                            pipeline_stash=ParallelConfig.pipeline_stash)
        if self.pipeline_fsdp is not None:
            pipeline["pipeline_fsdp"] = self.pipeline_fsdp
        if self.pipeline_stash is not None:
            pipeline["pipeline_stash"] = self.pipeline_stash
        if self.context_impl is not None:
            pipeline.update(context_impl=self.context_impl, ulysses_size=self.ulysses_size)
        parallel = dataclasses.replace(cfg.parallel, sequence_parallel=self.sequence_parallel,
                                       zero=self.zero, virtual_stages=self.virtual_stages,
                                       **pipeline)
        train = dataclasses.replace(cfg.train, remat=remat, microbatches=self.microbatches,
                                    offload=dataclasses.replace(cfg.train.offload,
                                                                optimizer=offload))
        return dataclasses.replace(cfg, mesh=mesh, parallel=parallel, train=train)


@dataclass(frozen=True)
class Candidate:
    """One layout tried by :func:`search`, with the levers chosen for it."""

    layout_: MeshLayout
    remat: str
    offload: bool
    report: CostReport | None  # None when validation rejected it or it was pruned
    reason: str | None  # why it was rejected; None when it fits (or was pruned)
    rank: int | None = None  # 1 = fastest; None when rejected or pruned
    pruned: bool = False  # not expanded: its probe is slower than the top `keep`

    def __getattr__(self, name: str):  # c.data, c.pipe, c.schedule ... read the layout
        if name == "layout_":
            raise AttributeError(name)
        return getattr(self.layout_, name)

    @property
    def fits(self) -> bool:
        return self.reason is None and not self.pruned

    @property
    def layout(self) -> str:
        """``pipe=4 fsdp=16 tensor=4 sp zero=3 1f1b`` (microbatches, levers: own columns)."""
        lay = self.layout_
        parts = [f"{a}={getattr(lay, a)}" for a in ("pipe", "data", "fsdp", "expert", "context",
                                                      "tensor") if getattr(lay, a) > 1]
        parts = parts or ["data=1"]
        if lay.context_impl:
            parts.append(lay.context_impl + (f" u={lay.ulysses_size}" if lay.ulysses_size
                                             else ""))
        if lay.sequence_parallel:
            parts.append("sp")
        parts.append(f"zero={lay.zero}")
        if lay.schedule:
            parts.append(lay.schedule + (f" v={lay.virtual_stages}" if lay.virtual_stages > 1
                                         else ""))
        if lay.pipeline_fsdp:
            parts.append(lay.pipeline_fsdp)
        if lay.pipeline_stash == "inputs":
            parts.append("stash inputs")
        return " ".join(parts)

    def overrides(self) -> list[str]:
        """The ``key=value`` overrides selecting this candidate (for ``jaxpar train``)."""
        lay = self.layout_
        out = [f"mesh.pipe={lay.pipe}", f"mesh.data={lay.data}", f"mesh.fsdp={lay.fsdp}",
               *([f"mesh.expert={lay.expert}"] if lay.expert > 1 else []),
               f"mesh.context={lay.context}", f"mesh.tensor={lay.tensor}",
               f"parallel.sequence_parallel={str(lay.sequence_parallel).lower()}",
               f"parallel.zero={lay.zero}"]
        if lay.schedule:
            out += [f"parallel.pipeline_schedule={lay.schedule}",
                    f"parallel.virtual_stages={lay.virtual_stages}"]
        if lay.pipeline_fsdp:
            out.append(f"parallel.pipeline_fsdp={lay.pipeline_fsdp}")
        if lay.pipeline_stash:
            out.append(f"parallel.pipeline_stash={lay.pipeline_stash}")
        if lay.context_impl:
            out += [f"parallel.context_impl={lay.context_impl}",
                    f"parallel.ulysses_size={lay.ulysses_size}"]
        return [*out, f"train.microbatches={lay.microbatches}", f"train.remat={self.remat}",
                f"train.offload.optimizer={str(self.offload).lower()}"]


def _factorisations(n: int, parts: int) -> Iterator[tuple[int, ...]]:
    """Ordered tuples of ``parts`` positive ints whose product is ``n``."""
    if parts == 1:
        yield (n,)
        return
    for first in range(1, n + 1):
        if n % first == 0:
            for rest in _factorisations(n // first, parts - 1):
                yield (first, *rest)


# The chunks per stage tried for each schedule (1 for the others).
SEARCHED_CHUNKS = {"interleaved": (2,), "zero_bubble": (1, 2), "dualpipe_v": (2,)}


def _pipelines(cfg: Config, pipe: int, fsdp: int, replicas: int
               ) -> Iterator[tuple[str | None, int, int, str | None, str | None]]:
    """(schedule, virtual_stages, microbatches, pipeline_fsdp, pipeline_stash) for ``pipe``."""
    if pipe == 1:
        yield None, 1, 1, None, None
        return
    m, t = cfg.model, cfg.train
    rows = t.batch_size // max(1, t.grad_accum * replicas)
    counts = [k * pipe for k in (1, 2, 4) if rows % (k * pipe) == 0] or [pipe]  # else: rejected
    units = m.n_layers - (m.moe.first_dense if m.moe.enabled else 0)
    fsdp_modes = pipeline_fsdp_values() if fsdp > 1 else (None,)
    for schedule in schema_values(ParallelConfig, "pipeline_schedule"):
        if schedule == "gpipe":  # 1F1B's time, more memory (module docstring)
            continue
        for virtual in SEARCHED_CHUNKS.get(schedule, (1,)):
            if virtual > 1 and units % (virtual * pipe):
                continue
            for count in counts:
                if schedule == "dualpipe_v" and count < 2 * pipe:  # DualPipe's m >= 2p
                    continue
                for mode in fsdp_modes:  # (pipeline_stash: a lever, _expand)
                    yield schedule, virtual, count, mode, "residuals"


def _context_impls(context: int) -> Iterator[tuple[str | None, int]]:
    """(context_impl, ulysses_size) for ``context`` devices: each implementation, the hybrid per
    inner factor (validation rejects head counts that do not split)."""
    if context == 1:
        yield None, 0
        return
    for impl in schema_values(ParallelConfig, "context_impl"):
        if impl != "hybrid":
            yield impl, 0
            continue
        for inner in range(2, context):
            if context % inner == 0:
                yield impl, inner


def layouts(cfg: Config, device_count: int) -> Iterator[MeshLayout]:
    """Every layout of ``device_count`` devices :func:`search` tries."""
    moe = cfg.model.moe.enabled
    for sizes in _factorisations(device_count, 6 if moe else 5):
        pipe, data, fsdp, expert, context, tensor = sizes if moe else (*sizes[:3], 1,
                                                                        *sizes[3:])
        for sp in (False, True) if tensor > 1 else (False,):
            # ZeRO-1 splits over data and fsdp: without either it is ZeRO-3 again.
            for zero in (3, 1) if data * fsdp > 1 else (3,):
                for schedule, virtual, count, mode, stash in _pipelines(
                        cfg, pipe, fsdp, data * fsdp * expert):
                    for impl, inner in _context_impls(context):
                        yield MeshLayout(data, fsdp, context, tensor, sp, zero, expert, pipe,
                                     schedule, virtual, count, mode, stash, impl, inner)


def _try(cfg: Config, layout: MeshLayout, remat: str, offload: bool, devices: int,
         hw: HardwareProfile) -> Candidate:
    """One estimate: fits, or why not (validation's message, or memory)."""
    try:
        report = estimate(validate(layout.apply(cfg, remat, offload), devices), hw)
    except ConfigError as err:
        return Candidate(layout, remat, offload, None, str(err))
    usable = HBM_USABLE * hw.hbm_bytes
    reason = None
    if report.memory.peak > usable:
        reason = (f"needs {report.memory.peak / GIB:.1f} GiB > {usable / GIB:.1f} GiB HBM "
                  f"({HBM_USABLE:.0%} of {hw.hbm_bytes / GIB:.0f} GiB usable)")
    return Candidate(layout, remat, offload, report, reason)


def _expand(cfg: Config, probe: Candidate, devices: int, hw: HardwareProfile) -> Candidate:
    """The probe layout's fastest fitting lever setting (ties: least memory), else the
    smallest."""
    remats = schema_values(TrainConfig, "remat")
    layouts = [probe.layout_]
    if probe.schedule in WHOLE_BACKWARD:  # each chunk's input stashed, the chunk run again
        layouts += [dataclasses.replace(probe.layout_, pipeline_stash=stash)
                    for stash in schema_values(ParallelConfig, "pipeline_stash")
                    if stash != probe.pipeline_stash]
    tried = [probe]
    for offload in (False, True) if hw.platform != "cpu" else (False,):
        tried += [_try(cfg, lay, r, offload, devices, hw) for lay in layouts for r in remats
                  if (lay, r, offload) != (probe.layout_, probe.remat, probe.offload)]
        fitting = [c for c in tried if c.fits]
        if fitting:
            return min(fitting, key=lambda c: (c.report.memory.host > 0, c.report.time.step,
                                               c.report.memory.peak))
    estimated = [c for c in tried if c.report is not None]
    if not estimated:
        return probe
    smallest = min(estimated, key=lambda c: c.report.memory.peak)
    levers = (f"remat={smallest.remat}" + (", optimizer offloaded" if smallest.offload else "")
              + (", chunk inputs stashed" if smallest.pipeline_stash == "inputs" else ""))
    tried_all = "every remat" + (" and offload" if hw.platform != "cpu" else "") + " tried"
    return dataclasses.replace(smallest, reason=f"{smallest.reason} even with {levers} "
                               f"({tried_all})")


def search(cfg: Config, device_count: int, hardware: str | HardwareProfile,
           keep: int | None = TOP) -> list[Candidate]:
    """Every layout: those that fit by step time (then memory), then pruned, then rejected."""
    hw = get_profile(hardware)
    probe_remat = "none" if "none" in schema_values(TrainConfig, "remat") else cfg.train.remat
    probes = [_try(cfg, lay, probe_remat, False, device_count, hw)
              for lay in layouts(cfg, device_count)]
    estimated = sorted((p for p in probes if p.report is not None),
                       key=lambda p: (p.report.time.step, p.report.memory.peak))
    fitting: list[Candidate] = []
    rejected = [p for p in probes if p.report is None]
    pruned: list[Candidate] = []
    for probe in estimated:
        if (keep is not None and len(fitting) >= keep
                and probe.report.time.step > fitting[keep - 1].report.time.step):
            pruned.append(dataclasses.replace(probe, reason=None, pruned=True))
            continue
        best = _expand(cfg, probe, device_count, hw)
        if best.fits:
            fitting.append(best)
            fitting.sort(key=lambda c: (c.report.time.step, c.report.memory.peak))
        else:
            rejected.append(best)
    rejected.sort(key=lambda c: (0, c.report.memory.peak) if c.report else (1, 0))
    ranked = [dataclasses.replace(c, rank=i + 1) for i, c in enumerate(fitting)]
    return ranked + pruned + rejected
