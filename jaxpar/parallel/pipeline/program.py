"""The pipeline's schedule compiled for the executor: per (step, stage) integers, by stretch.

:func:`compile_program` walks a schedule's steps (:mod:`jaxpar.parallel.pipeline.schedules`) and
writes, for every step and stage, what the executor (:mod:`jaxpar.parallel.pipeline.executor`)
reads: which microbatch and chunk each slot runs, which stash slot it reads and writes, and where
what arrives at the end of the step is kept. Slots come from per-stage free lists, lowest first, so
a stash holds exactly the schedule's peak in flight (plus one spare slot that masked writes go to).
Consecutive steps of one kind form a *stretch*, which the executor runs as one scan.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxpar.parallel.pipeline.schedules import (
    Step,
    bubble_fraction,
    schedule_steps,
    stage_of,
    table_of,
)

# Per (step, stage) integers the executor reads; "trash" slot indices where there is no work.
FIELDS = (
    "f_on", "f_mb", "f_chunk", "f_first", "f_in", "f_res",  # forward slot
    "b_on", "b_chunk", "b_first", "b_res", "b_grad",  # backward slot (B or I)
    "w_on", "w_chunk", "w_res", "w_grad",  # weight-gradient slot (W)
    "embed_mb", "head_on", "head_mb", "head_last", "head_dy",  # shared work of the step
    "eback_on", "eback_mb",
    "recv_act", "recv_grad",  # where what arrives at the end of the step is stored
)


# --------------------------------------------------------------------------------------------
# From steps to arrays


class _Slots:
    """Per-stage free lists of one stash: the lowest free slot is handed out first."""

    def __init__(self, p: int):
        self.held: list[dict[tuple[int, int], int]] = [{} for _ in range(p)]
        self.peak = 0

    def take(self, stage: int, key: tuple[int, int]) -> int:
        used = set(self.held[stage].values())
        slot = next(i for i in range(len(used) + 1) if i not in used)
        self.held[stage][key] = slot
        self.peak = max(self.peak, slot + 1)
        return slot

    def find(self, stage: int, key: tuple[int, int]) -> int:
        return self.held[stage][key]

    def free(self, stage: int, key: tuple[int, int]) -> None:
        del self.held[stage][key]


@dataclass(frozen=True)
class Stretch:
    """Consecutive steps of one kind: ``fields[name]`` is int32 ``[steps, stages]``."""

    kinds: tuple[str, ...]
    fields: dict[str, np.ndarray]


@dataclass(frozen=True)
class Program:
    """A schedule compiled for the executor: its stretches and the size of each stash (the
    spare slot that masked writes go to is index ``size``)."""

    stretches: tuple[Stretch, ...]
    act_slots: int  # activations that arrived and wait for their forward
    res_slots: int  # forward residuals that wait for their backward
    grad_slots: int  # output gradients that wait for their backward

    @property
    def steps(self) -> int:
        return sum(len(s.fields["f_on"]) for s in self.stretches)


def executed_kinds(step: Step) -> tuple[str, ...]:
    """The slots the executor runs for ``step``: its kinds, except that an I and a W of the
    same (microbatch, chunk) on every stage run as one B (the same arithmetic in one backward
    pass; computed apart, W would redo the input-gradient chain through the chunk's layers)."""
    if "I" in step.kinds and "W" in step.kinds and all(
            (a.get("I") is None) == (a.get("W") is None)
            and (a.get("I") is None or a["I"].mb == a["W"].mb and a["I"].chunk == a["W"].chunk)
            for a in step.actions):
        return tuple(k for k in step.kinds if k not in ("I", "W")) + ("B",)
    return step.kinds


def step_kind(step: Step, n_chunks: int) -> tuple[str, ...]:
    """What the executor's step runs: :func:`executed_kinds`, plus ``H`` (the head and loss)
    when a stage's forward is the last chunk."""
    head = any((a := slots.get("F")) is not None and a.chunk == n_chunks - 1
               for slots in step.actions)
    return executed_kinds(step) + (("H",) if head else ())


def _place_step(t: int, step: Step, n_chunks: int, f: dict, pools: dict,
                ) -> tuple[list, list]:
    """Fill row ``t`` of ``f`` for ``step``; return the slots it frees and what it sends."""
    acts, res, grads = pools["act"], pools["res"], pools["grad"]
    frees, sends = [], []
    p = len(step.actions)
    fused = "B" in executed_kinds(step) and "B" not in step.kinds
    for s, slots in enumerate(step.actions):
        if fused and "I" in slots:  # run as one B (executed_kinds)
            slots = {**{k: a for k, a in slots.items() if k not in ("I", "W")},
                     "B": slots["I"]}
        if (a := slots.get("F")) is not None:
            key, first, last = (a.mb, a.chunk), a.chunk == 0, a.chunk == n_chunks - 1
            f["f_on"][t, s], f["f_mb"][t, s], f["f_chunk"][t, s] = 1, a.mb, a.chunk // p
            f["f_first"][t, s] = first
            if not first:
                f["f_in"][t, s] = acts.find(s, key)
                frees.append((acts, s, key))
            f["f_res"][t, s] = res.take(s, key)
            if first:
                f["embed_mb"][t, :] = a.mb
            if last:  # the head runs on every stage; its output gradient is kept here
                f["head_on"][t, :], f["head_mb"][t, :], f["head_last"][t, s] = 1, a.mb, 1
                f["head_dy"][t, s] = grads.take(s, key)
            else:
                sends.append((acts, "recv_act", a.mb, a.chunk + 1))
        for kind, prefix in (("B", "b"), ("I", "b"), ("W", "w")):
            if (a := slots.get(kind)) is None:
                continue
            key = (a.mb, a.chunk)
            f[f"{prefix}_on"][t, s], f[f"{prefix}_chunk"][t, s] = 1, a.chunk // p
            f[f"{prefix}_res"][t, s], f[f"{prefix}_grad"][t, s] = (res.find(s, key),
                                                                   grads.find(s, key))
            if kind in ("B", "I"):
                f["b_first"][t, s] = a.chunk == 0
                if a.chunk == 0:  # every stage adds to the embedding's gradient
                    f["eback_on"][t, :], f["eback_mb"][t, :] = 1, a.mb
                else:
                    sends.append((grads, "recv_grad", a.mb, a.chunk - 1))
            if kind in ("B", "W"):
                frees += [(res, s, key), (grads, s, key)]
    return frees, sends


def compile_program(steps: Sequence[Step], p: int, v: int = 1) -> Program:
    """The arrays the executor indexes, step by step, grouped into stretches.

    A slot read in a step is freed at its end; what arrives at the end of a step then takes
    the lowest free slot on its receiver. Residual slots are taken by the forward slot, which
    runs before the step's backward slot frees any, so a slot is never overwritten while read.
    """
    n_chunks = v * p
    f = {name: np.full((len(steps), p), -1, np.int32) for name in FIELDS}
    for name in ("f_on", "f_first", "b_on", "b_first", "w_on", "head_on", "head_last",
                 "f_mb", "f_chunk", "b_chunk", "w_chunk", "embed_mb", "head_mb", "eback_on",
                 "eback_mb"):
        f[name][:] = 0
    pools = {"act": _Slots(p), "res": _Slots(p), "grad": _Slots(p)}
    for t, step in enumerate(steps):
        frees, sends = _place_step(t, step, n_chunks, f, pools)
        for pool, s, key in frees:
            pool.free(s, key)
        for pool, name, mb, chunk in sends:
            receiver = stage_of(chunk, p)
            f[name][t, receiver] = pool.take(receiver, (mb, chunk))
    sizes = {name: pool.peak for name, pool in pools.items()}
    # -1 (no slot) reads and writes the spare slot at the end of each stash.
    spare = {"f_in": "act", "recv_act": "act", "f_res": "res", "b_res": "res", "w_res": "res",
             "b_grad": "grad", "w_grad": "grad", "head_dy": "grad", "recv_grad": "grad"}
    for name, pool in spare.items():
        f[name][f[name] < 0] = sizes[pool]
    kinds = [step_kind(step, n_chunks) for step in steps]
    stretches, start = [], 0
    for t in range(1, len(steps) + 1):
        if t == len(steps) or kinds[t] != kinds[start]:
            stretches.append(Stretch(kinds[start], {k: a[start:t] for k, a in f.items()}))
            start = t
    return Program(tuple(stretches), sizes["act"], sizes["res"], sizes["grad"])


def describe(name: str, p: int, m: int, v: int = 1, accum: int = 1) -> dict[str, Any]:
    """What ``jaxpar inspect``, ``plan``, ``schedule`` and ``metrics.jsonl`` report about a run's
    schedule: the executed timeline's ticks and bubble (masked slots count as idle), the
    executed-work factor (ticks a stage runs / ticks of useful work = 1 / (1 - bubble)), and the
    stash sizes of the busiest stage (spare slot not counted).

    ``accum`` (``train.grad_accum``) micro-steps of ``m`` microbatches each run as one schedule
    of ``accum x m`` microbatches (the executor folds them in): ``microbatches`` is that count,
    and the bubble, steps and stashes are that schedule's."""
    steps = schedule_steps(name, p, accum * m, v)
    table = table_of(steps)
    program = compile_program(steps, p, v)
    bubble = bubble_fraction(table)
    return {"schedule": name, "stages": p, "microbatches": accum * m, "grad_accum": accum,
            "virtual_stages": v,
            "steps": len(steps), "ticks": len(table), "bubble": float(bubble),
            "executed_work_factor": float(1 / (1 - bubble)),
            "stretches": ["+".join("head" if k == "H" else k for k in s.kinds)
                          for s in program.stretches],
            "forward_steps": sum("F" in s.kinds for s in steps),
            "backward_steps": sum("B" in s.kinds or "I" in s.kinds for s in steps),
            "head_steps": sum(len(s.fields["f_on"]) for s in program.stretches
                              if "H" in s.kinds),
            # executed steps with an input-gradient-only (I) and a weight-gradient (W) slot
            "input_steps": sum(len(s.fields["f_on"]) for s in program.stretches
                               if "I" in s.kinds),
            "weight_steps": sum(len(s.fields["f_on"]) for s in program.stretches
                                if "W" in s.kinds),
            "activation_slots": program.act_slots, "residual_slots": program.res_slots,
            "gradient_slots": program.grad_slots}
