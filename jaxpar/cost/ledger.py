"""The bookkeeping every collectives formula writes into: a :class:`Ledger` of
:class:`CollectiveCost` rows, and the ring :func:`wire_bytes` of a payload over a group.
The formulas: :mod:`jaxpar.cost.communication` and :mod:`jaxpar.cost.pipeline` (``pipe``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from jaxpar.cost.params import PARAM_BYTES, STORED_BYTES, ParamCost, in_compute_dtype
from jaxpar.cost.shapes import StepSizes
from jaxpar.parallel.zero import data_summed_by_hand


@dataclass(frozen=True)
class CollectiveCost:
    """One logical communication of the step, per device, summed over the step."""

    kind: str  # all-reduce, all-gather, reduce-scatter (as jaxpar.inspect.hlo.collectives.KINDS)
    axes: tuple[str, ...]  # mesh axes its groups span
    count: int  # executions per step
    bytes: int  # payload per device per step
    wire_bytes: int  # ring bytes sent per device per step
    what: str  # which tensors, and why
    hidden: float  # the share of its bytes the overlap rule hides behind matmuls (estimate.py)


HIDDEN, EXPOSED = 1.0, 0.0  # every byte hidden behind matmuls; none


def ring_hidden(group: int) -> float:
    """The hidden share of a collective matmul's bytes: all but the last of its ``group`` ring
    steps overlap a matmul slice (the TPU compiler's windowed einsums; docs/performance.md)."""
    return 1 - 1 / group if group > 1 else HIDDEN


def summarize(collectives: Sequence[CollectiveCost]) -> list[dict[str, Any]]:
    """One row per (kind, axes), as
    :func:`jaxpar.inspect.hlo.collectives.summarize_collectives`, split into ``hidden_bytes`` and
    ``exposed_bytes`` as :func:`jaxpar.inspect.hlo.overlap.add_overlap` splits compiled rows."""
    rows: dict[tuple[str, tuple[str, ...]], dict[str, Any]] = {}
    for c in collectives:
        row = rows.setdefault((c.kind, c.axes), {"kind": c.kind, "axes": list(c.axes),
                                                 "count": 0, "bytes": 0, "wire_bytes": 0,
                                                 "hidden_bytes": 0, "exposed_bytes": 0})
        row["count"] += c.count
        row["bytes"] += c.bytes
        row["wire_bytes"] += c.wire_bytes
        hidden = round(c.bytes * c.hidden)
        row["hidden_bytes"] += hidden
        row["exposed_bytes"] += c.bytes - hidden
    return [rows[key] for key in sorted(rows)]


def wire_bytes(kind: str, payload: int, group: int) -> int:
    """Ring bytes each device sends (as jaxpar.inspect.hlo.collectives defines them)."""
    if group <= 1:
        return 0
    if kind == "all-reduce":
        return payload * 2 * (group - 1) // group
    if kind == "collective-permute":
        return payload
    return payload * (group - 1) // group


@dataclass
class Ledger:
    """The collectives found so far, and what every formula shares.

    In a pipeline a device runs its layers in every round with a forward (backward) slot, masked
    ones too, and reduces weight gradients in every backward slot; without one, ``runs`` is g.
    """

    st: StepSizes
    params: list[ParamCost]
    out: list[CollectiveCost] = field(default_factory=list)

    @property
    def forwards(self) -> float:
        """Runs of each forward-side collective per useful layer run (masked slots)."""
        return self.st.executed("forward")

    @property
    def backwards(self) -> float:
        return self.st.executed("backward")

    @property
    def grad_runs(self) -> int:
        """Gradient reductions per step: every micro-step, or every backward slot."""
        if self.st.pipeline is None:
            return self.st.accum
        return self.st.pipeline["backward_steps"]  # of the one schedule, grad_accum folded in

    @property
    def by_hand(self) -> tuple[str, ...]:
        """Axes whose gradients are summed by hand once per step: ``data``, ``fsdp``,
        ``expert``, ``context`` in the pipeline executor; ``data`` under gradient accumulation,
        except MoE outside a pipeline (its load-balance loss needs whole-micro-batch
        statistics)."""
        st = self.st
        if st.pipeline is None:  # parallel/zero.py: data_summed_by_hand
            return ("data",) if data_summed_by_hand(st.cfg, st.xla_cpu) else ()
        return tuple(a for a in ("data", "fsdp", "expert", "context") if st.mesh[a] > 1)

    def summed_by_hand(self, axes: tuple[str, ...]) -> bool:
        live = tuple(a for a in axes if self.st.mesh[a] > 1)
        return bool(live) and set(live) <= set(self.by_hand)

    def runs_over(self, axes: tuple[str, ...]) -> int:
        """Gradient reductions per step over ``axes``: once where summed by hand, else
        ``grad_runs``."""
        return 1 if self.summed_by_hand(axes) else self.grad_runs

    @property
    def layer(self) -> list[ParamCost]:
        return [p for p in self.params if p.stacked]

    @property
    def other(self) -> list[ParamCost]:
        """Embedding, final norm, lm_head: outside the scanned stacks."""
        return [p for p in self.params if not p.stacked]

    @property
    def dense(self) -> list[ParamCost]:
        """The ``dense_layers`` stack's weights (DeepSeek's dense first blocks)."""
        return [p for p in self.params if p.dense_stack]

    def add(self, kind: str, axes: tuple[str, ...], count: int, total: int, what: str,
            hidden: float, group: int | None = None) -> None:
        """``count`` runs per step moving ``total`` payload bytes, ``hidden`` behind matmuls;
        ``group``: devices per replica group where fewer than ``axes`` span (the hybrid's
        all-to-alls)."""
        axes = tuple(a for a in axes if self.st.mesh[a] > 1)
        group = group or math.prod(self.st.mesh[a] for a in axes)
        if count and total and group > 1:
            self.out.append(CollectiveCost(kind, axes, count, total,
                                           wire_bytes(kind, total, group), what, hidden))

    def moved(self, p: ParamCost, nbytes: int) -> int:
        """Bytes of a weight on the wire (cast to the compute dtype)."""
        return in_compute_dtype(p, nbytes, self.st.wire)

    def grad(self, p: ParamCost, nbytes: int, by_hand: bool = False) -> int:
        """Partitioner-summed gradients travel like their weights, except lm_head's (float32) and,
        outside a pipeline, the layer matrices' and experts' when ``parallel.reduce_dtype`` is wider
        than the compute dtype. Sums by hand cast every gradient to ``parallel.reduce_dtype``."""
        in_reduce_dtype = nbytes * STORED_BYTES[self.st.cfg.parallel.reduce_dtype] // PARAM_BYTES
        if by_hand:
            return in_reduce_dtype
        if p.name == "lm_head":
            return nbytes
        # The routed experts' backward pass casts their gradient the same way before its sums
        # (parallel/expert.py: used_expert_weight).
        if (p.projected or p.expert) and self.st.pipeline is None:
            return max(self.moved(p, nbytes), in_reduce_dtype)
        return self.moved(p, nbytes)

    def reduced(self, group: list[ParamCost], gathered: bool = False,
                by_hand: bool = False) -> int:
        """Gradient bytes of ``group`` reduced per step (``gathered``: unscattered size). In a
        pipeline each backward slot (masked too) reduces its chunk's layers; each step reduces its
        vocabulary piece's (1/p of the embedding per backward round, of the head per head round)
        and the final norm's."""
        def size(p: ParamCost) -> int:
            return self.grad(p, p.gathered_bytes if gathered else p.bytes_per_device, by_hand)

        layers = sum(size(p) for p in group if p.stacked)
        shared = sum(size(p) for p in group if not p.stacked)
        st = self.st
        if by_hand:  # once per step
            return layers + shared
        if st.pipeline is None:
            return st.accum * (layers + shared + self._tied_head_grad(group, gathered))
        backward, head = st.pipeline["backward_steps"], st.pipeline["head_steps"]
        tied = st.cfg.model.tie_embeddings
        into_first = st.pipeline["embed_back_steps"]  # chunk 0's backward: the embedding's
        rounds = {"embedding": (into_first + head * tied) / st.p, "lm_head": head / st.p}
        shared = sum(size(p) * rounds.get(p.name, head) for p in group if not p.stacked)
        return round(backward * layers / st.pipeline["virtual_stages"] + shared)

    def _tied_head_grad(self, group: list[ParamCost], gathered: bool) -> int:
        """A tied embedding's second reduction outside a pipeline: the head's float32 gradient in
        the loss's backward pass, the lookup's at the step's end. Why two: docs/cost-model.md,
        "`fsdp` (ZeRO-3)"."""
        if not self.st.cfg.model.tie_embeddings:
            return 0
        return sum(p.gathered_bytes if gathered else p.bytes_per_device
                   for p in group if p.name == "embedding")
