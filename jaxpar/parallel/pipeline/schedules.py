"""Pipeline schedules: which stage does what, round by round, as pure Python data.

A schedule is each stage's *order* of forward ``F`` and backward ``B`` actions (or ``B``'s
halves ``I`` and ``W``) on (microbatch, chunk) pairs. :func:`as_soon_as_possible` times the
orders into executor rounds; their ticks form the *table* ``jaxpar schedule`` prints (an
:class:`Action` or ``None``, masked, per stage and tick). Terms, timing rules, bubbles:
docs/pipelines.md, "The schedule table".
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

Kind = Literal["F", "B", "I", "W"]

# Ticks each kind of action occupies (see "Cost model" above).
TICKS: dict[str, int] = {"F": 1, "B": 2, "I": 1, "W": 1}


@dataclass(frozen=True)
class Action:
    """Forward ``F``, full backward ``B``, or its halves ``I`` (input gradient) and ``W`` (weight
    gradient), of microbatch ``mb`` through chunk ``chunk``."""

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


Placement = Literal["ring", "v"]


def stage_of(chunk: int, p: int, placement: Placement = "ring") -> int:
    """The ``pipe`` device holding ``chunk``: round the ring (s, s+p, ...), or down and back up
    the V for ``dualpipe_v`` (device ``d`` holds ``d`` and ``2p-1-d``). Either way it is its
    device's ``chunk // p``-th chunk."""
    if placement == "v":
        return chunk if chunk < p else 2 * p - 1 - chunk
    return chunk % p


# Schedules whose chunks are not placed round the ring.
PLACEMENTS: dict[str, Placement] = {"dualpipe_v": "v"}


def placement_of(name: str) -> Placement:
    """How schedule ``name`` places its chunks on the devices."""
    return PLACEMENTS.get(name, "ring")


# --------------------------------------------------------------------------------------------
# Dependencies: what an action needs before it can start.
#
# Results are named by keys (role, mb, chunk). "out" is a chunk's forward output, "dx" the
# gradient w.r.t. a chunk's input (made by B or by I), "I" the input-gradient half alone (W
# reuses what I computed).


def provides(a: Action) -> list[tuple[str, int, int]]:
    roles = {"F": ["out"], "B": ["dx"], "I": ["dx", "I"], "W": []}[a.kind]
    return [(role, a.mb, a.chunk) for role in roles]


def needs(a: Action, n_chunks: int) -> list[tuple[str, tuple[str, int, int]]]:
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


SLOT_ORDER = ("F", "B", "I", "W")  # the order a round runs its slots in (B and I share a place)


@dataclass(frozen=True)
class Round:
    """One executor round: the slot kinds every stage runs (in :data:`SLOT_ORDER`), and each
    stage's action per slot (missing: masked)."""

    kinds: tuple[str, ...]
    actions: tuple[dict[str, Action], ...]

    @property
    def ticks(self) -> int:
        return sum(TICKS[k] for k in self.kinds)


def _ready_for(a: Action, s: int, t: int, ready: dict, made_here: dict, n_chunks: int,
               overlap: bool = False) -> bool:
    """Whether all ``a`` needs exists when stage ``s`` reaches it in round ``t``: made earlier, or
    earlier this round by this stage in a prior slot (with ``overlap``, not by this round's
    forward)."""
    for _, key in needs(a, n_chunks):
        if key in ready and ready[key] < t:
            continue
        if overlap and a.kind in ("B", "I") and key[0] == "out":
            return False
        slot = made_here.get((s, key))
        if slot is None or SLOT_ORDER.index(slot) >= SLOT_ORDER.index(a.kind):
            return False
    return True


