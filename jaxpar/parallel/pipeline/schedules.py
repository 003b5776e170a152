"""Pipeline schedules: which stage does what, step by step, as pure Python data.

What a pipeline splits. The layer stack is cut into ``p`` consecutive *stages*, one per device
along the ``pipe`` mesh axis; each device stores and updates only its stage's layers. Interleaved
schedules cut finer, into ``v * p`` *chunks* (virtual stages): device ``s`` holds chunks ``s,
s+p, s+2p, ...``, so a microbatch laps the ring of devices ``v`` times. The global batch of one
micro-step is split into ``m`` microbatches; a schedule says in which order each stage runs the
forward ``F`` and backward ``B`` (or its halves ``I``, input gradient, and ``W``, weight
gradient) of each (microbatch, chunk).

One program on every stage. The executor (:mod:`jaxpar.parallel.pipeline.executor`) is SPMD: at
every *step* every device runs the same operations, and the schedule only chooses the data (which
microbatch, which chunk, which stash slot) and masks the slots a stage has no work for. A step has
up to three *slots*, run in this order: a forward slot ``F``, then a backward slot ``B`` (or ``I``),
then a weight-gradient slot ``W``. Which slots a step has varies over time but never over stages:
warm-up steps of 1F1B run only ``F``, steady steps ``F`` and ``B``, cool-down steps only ``B``. (A
collective inside a conditional that only some devices take deadlocks; here no collective is ever
conditional.)

Timing (:func:`as_soon_as_possible`). Each stage runs its *order* of actions (all a schedule is)
as early as possible: at each step a stage takes its next actions in order, at most one per slot
kind, while what they need is ready. A result made on another stage is ready the step after (it
travels at the end of the step); on the same stage it is ready to a later slot of the same step
(the last stage turns a microbatch around within one step: ``F``, loss, ``B``).

Cost model. A slot costs what its kind costs whether or not the stage has work in it: ``F`` one
*tick* (the forward of one chunk), ``B`` two (each forward matmul has two in the backward), ``I``
and ``W`` one each. Laid out in ticks, a step is its slots side by side, and every stage's row
has the same length: this is the *table* that ``jaxpar schedule`` prints and draws, and it is
what the compiled program executes, masked slots included. So:

    bubble                 = masked ticks / all ticks (the executed idle share)
    executed-work factor   = all ticks / useful ticks = 1 / (1 - bubble)

    schedule      steps (kinds)                         bubble             inputs stashed
    gpipe         m+p-1 x F, then m+p-1 x B              (p-1)/(m+p-1)     m
    1f1b          p-1 x F, m x (F+B), p-1 x B            (p-1)/(m+p-1)     2p-1 (first stage)
    interleaved   1F1B over v*p chunks                   see the tests     ~2vp
    zero_bubble   1F1B with B split into I and W         see the tests     ~2p

For 1F1B that is (p-1)F + m(F+B) + (p-1)B, the ideal; the first stage keeps each microbatch from
its forward at step j to its backward at step j+2(p-1), so it holds 2p-1 of them (GPipe: m).
Besides the chunks, every ``F`` step embeds one microbatch and runs the output head and loss on
one (shared by all stages, see the executor), and every ``B``/``I`` step back-propagates into the
embedding once; these are not counted in ticks.

A table is a list of ticks, each a tuple with one entry per stage: an :class:`Action` or
``None`` (a masked slot). A ``B`` appears in both of its ticks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Literal

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


SLOT_ORDER = ("F", "B", "I", "W")  # the order a step runs its slots in (B and I share a place)


@dataclass(frozen=True)
class Step:
    """One step of the executor: the slot kinds every stage runs (in :data:`SLOT_ORDER`), and
    per stage the action in each slot (a missing kind: that stage's slot is masked)."""

    kinds: tuple[str, ...]
    actions: tuple[dict[str, Action], ...]

    @property
    def ticks(self) -> int:
        return sum(TICKS[k] for k in self.kinds)


def _ready_for(a: Action, s: int, step: int, ready: dict, made_here: dict, n_chunks: int,
               ) -> bool:
    """Whether everything ``a`` needs exists when stage ``s`` reaches it at ``step``: made on
    an earlier step, or earlier in this step by this stage in a slot that runs first."""
    for _, key in _needs(a, n_chunks):
        if key in ready and ready[key] < step:
            continue
        slot = made_here.get((s, key))
        if slot is None or SLOT_ORDER.index(slot) >= SLOT_ORDER.index(a.kind):
            return False
    return True


def time_steps(orders: Sequence[Sequence[Action]], v: int = 1) -> list[Step]:
    """Time per-stage orders as executor steps: at each step every stage takes its next actions
    in order, at most one per slot kind, while what they need is ready (module docstring).

    ``orders[s]`` is stage ``s``'s list; ``v`` is the number of chunks per stage. Raises
    ValueError if the orders deadlock (some stage waits for a result that never comes).
    """
    p = len(orders)
    n_chunks = v * p
    ready: dict[tuple[str, int, int], int] = {}  # result -> step it was made in
    seen: set[tuple[int, Action]] = set()
    next_index = [0] * p
    steps: list[Step] = []
    while any(next_index[s] < len(orders[s]) for s in range(p)):
        t = len(steps)
        taken: list[dict[str, Action]] = [{} for _ in range(p)]
        made_here: dict = {}
        for s in range(p):
            while next_index[s] < len(orders[s]):
                a = orders[s][next_index[s]]
                if (s, a) in seen:
                    raise ValueError(f"stage {s} lists {a} twice")
                slot = "B" if a.kind == "I" else a.kind  # I takes B's place
                if slot in taken[s] or not _ready_for(a, s, t, ready, made_here, n_chunks):
                    break
                taken[s][slot] = a
                seen.add((s, a))
                for key in _provides(a):
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
        steps.append(Step(kinds, tuple({a.kind: a for a in row.values()} for row in taken)))
    return steps


def table_of(steps: Sequence[Step]) -> Table:
    """The steps laid out in ticks: each slot as many ticks as its kind costs, ``None`` where a
    stage's slot is masked. Every stage runs every tick, so this is the executed timeline."""
    p = len(steps[0].actions) if steps else 0
    table: Table = []
    for step in steps:
        for kind in step.kinds:
            row = tuple(step.actions[s].get(kind) for s in range(p))
            table.extend([row] * TICKS[kind])
    return table


def as_soon_as_possible(orders: Sequence[Sequence[Action]], v: int = 1) -> Table:
    """The table of per-stage orders timed by :func:`time_steps`."""
    return table_of(time_steps(orders, v))


def _check_sizes(p: int, m: int, v: int = 1) -> None:
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"pipeline schedule needs p, m, v >= 1; got p={p} m={m} v={v}")


