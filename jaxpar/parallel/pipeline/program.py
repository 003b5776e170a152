"""The pipeline's schedule compiled for the executor: per (round, stage) integers, by stretch.

:func:`compile_program` writes, for every round and stage, what the executor reads: each slot's
microbatch and chunk, the stash slots it reads and writes, and where arrivals are kept. Slots
come from per-stage free lists, lowest first, so a stash holds exactly the schedule's peak in
flight (plus one spare for masked writes). Consecutive rounds of one kind form a *stretch*,
run as one scan.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxpar.parallel.pipeline.schedules import (
    Placement,
    Round,
    placement_of,
    schedule_rounds,
    stage_of,
    table_of,
)
from jaxpar.parallel.pipeline.timeline import bubble_fraction

# Per (round, stage) integers the executor reads; "trash" slot indices where there is no work.
FIELDS = (
    "f_on", "f_mb", "f_chunk", "f_first", "f_in", "f_res",  # forward slot
    "b_on", "b_mb", "b_chunk", "b_first", "b_res", "b_grad",  # backward slot (B or I)
    "b_wait",  # I: where what its W will need waits (the W stash)
    "w_on", "w_chunk", "w_res", "w_wait",  # weight-gradient slot (W)
    "embed_mb", "head_on", "head_mb", "head_last", "head_dy",  # shared work of the round
    "eback_on", "eback_mb",
    "recv_act", "recv_grad",  # where what arrives at the end of the round is stored
    # ... in the V (dualpipe_v): activations from the next device, input gradients from the
    # previous one, and what the device at the bottom of the V hands itself
    "recv_act_back", "recv_grad_back", "keep_act", "keep_grad",
)


# --------------------------------------------------------------------------------------------
# From rounds to arrays


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
    """Consecutive rounds repeating one pattern of kinds: ``fields[name]`` is int32
    ``[repeats, len(pattern), stages]``, one scan over the repeats."""

    pattern: tuple[tuple[str, ...], ...]
    fields: dict[str, np.ndarray]

    @property
    def rounds(self) -> int:
        return len(self.fields["f_on"]) * len(self.pattern)

    def round_kinds(self) -> list[tuple[str, ...]]:
        """The kinds of each of its rounds, in order."""
        return list(self.pattern) * len(self.fields["f_on"])


@dataclass(frozen=True)
class Program:
    """A compiled schedule: its stretches and each stash's size (the spare slot is index
    ``size``)."""

    stretches: tuple[Stretch, ...]
    act_slots: int  # activations that arrived and wait for their forward
    res_slots: int  # forward residuals that wait for their backward (a split one's W)
    grad_slots: int  # output gradients that wait for their backward
    wait_slots: int = 0  # what an I leaves its W (the W stash)
    placement: Placement = "ring"  # how chunks sit on devices (schedules.stage_of)

    @property
    def rounds(self) -> int:
        return sum(s.rounds for s in self.stretches)

    def round_kinds(self) -> list[tuple[str, ...]]:
        """The kinds of every executed round, in order."""
        return [k for s in self.stretches for k in s.round_kinds()]


def executed_kinds(rnd: Round) -> tuple[str, ...]:
    """The slots run for ``rnd``: its kinds, but an I and a W of the same (microbatch, chunk) on
    every stage run as one B."""
    if "I" in rnd.kinds and "W" in rnd.kinds and all(
            (a.get("I") is None) == (a.get("W") is None)
            and (a.get("I") is None or a["I"].mb == a["W"].mb and a["I"].chunk == a["W"].chunk)
            for a in rnd.actions):
        return tuple(k for k in rnd.kinds if k not in ("I", "W")) + ("B",)
    return rnd.kinds


def round_kind(rnd: Round, n_chunks: int) -> tuple[str, ...]:
    """:func:`executed_kinds`, plus ``H`` (head and loss) when a forward is the last chunk."""
    head = any((a := slots.get("F")) is not None and a.chunk == n_chunks - 1
               for slots in rnd.actions)
    return executed_kinds(rnd) + (("H",) if head else ())


def _place_round(t: int, rnd: Round, n_chunks: int, f: dict, pools: dict,
                 ) -> tuple[list, list]:
    """Fill row ``t`` of ``f`` for ``rnd``; return the slots it frees and what it sends."""
    acts, res, grads, waits = pools["act"], pools["res"], pools["grad"], pools["wait"]
    frees, sends = [], []
    p = len(rnd.actions)
    fused = "B" in executed_kinds(rnd) and "B" not in rnd.kinds
    for s, slots in enumerate(rnd.actions):
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
                sends.append((acts, s, a.mb, a.chunk + 1))
        for kind, prefix in (("B", "b"), ("I", "b"), ("W", "w")):
            if (a := slots.get(kind)) is None:
                continue
            key = (a.mb, a.chunk)
            f[f"{prefix}_on"][t, s], f[f"{prefix}_chunk"][t, s] = 1, a.chunk // p
            f[f"{prefix}_res"][t, s] = res.find(s, key)
            if kind in ("B", "I"):
                f["b_mb"][t, s] = a.mb  # for a chunk run again from its input (recompute.py)
                f["b_grad"][t, s] = grads.find(s, key)
                frees.append((grads, s, key))
                f["b_first"][t, s] = a.chunk == 0
                if a.chunk == 0:  # every stage adds to the embedding's gradient
                    f["eback_on"][t, :], f["eback_mb"][t, :] = 1, a.mb
                else:
                    sends.append((grads, s, a.mb, a.chunk - 1))
            if kind == "I":
                f["b_wait"][t, s] = waits.take(s, key)
            if kind == "W":
                f["w_wait"][t, s] = waits.find(s, key)
                frees.append((waits, s, key))
            if kind in ("B", "W"):
                frees.append((res, s, key))
    return frees, sends


def _arrival_field(pools: dict, pool: _Slots, sender: int, receiver: int,
                   placement: Placement) -> str:
    """The field for where a send arrives: on the ring activations go on, gradients back
    (``recv_act``, ``recv_grad``); in the V either way, or stay."""
    name = "act" if pool is pools["act"] else "grad"
    if placement == "ring":
        return f"recv_{name}"
    if receiver == sender:
        return f"keep_{name}"
    usual = 1 if name == "act" else -1  # the ring's direction
    return f"recv_{name}" if receiver - sender == usual else f"recv_{name}_back"


def compile_program(rounds: Sequence[Round], p: int, v: int = 1,
                    placement: Placement = "ring") -> Program:
    """The arrays the executor indexes, grouped into stretches. A slot read in a round is freed at
    its end; arrivals take the receiver's lowest free slot. Residual slots are taken before any
    are freed, so none is overwritten while read."""
    n_chunks = v * p
    f = {name: np.full((len(rounds), p), -1, np.int32) for name in FIELDS}
    for name in ("f_on", "f_first", "b_on", "b_first", "w_on", "head_on", "head_last",
                 "f_mb", "f_chunk", "b_mb", "b_chunk", "w_chunk", "embed_mb", "head_mb",
                 "eback_on", "eback_mb"):
        f[name][:] = 0
    pools = {"act": _Slots(p), "res": _Slots(p), "grad": _Slots(p), "wait": _Slots(p)}
    for t, rnd in enumerate(rounds):
        frees, sends = _place_round(t, rnd, n_chunks, f, pools)
        for pool, s, key in frees:
            pool.free(s, key)
        for pool, sender, mb, chunk in sends:
            receiver = stage_of(chunk, p, placement)
            name = _arrival_field(pools, pool, sender, receiver, placement)
            f[name][t, receiver] = pool.take(receiver, (mb, chunk))
    sizes = {name: pool.peak for name, pool in pools.items()}
    # -1 (no slot) reads and writes the spare slot at the end of each stash.
    spare = {"f_in": "act", "recv_act": "act", "f_res": "res", "b_res": "res", "w_res": "res",
             "b_grad": "grad", "head_dy": "grad", "recv_grad": "grad", "b_wait": "wait",
             "w_wait": "wait", "recv_act_back": "act", "recv_grad_back": "grad",
             "keep_act": "act", "keep_grad": "grad"}
    for name, pool in spare.items():
        f[name][f[name] < 0] = sizes[pool]
    kinds = [round_kind(rnd, n_chunks) for rnd in rounds]
    stretches = []
    for start, period, repeats in _stretches(kinds):
        end = start + period * repeats
        stretches.append(Stretch(tuple(kinds[start:start + period]),
                                 {k: a[start:end].reshape(repeats, period, p)
                                  for k, a in f.items()}))
    return Program(tuple(stretches), sizes["act"], sizes["res"], sizes["grad"], sizes["wait"],
                   placement)


def _stretches(kinds: Sequence[tuple], longest: int = 8) -> list[tuple[int, int, int]]:
    """Cut the rounds' kinds into stretches ``(start, period, repeats)``: fewest rounds in the
    patterns (bodies to compile), then fewest stretches."""
    n = len(kinds)
    best: list[tuple[int, int, tuple | None]] = [(0, 0, None)] * (n + 1)  # cost from i on
    for i in range(n - 1, -1, -1):
        options = []
        for period in range(1, min(longest, n - i) + 1):
            pattern = kinds[i:i + period]
            repeats = 1
            while kinds[i + repeats * period:i + (repeats + 1) * period] == pattern:
                repeats += 1
            for r in range(1 if period == 1 else 2, repeats + 1):  # a pattern repeats
                body, scans, _ = best[i + r * period]
                options.append((period + body, 1 + scans, (period, r)))
        best[i] = min(options, key=lambda o: o[:2])
    cut, i = [], 0
    while i < n:
        period, repeats = best[i][2]
        cut.append((i, period, repeats))
        i += period * repeats
    return cut


def _stretch_name(stretch: Stretch) -> str:
    names = ["+".join("head" if k == "H" else k for k in kinds) for kinds in stretch.pattern]
    if len(names) == 1:
        return names[0]
    repeats = len(stretch.fields["f_on"])
    return f"({', '.join(names)})" + (f" x {repeats}" if repeats > 1 else "")


def describe(name: str, p: int, m: int, v: int = 1, accum: int = 1, overlap: bool = False,
             ) -> dict[str, Any]:
    """A run's schedule as ``jaxpar inspect``, ``plan``, ``schedule`` and ``metrics.jsonl`` report
    it: ticks, bubble, executed-work factor, the busiest stage's stash sizes. ``accum`` micro-steps
    of ``m`` microbatches run as one schedule of ``accum x m``; ``overlap`` turns the last chunk a
    round later."""
    rounds = schedule_rounds(name, p, accum * m, v, overlap)
    table = table_of(rounds)
    program = compile_program(rounds, p, v, placement_of(name))
    bubble = bubble_fraction(table)
    return {"schedule": name, "stages": p, "microbatches": accum * m, "grad_accum": accum,
            "virtual_stages": v, "placement": program.placement,
            # The keys keep the word "steps" (a contract: `jaxpar inspect --json`'s `pipeline`
            # object, what `jaxpar schedule` prints); the code calls them rounds.
            "steps": len(rounds), "ticks": len(table), "bubble": float(bubble),
            "executed_work_factor": float(1 / (1 - bubble)),
            "stretches": [_stretch_name(s) for s in program.stretches],
            "forward_steps": sum("F" in s.kinds for s in rounds),
            "backward_steps": sum("B" in s.kinds or "I" in s.kinds for s in rounds),
            "head_steps": sum("H" in k for k in program.round_kinds()),
            **_embedding_rounds(rounds, program),
            # executed rounds with an input-gradient-only (I) and a weight-gradient (W) slot
            "input_steps": sum("I" in k for k in program.round_kinds()),
            "weight_steps": sum("W" in k for k in program.round_kinds()),
            "activation_slots": program.act_slots, "residual_slots": program.res_slots,
            "gradient_slots": program.grad_slots, "weight_stash_slots": program.wait_slots,
            "sends": compiled_sends(program)}


def _once(program: Program) -> list[bool]:
    """Per round, whether its stretch runs once (unrolled, fields constant to the compiler)."""
    return [once for s in program.stretches for once in [len(s.fields["f_on"]) == 1] * s.rounds]


def _embedding_rounds(rounds: Sequence[Round], program: Program) -> dict[str, int]:
    """Rounds whose embedding and chunk-0 input gradient the program keeps: all but a once-run
    stretch's where no forward (or backward) is the first chunk's."""
    once = _once(program)

    def kept(t: int, kinds: tuple[str, ...]) -> bool:
        chunks = [a.chunk for slots in rounds[t].actions for k, a in slots.items() if k in kinds]
        return bool(chunks) and (not once[t] or 0 in chunks)

    # The keys keep the word "steps" (a contract: `jaxpar inspect --json`); the code says rounds.
    return {"embed_steps": sum(kept(t, ("F",)) for t in range(len(rounds))),
            "embed_back_steps": sum(kept(t, ("B", "I")) for t in range(len(rounds)))}


def compiled_sends(program: Program) -> int:
    """The ``ppermute``s over ``pipe`` a compiled round runs: one a direction per round, less those
    the compiler drops as dead (a once-run stretch's last round). Exact against XLA:CPU's
    programs but for DualPipe-V (within 6%)."""
    ways = 2 if program.placement == "v" else 1
    kinds, once = program.round_kinds(), _once(program)
    total = 0
    for slots in (("F",), ("B", "I")):
        rounds = [t for t, k in enumerate(kinds) if any(kind in k for kind in slots)]
        total += ways * (len(rounds) - (1 if rounds and once[rounds[-1]] else 0))
    return total