def time_rounds(orders: Sequence[Sequence[Action]], v: int = 1, overlap: bool = False,
                ) -> list[Round]:
    """Time per-stage orders as executor rounds (:func:`as_soon_as_possible`'s rule).

    ``orders[s]``: stage ``s``'s list; ``v``: chunks per stage. With ``overlap``
    (``parallel.pipeline_overlap``) forward and backward share one layer loop, so the last chunk's
    backward comes the round after its forward. ValueError if the orders deadlock.
    """
    p = len(orders)
    n_chunks = v * p
    ready: dict[tuple[str, int, int], int] = {}  # result -> round it was made in
    seen: set[tuple[int, Action]] = set()
    next_index = [0] * p
    rounds: list[Round] = []
    while any(next_index[s] < len(orders[s]) for s in range(p)):
        t = len(rounds)
        taken: list[dict[str, Action]] = [{} for _ in range(p)]
        made_here: dict = {}
        for s in range(p):
            while next_index[s] < len(orders[s]):
                a = orders[s][next_index[s]]
                if (s, a) in seen:
                    raise ValueError(f"stage {s} lists {a} twice")
                slot = "B" if a.kind == "I" else a.kind  # I takes B's place
                if slot in taken[s] or not _ready_for(a, s, t, ready, made_here, n_chunks,
                                                      overlap):
                    break
                taken[s][slot] = a
                seen.add((s, a))
                for key in provides(a):
                    made_here[(s, key)] = a.kind
                next_index[s] += 1
        if not any(taken):
            stuck = [f"stage {s} at {orders[s][i]}" for s, i in enumerate(next_index)
                     if i < len(orders[s])]
            raise ValueError(f"the stage orders deadlock: {', '.join(stuck)} wait forever")
        for (_, key), _kind in made_here.items():
            ready[key] = t
        kinds = tuple(k for k in SLOT_ORDER
                      if any(k == a.kind for row in taken for a in row.values()))
        rounds.append(Round(kinds, tuple({a.kind: a for a in row.values()} for row in taken)))
    return rounds


def table_of(rounds: Sequence[Round]) -> Table:
    """The rounds laid out in ticks (each slot as many as its kind costs, ``None`` where masked):
    the executed timeline."""
    p = len(rounds[0].actions) if rounds else 0
    table: Table = []
    for rnd in rounds:
        for kind in rnd.kinds:
            row = tuple(rnd.actions[s].get(kind) for s in range(p))
            table.extend([row] * TICKS[kind])
    return table


def as_soon_as_possible(orders: Sequence[Sequence[Action]], v: int = 1) -> Table:
    """The table of per-stage orders timed by :func:`time_rounds`."""
    return table_of(time_rounds(orders, v))


def _check_sizes(p: int, m: int, v: int = 1) -> None:
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"pipeline schedule needs p, m, v >= 1; got p={p} m={m} v={v}")


# --------------------------------------------------------------------------------------------
# The schedules


def gpipe(p: int, m: int) -> Table:
    """GPipe: all ``m`` forwards, then all ``m`` backwards. Bubble (p-1)/(m+p-1); every stage
    holds all ``m`` microbatches at the turn."""
    _check_sizes(p, m)
    return as_soon_as_possible(_gpipe_orders(p, m))


def _gpipe_orders(p: int, m: int) -> list[list[Action]]:
    return [[Action("F", j, s) for j in range(m)] + [Action("B", j, s) for j in range(m)]
            for s in range(p)]


def _one_f_one_b_orders(p: int, m: int, split_backward: bool = False, lag: int = 0,
                        ) -> list[list[Action]]:
    """1F1B's per-stage orders, one loop over x = 0 .. m+2(p-1)-1.

    At x stage s runs F(x), then the backward of microbatch x-2(p-1-s): 2(p-1-s) forwards ahead
    (warm-up); x past m is the cool-down. ``split_backward``: that backward is its I alone.
    ``lag`` more rounds in the round trip mean ``lag`` more forwards ahead.
    """
    orders = []
    for s in range(p):
        order = []
        for x in range(m + 2 * (p - 1) + lag):
            if x < m:
                order.append(Action("F", x, s))
            if 0 <= (back := x - 2 * (p - 1 - s) - lag) < m:
                order.append(Action("I" if split_backward else "B", back, s))
        orders.append(order)
    return orders


def one_f_one_b(p: int, m: int) -> Table:
    """1F1B (PipeDream-flush, Megatron's default): ``p-1-s`` warm-up forwards on stage ``s``,
    then alternate forward and backward, then cool down. GPipe's bubble, but stage ``s`` holds at
    most ``2(p-1-s) + 1`` microbatches (GPipe: ``m``)."""
    _check_sizes(p, m)
    return as_soon_as_possible(_one_f_one_b_orders(p, m, split_backward=False))


def interleaved(p: int, m: int, v: int) -> Table:
    """Megatron's interleaved 1F1B: stage ``s`` holds chunks ``s, s+p, ..., s+(v-1)p``; ``p``
    must divide ``m``. Groups of ``p`` microbatches pass a stage's chunks in turn. Bubble
    (p-1)/(v m + p-1): docs/pipelines.md, "How a schedule becomes a table"."""
    return as_soon_as_possible(_interleaved_orders(p, m, v), v)


