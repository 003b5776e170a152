"""The analytic cost of one train step, per device: memory, collectives, flops and time.

:func:`estimate` predicts, without compiling, what ``jaxpar inspect`` would measure, and the
step time on a :mod:`~jaxpar.hardware` profile, so layouts can be compared before compiling.
Without a profile (or ``cpu``) it predicts XLA:CPU's program; with a GPU or TPU profile, the
accelerator compiler's. Parts: :mod:`~jaxpar.cost.params`, :mod:`~jaxpar.cost.shapes`,
:mod:`~jaxpar.cost.memory`, :mod:`~jaxpar.cost.communication`, :mod:`~jaxpar.cost.pipeline`;
this module adds flops and time::

    step = compute + blocking + latency + max(0, overlappable - compute)
    MFU  = useful flops / (step * peak)

Executed vs useful flops, the overlap rule: docs/cost-model.md, "Flops and time".
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from jaxpar.config import Config, ConfigError
from jaxpar.cost.communication import collectives as all_collectives
from jaxpar.cost.ledger import CollectiveCost, summarize, wire_bytes
from jaxpar.cost.memory import MemoryCost
from jaxpar.cost.memory import memory as step_memory
from jaxpar.cost.optimizer import muon_flops
from jaxpar.cost.params import ParamCost, param_costs
from jaxpar.cost.pipeline import pipeline_compute, pipeline_note
from jaxpar.cost.shapes import StepSizes, step_sizes
from jaxpar.hardware import HardwareProfile, get_profile
from jaxpar.model.flop_formula import attention_params, matmul_params, train_flops_per_token

__all__ = ["CollectiveCost", "CostReport", "FlopsCost", "MemoryCost", "ParamCost", "TimeCost",
           "estimate", "wire_bytes"]


@dataclass(frozen=True)
class FlopsCost:
    """FLOPs per device per step."""

    model: float  # useful work (what MFU counts): flops.train_flops_per_token x tokens
    embedding_one_hot: float  # the embedding's weight gradient, a one-hot matmul
    recompute: float  # remat's extra forward work
    # Attention's executed minus useful flops: the masked causal blocks computed, and under
    # flash attention the scores recomputed backward.
    attention_extra: float = 0.0
    expert_padding: float = 0.0  # MoE rows computed that carry no token (and XLA:CPU's ragged_dot)
    optimizer: float = 0.0  # Muon's Newton-Schulz iterations (cost/optimizer.py)
    # The head's columns of the padded vocabulary (Config.vocab_rows), forward and backward:
    # executed, never useful (the model counts model.vocab_size).
    vocab_padding: float = 0.0

    @property
    def executed(self) -> float:
        return (self.model + self.embedding_one_hot + self.recompute + self.attention_extra
                + self.expert_padding + self.optimizer + self.vocab_padding)


@dataclass(frozen=True)
class TimeCost:
    """Seconds per step on one hardware profile (docs/cost-model.md, "Time on a hardware
    profile")."""

    hardware: str
    compute: float
    comm_by_axis: dict[str, float]  # "tensor (NVLink)" -> seconds, bytes and latency
    blocking_comm: float
    overlapped_comm: float
    exposed_comm: float  # the part of overlapped_comm that compute does not hide
    latency: float  # count x latency of every collective (never hidden)
    step: float
    tokens_per_s: float
    mfu: float


@dataclass(frozen=True)
class CostReport:
    """Everything :func:`estimate` predicts for one config; ``time`` needs a hardware profile."""

    cfg: Config  # validated
    devices: int
    mesh: dict[str, int]
    params: list[ParamCost]
    memory: MemoryCost
    collectives: list[CollectiveCost]
    flops: FlopsCost
    time: TimeCost | None
    notes: list[str] = field(default_factory=list)
    micro_batch: int = 0  # sequences per device per micro-step (per microbatch with pipe)
    tokens_per_step: int = 0  # global
    pipeline: dict | None = None  # parallel.pipeline.describe(): schedule, ticks, bubble, slots

    def collective_rows(self) -> list[dict[str, Any]]:
        """One row per (kind, axes), as ``summarize_collectives`` (per-step totals)."""
        return summarize(self.collectives)

    def summary(self) -> dict[str, Any]:
        """Headline numbers, flat (W&B's run summary): peak memory, train state per device; with a
        profile step time, tokens/s, MFU; a pipeline's bubble."""
        out: dict[str, Any] = {"plan/peak_memory_bytes": self.memory.peak,
                               "plan/state_bytes": self.memory.state}
        if self.time is not None:
            out.update({"plan/hardware": self.time.hardware, "plan/step_time_s": self.time.step,
                        "plan/tokens_per_s": self.time.tokens_per_s, "plan/mfu": self.time.mfu})
        if self.pipeline is not None:
            out["plan/pipeline_bubble"] = self.pipeline["bubble"]
        return out

    def to_dict(self) -> dict[str, Any]:
        """Plain dicts and lists, for ``json.dumps``."""
        out = asdict(self)
        out["memory"].update(state=self.memory.state, peak=self.memory.peak)
        out["flops"]["executed"] = self.flops.executed
        out["collective_rows"] = self.collective_rows()
        return out


# --------------------------------------------------------------------------------------------
# The estimate


def estimate(cfg: Config, hardware: str | HardwareProfile | None = None) -> CostReport:
    """The cost of one step of ``cfg`` (validated: mesh resolved), per device.

    ``hardware`` (a profile or a name in :data:`jaxpar.hardware.PROFILES`) adds step time and
    MFU, and that platform's compiler's collectives; without it (or ``cpu``), XLA:CPU's
    (docs/cost-model.md, "Which compiler"). ConfigError if the mesh has a -1 axis or a rule does
    not divide a parameter.
    """
    if any(size < 1 for size in cfg.mesh_shape.values()):
        raise ConfigError("estimate: the config must be validated first (mesh has a -1 axis)")
    hw = get_profile(hardware) if hardware is not None else None
    st = step_sizes(cfg, xla_cpu=hw is None or hw.name == "cpu",
                    platform="cpu" if hw is None else hw.platform)
    params = param_costs(cfg)
    collectives = all_collectives(st, params)
    flops = dataclasses.replace(_flops(st), optimizer=muon_flops(cfg, params))
    memory = step_memory(st, params)
    time = _time(st, collectives, flops, hw) if hw is not None else None
    return CostReport(cfg=cfg, devices=math.prod(st.mesh.values()), mesh=st.mesh, params=params,
                      memory=memory, collectives=collectives, flops=flops, time=time,
                      notes=_notes(st), micro_batch=st.b,
                      tokens_per_step=cfg.train.batch_size * cfg.train.seq_len,
                      pipeline=st.pipeline)


def _notes(st: StepSizes) -> list[str]:
    notes = []
    if st.cfg.parallel.rules:
        notes.append("parallel.rules overrides: parameter bytes follow them, collectives assume "
                     "the default table")
    if st.cfg.train.dtype == "float32":
        notes.append("train.dtype=float32: compute timed at the dense bf16 peak (optimistic)")
    if st.accum > 1 and st.pipeline is None:
        notes.append(f"grad_accum={st.accum}: gradients are reduced every micro-step, as the "
                     "compiled step does")
    elif st.accum > 1:
        notes.append(f"grad_accum={st.accum}: folded into the pipeline schedule, one pass over "
                     f"{st.pipeline['microbatches']} microbatches per step (bubble, stash and "
                     "sends are that schedule's; gradients reduced once per step)")
    if st.pipeline is not None:
        notes.append(pipeline_note(st))
    if st.moe_exchange is not None:
        moe, slots = st.cfg.model.moe, st.tokens * st.cfg.model.moe.top_k
        notes.append(f"MoE all-to-alls carry {st.expert_rows:,} rows per layer and device, "
                     f"{slots:,} of them tokens ({1 - slots / st.expert_rows:.0%} padding; "
                     + ("dropping: unused capacity" if moe.dispatch == "dropping" else
                        "padded all-to-all: worst-case blocks" if st.moe_exchange == "padded"
                        else "ragged: load imbalance not modelled") + ")")
    return notes


def _flops(st: StepSizes) -> FlopsCost:
    m, cfg = st.cfg.model, st.cfg
    per_device = cfg.train.batch_size * cfg.train.seq_len / math.prod(st.mesh.values())
    attention_forward = 4 * m.n_layers * m.n_heads * m.resolved_head_dim * st.s  # per token
    layer_matmuls = matmul_params(m) - m.d_model * m.vocab_size
    # Flash attention runs inside a custom VJP whose outputs are kept: remat never redoes it.
    recomputed_attention = 0 if st.flash else attention_forward
    # The routed experts' matmuls (ragged or batched dots) are not what `dots` saves.
    expert = 3 * m.d_model * m.resolved_d_ff_expert if m.moe.enabled else 0
    recomputed_experts = 2 * m.n_moe_layers * m.moe.top_k * expert
    # remat=attention redoes the feed-forward layers but for the outputs of the dense and
    # shared experts' down projections (never read backward), and dense attention's scores
    # and probabilities (the output it keeps: half the attention forward).
    down = ((m.n_layers - m.n_moe_layers) * m.d_model * m.d_ff
            + m.n_moe_layers * m.moe.num_shared_experts * m.d_model * m.resolved_d_ff_expert)
    feed_forward = layer_matmuls - m.n_layers * attention_params(m)
    recompute = {"none": 0, "dots": recomputed_attention + recomputed_experts,
                 "offload_dots": recomputed_attention + recomputed_experts,
                 "attention": 2 * (feed_forward - down) + recomputed_attention / 2,
                 "full": 2 * layer_matmuls + recomputed_attention}[cfg.train.remat]
    recompute /= cfg.train.remat_every  # one layer in every k is rematerialised
    if st.loss_pieces > 1:  # each piece's logits are made again in the backward pass
        recompute += 2 * m.d_model * st.vocab_rows
    # The pipeline executor recomputes nothing (the forward's residuals wait in its stash), but
    # every stage runs every slot of a step: masked forward and backward slots execute too.
    # (With parallel.pipeline_stash=inputs each backward slot runs its chunk's forward again
    # first: StepSizes.chunk_forwards.)
    recompute += ((st.chunk_forwards() - 1) * (2 * layer_matmuls + attention_forward)
                  + (st.executed("backward") - 1) * 2 * (2 * layer_matmuls + attention_forward))
    padding = 0.0
    if m.moe.enabled:
        # Rows the experts compute beyond the T x k slots: capacity slack, padded blocks, and
        # on XLA:CPU ragged_dot's lowering, a dense matmul masked per expert (all local ones).
        local = m.moe.num_experts // st.mesh["expert"]
        rows = st.expert_rows * (local if st.xla_cpu and m.moe.dispatch == "dropless" else 1)
        # Per run of a stage's MoE layers (every microbatch; in a pipeline every slot, masked
        # ones too): forward 2 of the 6 flops per row and weight, backward 4.
        slots = (st.executed("forward") + 2 * st.executed("backward")) / 3
        padding = (st.moe_layers * st.runs * slots * (rows - st.tokens * m.moe.top_k) * 6
                   * expert / st.t)
    # Useful attention is the causal half of the square, forward and backward: 1.5 x the
    # whole square's forward. Dense attention computes all of it (forward 1, backward 2);
    # flash attention the blocks computed (StepSizes.computed_share of the square), with a
    # backward of 5 block matmuls (scores recomputed) against dense attention's 4.
    executed_attention = (st.computed_share * attention_forward * (1 + 10 / 4) if st.flash
                          else 3 * attention_forward)
    # The embedding's forward pass is a gather, from each device's rows where vocab is split
    # (model/projection.py: lookup, parallel/pipeline/stages.py: embed_partial); only its weight
    # gradient is a matmul, which a pipeline stage runs in every round where a stage's backward
    # is chunk 0's, once per microbatch usefully.
    embedding_runs = (1.0 if st.pipeline is None
                      else st.pipeline["embed_back_steps"] / st.pipeline["microbatches"])
    return FlopsCost(model=train_flops_per_token(m, st.s) * per_device,
                     embedding_one_hot=2 * st.vocab_rows * m.d_model * embedding_runs
                     * per_device,
                     recompute=recompute * per_device,
                     attention_extra=(executed_attention - 1.5 * attention_forward)
                     * per_device,
                     expert_padding=padding,
                     vocab_padding=6 * m.d_model * (st.vocab_rows - m.vocab_size) * per_device)


def _time(st: StepSizes, collectives: list[CollectiveCost], flops: FlopsCost,
          hw: HardwareProfile) -> TimeCost:
    compute = flops.executed / hw.peak_flops
    if st.pipeline is not None:
        compute = pipeline_compute(st, compute)
    by_axis: dict[str, float] = {}
    blocking = overlapped = latency = 0.0
    for c in collectives:
        link, bandwidth = hw.axis_link(st.mesh, c.axes, st.cfg.mesh.dcn)
        seconds = c.wire_bytes / bandwidth
        launches = c.count * hw.axis_latency(st.mesh, c.axes, st.cfg.mesh.dcn)
        label = f"{'+'.join(c.axes)} ({link})"
        by_axis[label] = by_axis.get(label, 0.0) + seconds + launches
        latency += launches
        overlapped += c.hidden * seconds
        blocking += (1 - c.hidden) * seconds
    exposed = max(0.0, overlapped - compute)
    step = compute + blocking + latency + exposed
    tokens = st.cfg.train.batch_size * st.s
    return TimeCost(hardware=hw.name, compute=compute, comm_by_axis=by_axis,
                    blocking_comm=blocking, overlapped_comm=overlapped, exposed_comm=exposed,
                    latency=latency, step=step, tokens_per_s=tokens / step,
                    mfu=flops.model / (step * hw.peak_flops))
