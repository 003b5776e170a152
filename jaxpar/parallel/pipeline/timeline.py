"""Reading an executed timeline: a *table* of ticks x stages (an
:class:`~jaxpar.parallel.pipeline.schedules.Action` or ``None``, masked, each), its cost
(:func:`bubble_fraction`), what a stage holds (:func:`peak_in_flight`,
:func:`peak_weight_stash`), printing (:func:`render`), and :func:`validate`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

from jaxpar.parallel.pipeline.schedules import (
    TICKS,
    Action,
    Placement,
    Tick,
    needs,
    provides,
    stage_of,
)


@dataclass(frozen=True)
class _Run:
    """An action placed in a table: stage, first tick, tick after the last."""

    action: Action
    stage: int
    start: int
    end: int


def _width(table: Sequence[Tick]) -> int:
    """The number of stages; every tick must have that many entries."""
    if not table:
        raise ValueError("the schedule table is empty")
    p = len(table[0])
    for t, tick in enumerate(table):
        if len(tick) != p:
            raise ValueError(f"tick {t} has {len(tick)} entries, tick 0 has {p}")
        for s, cell in enumerate(tick):
            if cell is not None and not isinstance(cell, Action):
                raise ValueError(f"tick {t}, stage {s}: {cell!r} is neither an Action nor None")
    return p


def _runs(table: Sequence[Tick]) -> list[_Run]:
    """Each stage's consecutive equal entries as one run, sorted by start tick."""
    p = _width(table)
    runs = []
    for s in range(p):
        t = 0
        while t < len(table):
            a = table[t][s]
            end = t + 1
            while end < len(table) and table[end][s] == a:
                end += 1
            if a is not None:
                runs.append(_Run(a, s, t, end))
            t = end
    return sorted(runs, key=lambda r: (r.start, r.stage))


def bubble_fraction(table: Sequence[Tick]) -> Fraction:
    """Idle entries / all entries (ticks x stages), exactly."""
    p = _width(table)
    idle = sum(cell is None for tick in table for cell in tick)
    return Fraction(idle, len(table) * p)


def peak_in_flight(table: Sequence[Tick]) -> tuple[int, ...]:
    """Per stage, the most (microbatch, chunk) pairs with forward started and backward (B, or W)
    not finished: the activations it holds."""
    p = _width(table)
    held = [0] * p
    peak = [0] * p
    for run in _runs(table):
        if run.action.kind == "F":
            held[run.stage] += 1
            peak[run.stage] = max(peak[run.stage], held[run.stage])
        elif run.action.kind in ("B", "W"):
            held[run.stage] -= 1
    return tuple(peak)


def peak_weight_stash(table: Sequence[Tick]) -> tuple[int, ...]:
    """Per stage, the most pairs with I finished and W not started (the W stash). A W in its own
    I's round, or a B, holds none."""
    p = _width(table)
    done: dict[tuple[int, int, int], int] = {}
    for run in _runs(table):
        if run.action.kind == "I":
            done[(run.stage, run.action.mb, run.action.chunk)] = run.end
    waiting = [[0] * len(table) for _ in range(p)]
    for run in _runs(table):
        if run.action.kind == "W":
            for t in range(done[(run.stage, run.action.mb, run.action.chunk)], run.start):
                waiting[run.stage][t] += 1
    return tuple(max(row, default=0) for row in waiting)


def render(table: Sequence[Tick]) -> str:
    """One row per stage, one column per tick: ``F3`` = forward of microbatch 3, ``.`` = idle; a B
    shows in both ticks. With several chunks a letter names it (``F3a`` = chunk s, ``F3b`` =
    s+p, ...)."""
    p = _width(table)
    several = any(cell is not None and cell.chunk >= p for tick in table for cell in tick)

    def label(cell: Action | None) -> str:
        if cell is None:
            return "."
        lap = chr(ord("a") + cell.chunk // p) if several else ""
        return f"{cell.kind}{cell.mb}{lap}"

    labels = [[label(cell) for cell in tick] for tick in table]
    width = max(len(text) for row in labels for text in row)
    name = len(str(p - 1))
    rows = []
    for s in range(p):
        cells = " ".join(row[s].ljust(width) for row in labels)
        rows.append(f"stage {s:>{name}}: {cells}".rstrip())
    return "\n".join(rows)


# --------------------------------------------------------------------------------------------
# Validation


def validate(table: Sequence[Tick], p: int, m: int, v: int = 1,
             placement: Placement = "ring") -> None:
    """Raise ValueError naming the first thing that makes ``table`` impossible.

    In order, each in tick order: the shape (``p`` entries per tick, an action or None); each
    action lasts its ticks on its chunk's stage, ``mb`` and ``chunk`` in range; each (mb, chunk)
    has one F and one backward (B, or I and W); nothing starts before what it needs finished (F
    after the previous chunk's F, B/I after their F and the next chunk's B/I, W after its I).
    """
    if table and len(table[0]) != p:
        raise ValueError(f"tick 0 has {len(table[0])} entries, expected one per stage (p={p})")
    runs = _runs(table)
    n_chunks = v * p

    for r in runs:
        a = r.action
        where = f"{a} on stage {r.stage} at tick {r.start}"
        if r.end - r.start != a.ticks:
            raise ValueError(f"{where} lasts {r.end - r.start} tick(s); a {a.kind} takes "
                             f"{a.ticks}")
        if not 0 <= a.mb < m:
            raise ValueError(f"{where}: microbatch out of range 0..{m - 1}")
        if not 0 <= a.chunk < n_chunks:
            raise ValueError(f"{where}: chunk out of range 0..{n_chunks - 1}")
        if (home := stage_of(a.chunk, p, placement)) != r.stage:
            raise ValueError(f"{where}: chunk {a.chunk} lives on stage {home}")

    placed: dict[Action, _Run] = {}
    for r in runs:
        if r.action in placed:
            first = placed[r.action]
            raise ValueError(f"{r.action} runs twice, on stage {first.stage} at tick "
                             f"{first.start} and on stage {r.stage} at tick {r.start}")
        placed[r.action] = r
    for mb in range(m):
        for chunk in range(n_chunks):
            has = {kind: Action(kind, mb, chunk) in placed for kind in TICKS}
            home = f"(stage {stage_of(chunk, p, placement)})"
            if not has["F"]:
                raise ValueError(f"{Action('F', mb, chunk)} never runs {home}")
            if has["B"] and (has["I"] or has["W"]):
                raise ValueError(f"microbatch {mb}, chunk {chunk} has both a B and an I/W "
                                 f"backward {home}")
            if not (has["B"] or has["I"] or has["W"]):
                raise ValueError(f"microbatch {mb}, chunk {chunk} has no backward (B, or I "
                                 f"and W) {home}")
            if has["I"] != has["W"]:
                present, missing = ("I", "W") if has["I"] else ("W", "I")
                raise ValueError(f"{Action(present, mb, chunk)} has no matching "
                                 f"{Action(missing, mb, chunk)} {home}")

    ready: dict[tuple[str, int, int], _Run] = {}
    for r in runs:
        for key in provides(r.action):
            ready[key] = r
    for r in runs:
        for why, key in needs(r.action, n_chunks):
            source = ready[key]  # present: the exactly-once checks above passed
            if source.end > r.start:
                raise ValueError(f"{r.action} on stage {r.stage} starts at tick {r.start} but "
                                 f"needs {why} {source.action} on stage {source.stage}, "
                                 f"done only at tick {source.end}")