def _interleaved_orders(p: int, m: int, v: int, split_backward: bool = False, lag: int = 0,
                        ) -> list[list[Action]]:
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
        warmup = min(2 * (p - 1 - s) + (v - 1) * p + lag, total)
        back = "I" if split_backward else "B"
        order = [nth(s, k, "F") for k in range(warmup)]
        for k in range(total - warmup):
            order += [nth(s, warmup + k, "F"), nth(s, k, back)]
        order += [nth(s, k, back) for k in range(total - warmup, total)]
        orders.append(order)
    return orders


def zero_bubble(p: int, m: int, v: int = 1) -> Table:
    """Zero bubble in lockstep (after Qi et al., 2024): 1F1B (``v = 1``) or interleaved
    (``v > 1``), every backward split into ``I`` and ``W``, the W's deferred.

    Middle rounds run F + I (2 ticks), not F + B (3); each W fills an otherwise idle round. Why
    that is optimal for uniform rounds, and memory: docs/pipelines.md, "Zero bubble: I and W apart,
    nothing recomputed".
    """
    orders = (_one_f_one_b_orders(p, m, split_backward=True) if v == 1
              else _interleaved_orders(p, m, v, split_backward=True))
    return table_of(defer_weight_grads(time_rounds(orders, v)))


def defer_weight_grads(rounds: Sequence[Round]) -> list[Round]:
    """``rounds`` (backwards I's alone) with each stage's k-th W in the round where the last stage
    to reach its k-th I runs it, so every W slot is busy. ValueError if stages run different
    numbers of I's."""
    rounds = list(rounds)
    p = len(rounds[0].actions) if rounds else 0
    inputs = [[(t, rnd.actions[s]["I"]) for t, rnd in enumerate(rounds)
               if "I" in rnd.actions[s]] for s in range(p)]
    if len({len(runs) for runs in inputs}) > 1:
        raise ValueError("stages run different numbers of I actions: "
                         + ", ".join(f"stage {s}: {len(r)}" for s, r in enumerate(inputs)))
    actions = [[dict(a) for a in rnd.actions] for rnd in rounds]
    for k in range(len(inputs[0]) if inputs else 0):
        at = max(runs[k][0] for runs in inputs)
        for s, runs in enumerate(inputs):
            i = runs[k][1]
            actions[at][s]["W"] = Action("W", i.mb, i.chunk)
    return [Round(tuple(kind for kind in SLOT_ORDER
                       if any(kind in row for row in rows)), tuple(rows))
            for rows in actions]


def dualpipe_v(p: int, m: int) -> Table:
    """DualPipe-V (DeepSeek-V3) in lockstep: the V placement (two chunks a device, loss on the
    first), deferred W's, steady rounds running one microbatch's forward beside another's I.

    The order is searched: each round a stage runs the earliest ready I (deeper chunk first) and
    the earliest ready forward while under ``cap`` chunks in flight; the least ``cap`` reaching
    the fewest ticks wins. Bubble, memory, why: docs/pipelines.md, "DualPipe-V in one program".
    """
    return table_of(_dualpipe_v_rounds(p, m))


@functools.cache
def _dualpipe_v_rounds(p: int, m: int, lag: int = 0) -> list[Round]:
    _check_sizes(p, m)
    best: tuple[int, list[Round]] | None = None
    for cap in range(2, 4 * p + 3):
        greedy = _v_greedy(p, m, cap, lag)
        if greedy is None:
            continue
        rounds = defer_weight_grads(greedy)
        ticks = sum(rnd.ticks for rnd in rounds)
        if best is None or ticks < best[0]:
            best = (ticks, rounds)
    assert best is not None  # a cap of 4p + 2 never stalls
    return best[1]


