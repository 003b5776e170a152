"""The real-size matrix: the layouts users train, at real widths, compiled against the plan.

Each case compiles one step of a real-size preset cut to a few layers, on 64 virtual CPU devices or
a TPU slice, and allocates nothing. ``scripts/real_size.py`` prints the table;
``tests/integration/test_real_size.py`` asserts it. Why: docs/inspect.md, "Real sizes".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from jaxpar.inspect.compare import compare_with_plan, mismatches

DEVICES = 64


@dataclass(frozen=True)
class Case:
    """One row of the matrix: ``preset`` with ``overrides``, compiled for ``DEVICES``."""

    name: str
    preset: str
    overrides: tuple[str, ...]


def _layout(name: str, preset: str, *overrides: str, layers: int = 2) -> Case:
    return Case(name, preset, (f"model.n_layers={layers}", *overrides))


_LONG = ("train.batch_size=16", "train.seq_len=32768")
_PIPE = ("mesh.pipe=4", "mesh.fsdp=4", "mesh.tensor=4", "train.microbatches=8")

CPU_CASES: tuple[Case, ...] = (
    _layout("data", "llama3-8b", "mesh.data=64", "mesh.fsdp=1"),
    _layout("fsdp", "llama3-8b"),
    _layout("fsdp-70b", "llama3-70b"),
    # remat=attention: q, k, v, the attention output and branch kept, the MLP recomputed.
    _layout("fsdp-remat-attention", "llama3-8b", "train.remat=attention", layers=4),
    _layout("fsdp-tensor", "llama3-8b", "mesh.fsdp=8", "mesh.tensor=8"),
    _layout("fsdp-tensor-sp", "llama3-8b", "mesh.fsdp=8", "mesh.tensor=8",
            "parallel.sequence_parallel=true"),
    _layout("fsdp-context-ring-32k", "llama3-8b", "mesh.fsdp=16", "mesh.context=4", *_LONG),
    _layout("fsdp-context-allgather-32k", "llama3-8b", "mesh.fsdp=16", "mesh.context=4",
            "parallel.context_impl=allgather", *_LONG),
    _layout("fsdp-context-ulysses-32k", "llama3-8b", "mesh.fsdp=16", "mesh.context=4",
            "parallel.context_impl=ulysses", *_LONG),
    _layout("fsdp-context-hybrid-32k", "llama3-8b", "mesh.fsdp=16", "mesh.context=4",
            "parallel.context_impl=hybrid", "parallel.ulysses_size=2", *_LONG),
    _layout("expert-fsdp", "mixtral-8x7b", "mesh.expert=8", "mesh.fsdp=8"),
    # Gemma 3's block (post-norms, GeGLU, q/k norms, a 262k vocabulary tied to the head) under
    # remat=full; six layers, so that the 1-in-6 pattern compiles one global layer beside the
    # local (1024-token window) ones.
    _layout("gemma3-fsdp-tensor", "gemma3-27b", "mesh.fsdp=8", "mesh.tensor=8", layers=6),
    # DeepSeek-V3's block: multi-head latent attention, 256 routed experts (top-8 in groups)
    # beside a shared one, and a dense first block in its own scanned stack; three layers, so
    # that one dense and two MoE blocks compile.
    _layout("deepseek-expert-fsdp", "deepseek-v3", "mesh.expert=8", "mesh.fsdp=8",
            "model.moe.first_dense=1", "train.batch_size=64", layers=3),
    _layout("pipe-fsdp-tensor-gpipe", "llama3-8b", *_PIPE,
            "parallel.pipeline_schedule=gpipe", layers=4),
    _layout("pipe-fsdp-tensor-1f1b", "llama3-8b", *_PIPE,
            "parallel.pipeline_schedule=1f1b", layers=4),
    _layout("pipe-fsdp-tensor-interleaved", "llama3-8b", *_PIPE,
            "parallel.pipeline_schedule=interleaved", "parallel.virtual_stages=2", layers=8),
    _layout("five-axes", "mixtral-8x7b", "mesh.pipe=2", "mesh.fsdp=2", "mesh.expert=2",
            "mesh.context=4", "mesh.tensor=2", "parallel.sequence_parallel=true",
            "parallel.pipeline_schedule=1f1b", "train.microbatches=4", "train.batch_size=16",
            "train.seq_len=8192", layers=4),
)


def compile_case(case: Case, devices: Sequence[Any] | None = None,
                 extra: Sequence[str] = ()) -> dict[str, Any]:
    """Compile ``case`` and return its ``inspect`` report with the comparison.

    ``devices``: a TPU slice's, else :data:`DEVICES` virtual CPU devices. ``report["compare"]`` has
    ``mismatches`` at the default tolerance.
    """
    from jaxpar.config import load_config, validate  # noqa: PLC0415
    from jaxpar.inspect.report import build_report  # noqa: PLC0415
    from jaxpar.mesh import make_mesh  # noqa: PLC0415
    from jaxpar.train.compiled import compiled_step  # noqa: PLC0415

    cfg = validate(load_config(case.preset, [*case.overrides, *extra]),
                   len(devices) if devices is not None else DEVICES)
    report = build_report(compiled_step(cfg, make_mesh(cfg, devices=devices)))
    report["compare"] = compare_with_plan(report, cfg)
    report["compare"]["mismatches"] = mismatches(report["compare"])
    return report


def summary_rows(case: Case, comparison: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The comparison as rows (case, what, axes, compiled, planned, ratio), tiny rows left out."""
    from jaxpar.inspect.compare import FLOOR_BYTES  # noqa: PLC0415

    memory = comparison["memory"]
    rows = [{"case": case.name, "what": "peak memory", "axes": "-",
             "compiled": memory["compiled_peak_bytes"], "planned": memory["predicted_peak_bytes"],
             "ratio": memory["peak_ratio"]}]
    for row in comparison["collectives"]:
        if max(row["compiled_bytes"] or 0, row["predicted_bytes"] or 0) < FLOOR_BYTES:
            continue
        rows.append({"case": case.name, "what": row["kind"], "axes": ",".join(row["axes"]),
                     "compiled": row["compiled_bytes"], "planned": row["predicted_bytes"],
                     "ratio": row["ratio"]})
    return rows