# --------------------------------------------------------------------------------------------
# The schedules


def gpipe(p: int, m: int) -> Table:
    """GPipe: every stage runs all ``m`` forwards, then all ``m`` backwards.

    Stage ``s`` runs F(j) at step ``s + j``: ``m + p - 1`` steps with a forward slot, and as
    many with a backward slot (the last stage turns around while the others still run
    forwards, so one step has both). The table is ``3(m+p-1)`` ticks, each stage busy ``3m``:
    bubble = (p-1)/(m+p-1). Every stage holds all ``m`` microbatches at the turn.
    """
    _check_sizes(p, m)
    return as_soon_as_possible(_gpipe_orders(p, m))


def _gpipe_orders(p: int, m: int) -> list[list[Action]]:
    return [[Action("F", j, s) for j in range(m)] + [Action("B", j, s) for j in range(m)]
            for s in range(p)]


def _one_f_one_b_orders(p: int, m: int, split_backward: bool) -> list[list[Action]]:
    """Per-stage orders of 1F1B and ZB-H1, written as one loop over x = 0 .. m+2(p-1)-1.

    At x stage s runs F(x), then the backward of microbatch x-2(p-1-s): the last stage turns
    each microbatch around at once; stage s runs 2(p-1-s) forwards ahead (warm-up), the time
    its first microbatch takes to reach the last stage and its gradient to come back, one step
    per stage each way; the x past m are the cool-down. With ``split_backward`` that backward
    is I, and W follows it at once: in an executor whose steps are the same on every stage, a
    W put off to later still costs a W slot on every stage then, so delaying it (as ZB-H1 does
    on hardware where an idle stage costs nothing) gains no time here.
    """
    orders = []
    for s in range(p):
        order = []
        for x in range(m + 2 * (p - 1)):
            if x < m:
                order.append(Action("F", x, s))
            if 0 <= (back := x - 2 * (p - 1 - s)) < m:
                order += ([Action("I", back, s), Action("W", back, s)] if split_backward
                          else [Action("B", back, s)])
        orders.append(order)
    return orders