def _v_greedy(p: int, m: int, cap: int, lag: int = 0) -> list[Round] | None:
    """DualPipe-V's forwards and I's per round; None if stages stall (``cap`` too small). The
    loss's I comes ``lag`` rounds after its forward."""
    last = 2 * p - 1
    ready: list[dict[Action, int]] = [{} for _ in range(p)]  # stage -> action -> first round
    held, entered, left = [0] * p, 0, 2 * p * m
    rounds: list[Round] = []
    while left:
        t = len(rounds)
        rows: list[dict[str, Action]] = [{} for _ in range(p)]
        for s in range(p):
            forwards = [a for a, at in ready[s].items() if a.kind == "F" and at <= t]
            if s == 0 and entered < m:
                forwards.append(Action("F", entered, 0))
            if forwards and held[s] < cap:
                f = rows[s]["F"] = min(forwards, key=lambda a: (a.mb, a.chunk))
                held[s] += 1
                ready[s].pop(f, None)
                entered += f.chunk == 0
                if f.chunk == last:  # the loss, then its I in this very round (or lag later)
                    ready[s][Action("I", f.mb, f.chunk)] = t + lag
                else:
                    ready[stage_of(f.chunk + 1, p, "v")][Action("F", f.mb, f.chunk + 1)] = t + 1
            inputs = [a for a, at in ready[s].items() if a.kind == "I" and at <= t]
            if inputs:
                i = rows[s]["I"] = min(inputs, key=lambda a: (a.mb, -a.chunk))
                held[s] -= 1
                left -= 1
                del ready[s][i]
                if i.chunk > 0:
                    ready[stage_of(i.chunk - 1, p, "v")][Action("I", i.mb, i.chunk - 1)] = t + 1
        if not any(rows):
            return None
        rounds.append(Round(tuple(k for k in SLOT_ORDER if any(k in row for row in rows)),
                          tuple(rows)))
    return rounds


SCHEDULES: dict[str, Callable[..., Table]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved": interleaved,
    "zero_bubble": zero_bubble,
    "dualpipe_v": dualpipe_v,
}


def schedule_orders(name: str, p: int, m: int, v: int = 1, overlap: bool = False,
                    ) -> list[list[Action]]:
    """Each stage's order for schedule ``name`` (``v``: virtual stages; ``overlap``:
    ``parallel.pipeline_overlap``). Zero bubble's are I's; its W's are placed after timing."""
    if name not in SCHEDULES:
        raise ValueError(f"pipeline schedule {name!r} is not one of {', '.join(SCHEDULES)}")
    lag = 1 if overlap else 0
    if name == "dualpipe_v":  # its order is found round by round: read it off the rounds
        if v != 2:
            raise ValueError(f"pipeline schedule 'dualpipe_v' runs two chunks per stage; v={v}")
        rounds = _dualpipe_v_rounds(p, m, lag)
        return [[a for rnd in rounds for kind, a in rnd.actions[s].items() if kind != "W"]
                for s in range(p)]
    if name == "interleaved" or (name == "zero_bubble" and v > 1):
        return _interleaved_orders(p, m, v, split_backward=name == "zero_bubble", lag=lag)
    if v != 1:
        raise ValueError(f"pipeline schedule {name!r} runs one chunk per stage; v={v} needs "
                         "'interleaved' or 'zero_bubble'")
    _check_sizes(p, m)
    if name == "gpipe":
        return _gpipe_orders(p, m)
    return _one_f_one_b_orders(p, m, split_backward=name == "zero_bubble", lag=lag)


def schedule_rounds(name: str, p: int, m: int, v: int = 1, overlap: bool = False) -> list[Round]:
    """The executor's rounds for schedule ``name``."""
    if name == "dualpipe_v":
        schedule_orders(name, p, m, v)  # checks v
        return list(_dualpipe_v_rounds(p, m, 1 if overlap else 0))
    rounds = time_rounds(schedule_orders(name, p, m, v, overlap), v, overlap)
    return defer_weight_grads(rounds) if name == "zero_bubble" else rounds


def schedule_table(name: str, p: int, m: int, v: int = 1, overlap: bool = False) -> Table:
    """The executed timeline (ticks x stages) for schedule ``name``."""
    return table_of(schedule_rounds(name, p, m, v, overlap))


def stage_layer_order(n_layers: int, p: int, v: int, placement: Placement = "ring",
                      ) -> list[int]:
    """Model layer of each stored layer, so device ``s``'s contiguous stored layers are its
    chunks in order. Identity for ``v = 1``; for ``v > 1`` no parameter crosses ``pipe``."""
    per_chunk = n_layers // (p * v)
    chunks = {stage_of(c, p, placement) * v + c // p: c for c in range(p * v)}
    return [chunks[i] * per_chunk + k for i in range(p * v) for k in range(per_chunk)]
