"""Pipeline parallelism: the schedule tables that say which stage does what at every tick.

What it splits. The layer stack is cut into ``p`` consecutive *stages*, one per device along the
``pipe`` mesh axis; each device stores and updates only its stage's layers. Interleaved schedules
cut finer, into ``v * p`` *chunks* (virtual stages): device ``s`` holds chunks ``s, s+p, s+2p,
...``, so a microbatch laps the ring of devices ``v`` times.

What it communicates. The global batch of one pipeline (``B`` sequences) is split into ``m``
microbatches. At each stage boundary a microbatch's activation goes forward and, later, its
gradient comes back: one ``ppermute`` over ``pipe`` each way, ``B/m x S x d_model`` elements per
microbatch per boundary. There are ``v*p - 1`` boundaries, so interleaving multiplies this traffic
by ``v`` (the boundary from chunk ``p-1`` back to chunk ``p`` goes from the last device to the
first: the ppermute is a ring). The executor below sends on every tick of the table (zeros when
a stage has nothing to send), so the bytes are ``2 x ticks`` messages per device. Little else
crosses ``pipe``: each stage's gradients belong to its own layers (their data-parallel
reductions run over the other axes); the parameters outside the layer stack (embedding, final
norm, head) are replicated over ``pipe``, used by the first or last chunk only, and their
gradients summed over ``pipe`` once per step.

Why a bubble. Microbatch 0 reaches stage ``s`` only after ``s`` stages have run it, and its
gradient returns only after all later stages have, so at the start and the end of a step some
devices wait. Measured as the idle share of the (ticks x stages) table:

    schedule      idle (bubble) fraction        activations held by the busiest stage
    gpipe         (p-1) / (m+p-1)               m microbatches
    1f1b          (p-1) / (m+p-1)               p microbatches (stage s: p-s)
    interleaved   (p-1) / (v*m+p-1)             2(p-1)+(v-1)p+1 chunks = p + (p-1)/v stages
    zero_bubble   (p-1) / (3m+p-1), m >= p      p microbatches (every stage)

GPipe shrinks the bubble only by raising ``m`` (and holds all ``m`` activations). 1F1B
alternates: once a stage has warmed up it runs one backward after each forward, so it never holds
more than ``p`` microbatches' activations; the bubble is unchanged. Interleaving makes each tick
``v`` times shorter while the pipeline fills in the same number of ticks, dividing the bubble by
about ``v`` for ``v``-fold communication and a little more memory. Zero bubble (ZB-H1) splits the
backward into ``I`` (gradient w.r.t. the stage's input, which the previous stage waits for) and
``W`` (gradient w.r.t. the stage's weights, which nobody waits for), and moves ``W``s into the
ticks where 1F1B idles.

Cost model (the same for every table, so their bubbles compare). One *tick* is the time of one
forward through one chunk (a whole stage when ``v = 1``). A backward costs two forwards (each
matmul of the forward has two in the backward: one for the input gradient, one for the weight
gradient), so ``B`` occupies two consecutive ticks of its stage and ``I`` and ``W`` one each.
Sending a result to the next stage is free, but the receiver starts at the earliest on the tick
after the sender finished. With this model the formulas above are exact (the tests check them
with ``fractions.Fraction``).

A table is a list of ticks, each a tuple with one entry per stage: an :class:`Action` or
``None`` (idle). A ``B`` appears in both of its ticks. The builders write down each stage's
*order* of actions (that is all a schedule is) and :func:`as_soon_as_possible` times them. The
executor (the last part of this module) runs any valid table inside ``shard_map`` over
``pipe``: at every tick each device looks up its own action and does it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec

Kind = Literal["F", "B", "I", "W"]

# Ticks each kind of action occupies (see "Cost model" above).
TICKS: dict[str, int] = {"F": 1, "B": 2, "I": 1, "W": 1}


@dataclass(frozen=True)
class Action:
    """One unit of work: forward ``F``, full backward ``B``, or its halves ``I`` (input gradient)
    and ``W`` (weight gradient), of microbatch ``mb`` through model chunk ``chunk``."""

    kind: Kind
    mb: int
    chunk: int = 0

    def __post_init__(self) -> None:
        if self.kind not in TICKS:
            raise ValueError(f"Action kind {self.kind!r} is not one of {', '.join(TICKS)}")

    @property
    def ticks(self) -> int:
        return TICKS[self.kind]

    def __str__(self) -> str:
        return f"{self.kind}(mb={self.mb}, chunk={self.chunk})"


Tick = tuple[Action | None, ...]
Table = list[Tick]


def stage_of(chunk: int, p: int) -> int:
    """The device along ``pipe`` that holds ``chunk``: chunks go round the ring, s, s+p, ..."""
    return chunk % p


# --------------------------------------------------------------------------------------------
# Dependencies: what an action needs before it can start.
#
# Results are named by keys (role, mb, chunk). "out" is a chunk's forward output, "dx" the
# gradient w.r.t. a chunk's input (made by B or by I), "I" the input-gradient half alone (W
# reuses what I computed).


def _provides(a: Action) -> list[tuple[str, int, int]]:
    roles = {"F": ["out"], "B": ["dx"], "I": ["dx", "I"], "W": []}[a.kind]
    return [(role, a.mb, a.chunk) for role in roles]


def _needs(a: Action, n_chunks: int) -> list[tuple[str, tuple[str, int, int]]]:
    """(why, key) pairs: the results ``a`` must wait for."""
    if a.kind == "F":
        # The first chunk reads the microbatch itself; the others the previous chunk's output.
        return [("its input from", ("out", a.mb, a.chunk - 1))] if a.chunk > 0 else []
    if a.kind in ("B", "I"):
        # A backward needs its own forward's activations and, except on the last chunk (whose
        # forward ends in the loss), the gradient w.r.t. its output = the next chunk's dx.
        needs = [("its own forward", ("out", a.mb, a.chunk))]
        if a.chunk < n_chunks - 1:
            needs.append(("its output gradient from", ("dx", a.mb, a.chunk + 1)))
        return needs
    return [("the input-gradient half", ("I", a.mb, a.chunk))]


# --------------------------------------------------------------------------------------------
# Timing: from each stage's order of actions to a table.


def as_soon_as_possible(orders: Sequence[Sequence[Action]], v: int = 1) -> Table:
    """Time per-stage orders: each stage runs its list in order, each action starting at the
    first tick when its stage is free and everything it needs has finished.

    ``orders[s]`` is stage ``s``'s list; ``v`` is the number of chunks per stage. This is what
    devices running those lists would do on their own, so the table is the schedule's timing.
    Raises ValueError if the orders deadlock (some stage waits for a result that never comes).
    """
    p = len(orders)
    n_chunks = v * p
    ready: dict[tuple[str, int, int], int] = {}  # result -> first tick it can be used
    start: dict[tuple[int, Action], int] = {}
    next_index = [0] * p
    free_at = [0] * p
    progress = True
    while progress:
        progress = False
        for s in range(p):
            while next_index[s] < len(orders[s]):
                a = orders[s][next_index[s]]
                if (s, a) in start:
                    raise ValueError(f"stage {s} lists {a} twice")
                keys = [key for _, key in _needs(a, n_chunks)]
                if any(key not in ready for key in keys):
                    break  # this stage waits; another stage's progress may unblock it
                t = max([free_at[s], *(ready[key] for key in keys)])
                start[(s, a)] = t
                free_at[s] = t + a.ticks
                for key in _provides(a):
                    ready[key] = free_at[s]
                next_index[s] += 1
                progress = True
    stuck = [f"stage {s} at {orders[s][i]}" for s, i in enumerate(next_index) if i < len(orders[s])]
    if stuck:
        raise ValueError(f"the stage orders deadlock: {', '.join(stuck)} wait forever")

    table: list[list[Action | None]] = [[None] * p for _ in range(max(free_at, default=0))]
    for (s, a), t in start.items():
        for tick in range(t, t + a.ticks):
            table[tick][s] = a
    return [tuple(row) for row in table]


def _check_sizes(p: int, m: int, v: int = 1) -> None:
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"pipeline schedule needs p, m, v >= 1; got p={p} m={m} v={v}")


# --------------------------------------------------------------------------------------------
# The schedules


def gpipe(p: int, m: int) -> Table:
    """GPipe: every stage runs all ``m`` forwards, then all ``m`` backwards.

    Stage ``s`` runs F(j) at tick ``s + j``. The last backward on stage 0 ends after the forward
    wave (``m + p - 1`` ticks) and the backward wave (``2(m + p - 1)`` ticks), so the table is
    ``3(m+p-1)`` ticks long, each stage busy ``3m`` of them:
    bubble = 3(p-1) / 3(m+p-1) = (p-1)/(m+p-1). Every stage holds all ``m`` microbatches'
    activations at the turn.
    """
    _check_sizes(p, m)
    orders = [[Action("F", j, s) for j in range(m)] + [Action("B", j, s) for j in range(m)]
              for s in range(p)]
    return as_soon_as_possible(orders)


def _one_f_one_b_orders(p: int, m: int, split_backward: bool) -> list[list[Action]]:
    """Per-stage orders of 1F1B and ZB-H1, written as one loop over steps x = 0 .. m+p-2.

    At step x stage s runs F(x), then the backward of microbatch x-(p-1-s): the last stage
    turns each microbatch around at once, stage s runs p-1-s forwards ahead (warm-up), and the
    steps past m are the cool-down. With ``split_backward`` that backward is I only, and W runs
    for microbatch x-(p-1): W lags I by s steps on stage s. Stage s thus passes its first s
    gradients upstream without stopping for their W's and runs those W's at the end, where in
    1F1B it would sit idle while the earlier stages finish; F(x) still comes after W(x-p), so at
    most p microbatches are in flight.
    """
    orders = []
    for s in range(p):
        order = []
        for x in range(m + p - 1):
            if x < m:
                order.append(Action("F", x, s))
            if 0 <= (back := x - (p - 1 - s)) < m:
                order.append(Action("I" if split_backward else "B", back, s))
            if split_backward and 0 <= (weight := x - (p - 1)) < m:
                order.append(Action("W", weight, s))
        orders.append(order)
    return orders


def one_f_one_b(p: int, m: int) -> Table:
    """1F1B (PipeDream-flush, Megatron's default): warm up with ``p-1-s`` forwards on stage
    ``s``, then alternate one forward and one backward, then cool down with the last backwards.

    Each backward starts as early as dependencies allow, which frees a microbatch's activations
    early: stage ``s`` never holds more than ``p - s`` of them (GPipe: ``m``). The critical path
    is the same as GPipe's (``3(m+p-1)`` ticks), so the bubble is too: (p-1)/(m+p-1).
    """
    _check_sizes(p, m)
    return as_soon_as_possible(_one_f_one_b_orders(p, m, split_backward=False))


def interleaved(p: int, m: int, v: int) -> Table:
    """Megatron's interleaved 1F1B: ``v`` chunks per stage, stage ``s`` holding chunks
    ``s, s+p, ..., s+(v-1)p``; ``m`` must be divisible by ``p``.

    Microbatches go in groups of ``p``: stage ``s`` runs the group through its first chunk, then
    its second, ... (microbatch 0's output from chunk ``p-1`` on the last stage arrives back at
    stage 0 exactly when stage 0 has finished the group, hence ``m % p == 0``). Its k-th forward
    is group ``k // (p v)``, chunk lap ``(k // p) % v``; backwards run the laps in reverse.
    Stage ``s`` warms up with ``2(p-1-s) + (v-1)p`` forwards (the other laps of the first group,
    plus the round trip to the last stage and back), then alternates, then cools down.

    Ticks are chunk-forwards (one chunk is 1/v of a stage), so a stage is busy ``3vm`` ticks and
    the fill/drain costs ``3(p-1)`` of them: bubble = (p-1)/(v m + p-1). The busiest stage holds
    ``min(2(p-1) + (v-1)p + 1, v m)`` chunks' activations: p + (p-1)/v stages' worth when m is
    large enough (1F1B: p).
    """
    _check_sizes(p, m, v)
    if m % p:
        raise ValueError(f"interleaved schedule needs microbatches divisible by stages: "
                         f"m={m} is not divisible by p={p}")
    total = v * m

    def nth(s: int, k: int, kind: Kind) -> Action:
        group, position = divmod(k, p * v)
        lap = position // p if kind == "F" else v - 1 - position // p
        return Action(kind, group * p + position % p, s + p * lap)

    orders = []
    for s in range(p):
        warmup = min(2 * (p - 1 - s) + (v - 1) * p, total)
        order = [nth(s, k, "F") for k in range(warmup)]
        for k in range(total - warmup):
            order += [nth(s, warmup + k, "F"), nth(s, k, "B")]
        order += [nth(s, k, "B") for k in range(total - warmup, total)]
        orders.append(order)
    return as_soon_as_possible(orders, v)


def zero_bubble(p: int, m: int) -> Table:
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", 2024): 1F1B with each backward
    split into ``I`` and ``W``; I keeps B's place, W is delayed to fill the cool-down.

    Only I is on the critical path back to stage 0, and it costs one tick instead of two, so
    the gradient wave returns faster. With F = I = W = 1 tick, for ``m >= p`` the table is
    ``3m + p - 1`` ticks: bubble = (p-1)/(3m+p-1), a third of 1F1B's 3(p-1) idle ticks per
    stage. Every stage holds at most ``p`` microbatches (counted until their W), the same peak
    as 1F1B's stage 0; between I and W only the weight-gradient inputs are kept, so this count
    is an upper bound.
    """
    _check_sizes(p, m)
    return as_soon_as_possible(_one_f_one_b_orders(p, m, split_backward=True))


SCHEDULES: dict[str, Callable[..., Table]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved": interleaved,
    "zero_bubble": zero_bubble,
}


def schedule_table(name: str, p: int, m: int, v: int = 1) -> Table:
    """The table for ``parallel.pipeline_schedule=name`` (``v``: ``parallel.virtual_stages``)."""
    if name not in SCHEDULES:
        raise ValueError(f"pipeline schedule {name!r} is not one of {', '.join(SCHEDULES)}")
    if name == "interleaved":
        return interleaved(p, m, v)
    if v != 1:
        raise ValueError(f"pipeline schedule {name!r} runs one chunk per stage; v={v} needs "
                         "'interleaved'")
    return SCHEDULES[name](p, m)


# --------------------------------------------------------------------------------------------
# Reading tables


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
    """Each stage's consecutive equal entries merged into one run, all sorted by start tick."""
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
    """Per stage, the most (microbatch, chunk) pairs whose forward has started but whose
    backward (B, or W for a split backward) has not finished: the activations it must hold."""
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


def render(table: Sequence[Tick]) -> str:
    """One text row per stage, one column per tick: ``F3`` = forward of microbatch 3, ``.`` =
    idle; a B shows in both its ticks. When stages hold several chunks a letter names which
    (``F3a`` on stage s = chunk s, ``F3b`` = chunk s+p, ...)."""
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


def validate(table: Sequence[Tick], p: int, m: int, v: int = 1) -> None:
    """Raise ValueError naming the first thing that makes ``table`` an impossible schedule.

    Checked in this order, each in tick order: the shape (``p`` entries per tick, one action or
    None each, so no stage does two things at once); each run of an action lasts its ticks, on
    the stage that holds its chunk, with ``mb`` and ``chunk`` in range; every (mb, chunk) has
    exactly one F and exactly one backward (a B, or an I and a W); and nothing starts before
    what it needs has finished on an earlier tick (F after the previous chunk's F, B/I after
    their own F and the next chunk's B/I, W after its I).
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
        if stage_of(a.chunk, p) != r.stage:
            raise ValueError(f"{where}: chunk {a.chunk} lives on stage {stage_of(a.chunk, p)}")

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
            home = f"(stage {stage_of(chunk, p)})"
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
        for key in _provides(r.action):
            ready[key] = r
    for r in runs:
        for why, key in _needs(r.action, n_chunks):
            source = ready[key]  # present: the exactly-once checks above passed
            if source.end > r.start:
                raise ValueError(f"{r.action} on stage {r.stage} starts at tick {r.start} but "
                                 f"needs {why} {source.action} on stage {source.stage}, "
                                 f"done only at tick {source.end}")


# --------------------------------------------------------------------------------------------
# The executor: one compiled loop that runs any valid table inside shard_map over `pipe`.
#
# How the compiled program realizes a table. :func:`compile_table` turns the table into integer
# arrays indexed by (tick, stage): which branch to run, on which microbatch and local chunk,
# reading which stash slots, and where to store what arrives. One ``lax.scan`` runs the ticks.
# In its body each device reads the entry for its own stage (``axis_index('pipe')``) and
# ``lax.switch`` runs that branch alone, so an idle entry costs no compute. Then two
# ``ppermute``s over ``pipe`` pass on what was produced: the forward output one stage on, the
# input gradient one stage back (both rings, so chunk p-1 on the last device feeds chunk p on
# the first). Every device joins both on every tick, because a collective needs all of them; a
# stage with nothing to send sends zeros, which the receiver's table entry says to drop. Each
# device's program is the same; only its row of the table differs.
#
# What a device keeps. The *input* of each (microbatch, chunk) from when it arrives until its
# backward is done (a slot of the activation stash), and each gradient that arrived from the
# next stage until it is used (a slot of the gradient stash). Slots are handed out when the
# table is compiled, lowest free first, so their number is the table's peak in flight: m for
# GPipe, at most p for 1F1B. The backward recomputes the chunk's forward from its stashed input
# under ``jax.vjp`` (activation recomputation at chunk granularity; ``train.remat`` still
# decides what that recomputed forward keeps for its own backward). This is what makes the
# memory depend on the schedule: GPipe stashes m inputs, 1F1B at most p.
#
# Compute per (microbatch, chunk): F, then B = recompute + input and weight gradients (about
# four forwards in all, like full activation recomputation); a B takes two ticks in the table,
# the executor runs it on the first and idles on the second. A split backward recomputes
# twice: I = recompute + input gradient (sent upstream at once), W = recompute + weight
# gradient, about five forwards in all, the price ZB-H1 pays here for its smaller bubble.
#
# Parameters. A device's slice of the stacked layers, ``[v * layers_per_chunk, ...]``, holds its
# chunks s, s+p, ... in that order (for ``v > 1`` the trainer stores the layers permuted so;
# :func:`stage_layer_order`). Embedding, final norm and head are replicated over ``pipe``; only
# the first and last chunks use them, and their gradients are summed over ``pipe`` at the end:
# the one reduction over ``pipe``, of those parameters' bytes.

AXIS = "pipe"
IDLE = 0
POSITIONS = ("first", "middle", "last")
BRANCHES = 1 + 4 * len(POSITIONS)  # idle + (F, B, I, W) x positions
FIELDS = ("branch", "mb", "local_chunk", "act_slot", "grad_slot", "recv_act", "recv_grad")


def branch_index(kind: Kind, position: str) -> int:
    """Branch of the executor's ``lax.switch`` that runs ``kind`` on a chunk at ``position``."""
    return 1 + "FBIW".index(kind) * len(POSITIONS) + POSITIONS.index(position)


def position_of(chunk: int, n_chunks: int) -> str:
    return "first" if chunk == 0 else "last" if chunk == n_chunks - 1 else "middle"


def stage_layer_order(n_layers: int, p: int, v: int) -> list[int]:
    """Which model layer each stored layer is, when device ``s``'s contiguous ``n_layers / p``
    stored layers must be its chunks ``s, s+p, ..., s+(v-1)p`` in that order.

    The identity for ``v = 1``. For ``v > 1`` a contiguous split of the stacked layers over
    ``pipe`` would hand device 0 chunks 0 and 1; storing the layers in this order instead lets
    each device read its chunks without any parameter crossing ``pipe``.
    """
    per_chunk = n_layers // (p * v)
    return [(j * p + s) * per_chunk + k
            for s in range(p) for j in range(v) for k in range(per_chunk)]


@dataclass(frozen=True)
class Program:
    """A table compiled for the executor: ``fields[name][tick, stage]`` (int32) and slot counts.

    ``branch``: :func:`branch_index` or ``IDLE``; ``mb``, ``local_chunk`` (chunk // p): what to
    run; ``act_slot``, ``grad_slot``: the stash slots it reads; ``recv_act``, ``recv_grad``: the
    slot where what arrives at the end of the tick goes (-1: nothing arrives for this stage).
    """

    fields: dict
    act_slots: int
    grad_slots: int

    @property
    def ticks(self) -> int:
        return int(self.fields["branch"].shape[0])

    def branch_shares(self) -> list[float]:
        """Each branch's share of the ticks, averaged over stages: how often a device runs the
        collectives inside it (``jaxpar.inspect.hlo.parse_collectives``'s ``branch_runs``)."""
        counts = np.bincount(self.fields["branch"].ravel(), minlength=BRANCHES)
        return [float(c) / self.fields["branch"].size for c in counts]


def describe(name: str, p: int, m: int, v: int = 1) -> dict[str, Any]:
    """What ``jaxpar inspect`` and ``metrics.jsonl`` report about a run's schedule."""
    table = schedule_table(name, p, m, v)
    program = compile_table(table, p, m, v)
    return {"schedule": name, "stages": p, "microbatches": m, "virtual_stages": v,
            "ticks": program.ticks, "bubble": float(bubble_fraction(table)),
            "activation_slots": program.act_slots, "gradient_slots": program.grad_slots}


class _Slots:
    """Per-stage free lists: the lowest free slot is handed out first."""

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


def compile_table(table: Sequence[Tick], p: int, m: int, v: int = 1) -> Program:
    """The arrays the executor indexes; raises ValueError if ``table`` is not a valid schedule.

    Walks the ticks in order. An action reads its slots; at the end of the tick, a finished
    backward frees its slots first, then what was sent takes a slot on its receiver (so a slot
    freed and refilled on one tick is read before it is overwritten).
    """
    validate(table, p, m, v)
    n_chunks = v * p
    fields = {name: np.zeros((len(table), p), np.int32) for name in FIELDS}
    fields["recv_act"][:] = -1
    fields["recv_grad"][:] = -1
    acts, grads = _Slots(p), _Slots(p)
    started: set[tuple[int, Action]] = set()
    for t, row in enumerate(table):
        frees, arrivals = [], []
        for s, a in enumerate(row):
            if a is None or (s, a) in started:  # idle, or the second tick of a B
                continue
            started.add((s, a))
            position = position_of(a.chunk, n_chunks)
            key = (a.mb, a.chunk)
            fields["mb"][t, s], fields["local_chunk"][t, s] = a.mb, a.chunk // p
            if position != "first":
                fields["act_slot"][t, s] = acts.find(s, key)
            if a.kind != "F" and position != "last":
                fields["grad_slot"][t, s] = grads.find(s, key)
            # The first chunk's input is the tokens: its I has no gradient to compute.
            idle = a.kind == "I" and position == "first"
            fields["branch"][t, s] = IDLE if idle else branch_index(a.kind, position)
            if a.kind in ("B", "W"):
                frees.append((s, key, position))
            if a.kind == "F" and position != "last":
                arrivals.append((acts, "recv_act", a.mb, a.chunk + 1))
            if a.kind in ("B", "I") and position != "first":
                arrivals.append((grads, "recv_grad", a.mb, a.chunk - 1))
        for s, key, position in frees:
            if position != "first":
                acts.free(s, key)
            if position != "last":
                grads.free(s, key)
        for slots, name, mb, chunk in arrivals:
            receiver = stage_of(chunk, p)
            fields[name][t, receiver] = slots.take(receiver, (mb, chunk))
    return Program(fields, acts.peak, grads.peak)


@dataclass(frozen=True)
class Stages:
    """What a chunk computes, by its position in the model (``mb``: one microbatch's arrays).

    ``first(shared, layers, consts, mb) -> (x, aux)``: embed the tokens, run the chunk's layers;
    ``middle(shared, layers, consts, x, mb) -> (x, aux)``: run the chunk's layers;
    ``last(shared, layers, consts, x, mb) -> (loss, aux)``: the layers, then the head: summed
    token loss. ``shared`` are the parameters outside the layer stack; ``layers`` the chunk's
    slice of it; ``consts`` the chunk's slice of non-trained per-layer state (MoE router
    biases). ``aux`` (``{}`` for a dense model) holds the chunk's MoE statistics, summed over its
    layers except the ``layer_stacked`` keys, which keep one row per layer; ``aux_loss(aux)`` is
    the term it adds to the objective.
    """

    first: Callable
    middle: Callable
    last: Callable
    aux_loss: Callable = lambda aux: jnp.zeros((), jnp.float32)  # noqa: E731
    layer_stacked: tuple[str, ...] = ()


class _Carry(NamedTuple):
    stash: jax.Array  # [act_slots, *activation]: chunk inputs awaiting their backward
    grad_stash: jax.Array  # [grad_slots, *activation]: output gradients awaiting use
    layer_grads: Any  # like the local layers, [v, layers_per_chunk, ...], float32
    shared_grads: Any  # like the shared parameters, float32
    loss: jax.Array  # float32 scalar: summed token loss of the microbatches finished here
    aux: Any  # the chunks' aux sums (layer-stacked keys: [v, layers_per_chunk, ...])


def _store(buffer: jax.Array, slot: jax.Array, value: jax.Array) -> jax.Array:
    """``buffer[slot] = value`` in place, or no change when ``slot < 0``."""
    index = jnp.maximum(slot, 0)
    value = jnp.where(slot >= 0, value, buffer[index])
    return lax.dynamic_update_index_in_dim(buffer, value, index, 0)


def pipeline_loss_and_grads(program: Program, stages: Stages, *, p: int, v: int,
                            stash_spec: PartitionSpec, layer_grad_specs: Any,
                            shared_grad_specs: Any) -> Callable:
    """``(shared, layers, consts, micro, loss_scale, aux_scale) -> (loss_sum, shared_grads,
    layer_grads, aux)`` running ``program``.

    ``layers``: the stacked layer parameters ``[n_layers, ...]``, sharded over ``pipe`` on their
    first dimension, and ``consts`` the stacked non-trained state beside them; ``shared``: the
    other parameters (replicated over ``pipe``); ``micro``: ``[m, B/m, ...]`` arrays of the
    microbatches. The gradients are those of ``loss_scale * sum(token losses) + aux_scale *
    sum over chunks and microbatches of aux_loss``; ``loss_sum`` is the unscaled token-loss sum
    and ``aux`` the aux sums (layer-stacked keys over all layers, in stored order). Call under
    the mesh. ``stash_spec`` lays out the stashes ``[slot, batch, seq, embed]``; the grad specs
    lay out the gradient sums (as the parameters, without ``pipe``), on the automatic axes.
    """
    fields = {name: jnp.asarray(array) for name, array in program.fields.items()}
    forward_ring = [(s, (s + 1) % p) for s in range(p)]
    backward_ring = [(s, (s - 1) % p) for s in range(p)]

    def per_device(shared: Any, layers: Any, consts: Any, micro: Any, loss_scale: jax.Array,
                   aux_scale: jax.Array) -> tuple:
        stage = lax.axis_index(AXIS)

        def by_chunk(tree: Any) -> Any:
            return jax.tree.map(lambda a: a.reshape(v, a.shape[0] // v, *a.shape[1:]), tree)

        chunks, const_chunks = by_chunk(layers), by_chunk(consts)

        def chunk(j: jax.Array) -> Any:
            return jax.tree.map(lambda a: a[j], chunks)

        def const_chunk(j: jax.Array) -> Any:
            return jax.tree.map(lambda a: a[j], const_chunks)

        def microbatch(i: jax.Array) -> Any:
            return jax.tree.map(lambda a: a[i], micro)

        act, aux_shapes = jax.eval_shape(stages.first, shared, chunk(0), const_chunk(0),
                                         microbatch(0))
        no_act = jnp.zeros(act.shape, act.dtype)

        def run(position: str, shared: Any, layers: Any, consts: Any, x: jax.Array, mb: Any,
                ) -> tuple[jax.Array, Any]:
            if position == "first":
                return stages.first(shared, layers, consts, mb)
            if position == "middle":
                return stages.middle(shared, layers, consts, x, mb)
            return stages.last(shared, layers, consts, x, mb)

        def add_aux(total: Any, aux: Any, j: jax.Array) -> Any:
            return {k: total[k].at[j].add(a) if k in stages.layer_stacked else total[k] + a
                    for k, a in aux.items()}

        def idle(carry: _Carry, row: dict) -> tuple:
            return carry, no_act, no_act

        def forward(position: str) -> Callable:
            def branch(carry: _Carry, row: dict) -> tuple:
                j, x = row["local_chunk"], carry.stash[row["act_slot"]]
                y, aux = run(position, shared, chunk(j), const_chunk(j), x,
                             microbatch(row["mb"]))
                carry = carry._replace(aux=add_aux(carry.aux, aux, j))
                if position == "last":
                    return carry._replace(loss=carry.loss + y), no_act, no_act
                return carry, y, no_act
            return branch

        def backward(kind: str, position: str) -> Callable:
            send_dx = kind in ("B", "I") and position != "first"
            add_dw = kind in ("B", "W")

            def branch(carry: _Carry, row: dict) -> tuple:
                j, mb = row["local_chunk"], microbatch(row["mb"])
                x = carry.stash[row["act_slot"]]
                # The chunk's output gradient: the scaled loss's on the last chunk, else what the
                # next stage sent (already scaled); its aux losses enter here too.
                dy = (loss_scale if position == "last" else carry.grad_stash[row["grad_slot"]])
                consts = const_chunk(j)

                def objective_parts(sh: Any, ly: Any, x: jax.Array) -> tuple:
                    out, aux = run(position, sh, ly, consts, x, mb)
                    return out, stages.aux_loss(aux)

                _, vjp = jax.vjp(objective_parts, shared, chunk(j), x)
                # XLA drops the halves a branch does not use.
                d_shared, d_layers, dx = vjp((dy.astype(act.dtype) if position != "last"
                                              else dy, aux_scale))
                if add_dw:
                    layer_grads = jax.tree.map(lambda acc, g: acc.at[j].add(g),
                                               carry.layer_grads, d_layers)
                    carry = carry._replace(layer_grads=layer_grads)
                    if position != "middle":  # middle chunks use no shared parameter
                        carry = carry._replace(shared_grads=jax.tree.map(
                            jnp.add, carry.shared_grads, d_shared))
                return carry, no_act, dx if send_dx else no_act
            return branch

        branches = [idle] * BRANCHES
        for kind in "FBIW":
            for position in POSITIONS:
                branches[branch_index(kind, position)] = (
                    forward(position) if kind == "F" else backward(kind, position))

        def tick(carry: _Carry, row: dict) -> tuple[_Carry, None]:
            row = {name: value[stage] for name, value in row.items()}
            carry, send_fwd, send_bwd = lax.switch(row["branch"], branches, carry, row)
            arrived = lax.ppermute(send_fwd, AXIS, forward_ring)
            arrived_grad = lax.ppermute(send_bwd, AXIS, backward_ring)
            return carry._replace(stash=_store(carry.stash, row["recv_act"], arrived),
                                  grad_stash=_store(carry.grad_stash, row["recv_grad"],
                                                    arrived_grad)), None

        def zeros(tree: Any, specs: Any) -> Any:
            return jax.lax.with_sharding_constraint(
                jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), tree), specs)

        def stash(slots: int) -> jax.Array:
            return jax.lax.with_sharding_constraint(
                jnp.zeros((slots, *act.shape), act.dtype), stash_spec)

        aux0 = {k: jnp.zeros((v, *a.shape) if k in stages.layer_stacked else a.shape, a.dtype)
                for k, a in aux_shapes.items()}
        carry = _Carry(stash(program.act_slots), stash(program.grad_slots),
                       zeros(chunks, layer_grad_specs), zeros(shared, shared_grad_specs),
                       jnp.zeros((), jnp.float32), aux0)
        carry, _ = lax.scan(tick, carry, fields)

        def stacked(a: jax.Array) -> jax.Array:
            return a.reshape(-1, *a.shape[2:])

        layer_grads = jax.tree.map(stacked, carry.layer_grads)
        # Only the first and last chunks touch the shared parameters and only the last has a
        # loss; summing over pipe hands every stage the totals. Per-layer statistics stay with
        # their stage, like the layers.
        aux_sums = {k: lax.psum(a, AXIS) for k, a in carry.aux.items()
                    if k not in stages.layer_stacked}
        aux_layers = {k: stacked(a) for k, a in carry.aux.items() if k in stages.layer_stacked}
        return (lax.psum(carry.loss, AXIS), lax.psum(carry.shared_grads, AXIS), layer_grads,
                aux_sums, aux_layers)

    def run_pipeline(shared: Any, layers: Any, consts: Any, micro: Any, loss_scale: jax.Array,
                     aux_scale: jax.Array) -> tuple:
        def split(tree: Any) -> Any:
            return jax.tree.map(lambda _: PartitionSpec(AXIS), tree)

        layer_spec = split(layers)
        stacked_keys = {k: PartitionSpec(AXIS) for k in stages.layer_stacked}
        loss, shared_grads, layer_grads, aux_sums, aux_layers = jax.shard_map(
            per_device,
            in_specs=(PartitionSpec(), layer_spec, split(consts), PartitionSpec(),
                      PartitionSpec(), PartitionSpec()),
            out_specs=(PartitionSpec(), PartitionSpec(), layer_spec, PartitionSpec(),
                       stacked_keys),
            axis_names=frozenset({AXIS}), check_vma=False,
        )(shared, layers, consts, micro, loss_scale, aux_scale)
        return loss, shared_grads, layer_grads, {**aux_sums, **aux_layers}

    return run_pipeline