def one_f_one_b(p: int, m: int) -> Table:
    """1F1B (PipeDream-flush, Megatron's default): warm up with ``p-1-s`` forwards on stage
    ``s``, then alternate one forward and one backward, then cool down with the last backwards.

    Steps: ``p-1`` with a forward slot only, ``m`` with a forward and a backward slot, ``p-1``
    with a backward slot only: (p-1)F + m(F+B) + (p-1)B = ``3(m+p-1)`` ticks, GPipe's, so the
    bubble is too: (p-1)/(m+p-1). But a microbatch's stash is freed as soon as its backward
    runs: stage ``s`` holds at most ``2(p-1-s) + 1`` of them (GPipe: ``m``).
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
    the fill/drain costs ``3(p-1)`` of them: bubble = (p-1)/(v m + p-1). Stage ``s`` holds
    ``min(2(p-1-s) + (v-1)p + 1, v m)`` chunks' stashes (1F1B: ``2(p-1-s) + 1`` stages').
    """
    return as_soon_as_possible(_interleaved_orders(p, m, v), v)


def _interleaved_orders(p: int, m: int, v: int) -> list[list[Action]]:
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
    return orders


def zero_bubble(p: int, m: int) -> Table:
    """ZB-H1's split (Qi et al., "Zero Bubble Pipeline Parallelism", 2024): 1F1B with each
    backward split into ``I`` (input gradient, which the previous stage waits for) and ``W``
    (weight gradient), both computed from the same stashed residuals.

    On hardware where an idle stage costs nothing, delaying W's into 1F1B's cool-down shrinks
    the bubble to (p-1)/(3m+p-1). In this executor every stage runs every slot of a step, so a
    delayed W costs a W slot on every stage wherever it goes: the timing (and the bubble) equal
    1F1B's, (p-1)/(m+p-1). The split is kept because it is the schedule's definition and
    the I/W pieces are what a hardware-specific executor would place; see the module docstring.
    """
    _check_sizes(p, m)
    return as_soon_as_possible(_one_f_one_b_orders(p, m, split_backward=True))


SCHEDULES: dict[str, Callable[..., Table]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved": interleaved,
    "zero_bubble": zero_bubble,
}


def schedule_orders(name: str, p: int, m: int, v: int = 1) -> list[list[Action]]:
    """Each stage's order of actions for ``parallel.pipeline_schedule=name`` (``v``:
    ``parallel.virtual_stages``)."""
    if name not in SCHEDULES:
        raise ValueError(f"pipeline schedule {name!r} is not one of {', '.join(SCHEDULES)}")
    if name == "interleaved":
        return _interleaved_orders(p, m, v)
    if v != 1:
        raise ValueError(f"pipeline schedule {name!r} runs one chunk per stage; v={v} needs "
                         "'interleaved'")
    _check_sizes(p, m)
    if name == "gpipe":
        return _gpipe_orders(p, m)
    return _one_f_one_b_orders(p, m, split_backward=name == "zero_bubble")


def schedule_steps(name: str, p: int, m: int, v: int = 1) -> list[Step]:
    """The executor's steps for ``parallel.pipeline_schedule=name``."""
    return time_steps(schedule_orders(name, p, m, v), v)


def schedule_table(name: str, p: int, m: int, v: int = 1) -> Table:
    """The executed timeline (ticks x stages) for ``parallel.pipeline_schedule=name``."""
    return table_of(schedule_steps(name, p, m, v))


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
