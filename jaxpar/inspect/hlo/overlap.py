"""Which collectives did the compiler's schedule hide behind matmuls, and which are exposed?

A collective execution is **hidden** when a matmul is scheduled strictly between its start and done,
in the same computation; all else is **exposed**. A property of the schedule, not a measurement. The
rules: docs/inspect.md, "Hidden and exposed communication".
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from jaxpar.inspect.hlo.collectives import KINDS, Collective
from jaxpar.inspect.hlo.flops import instruction_flops
from jaxpar.inspect.hlo.text import (
    Computation,
    Instr,
    Module,
    attr,
    computation_runs,
    parse_module,
)

ASYNC_START_TARGET = "AsyncCollectiveStart"
ASYNC_DONE_TARGET = "AsyncCollectiveDone"
# String attributes the parser blanks out (text.Instr.attrs), read from the raw lines instead.
_QUOTED_RE = re.compile(
    r'^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-#]+)\s*=.*?'
    r'(?:custom_call_target="(?P<target>[^"]*)"|_xla_host_transfer_rendezvous="(?P<rdv>[^"]*)")')
# What a done reads its start through.
_TO_START = frozenset({"get-tuple-element", "async-update", "bitcast", "copy"})


@dataclass(frozen=True)
class Window:
    """The schedule between one asynchronous collective's start and its done."""

    computation: str  # where start and done are
    start: str  # the instruction that starts it
    done: str | None  # the one that waits for it; None: not in the computation (window to its end)
    matmuls: tuple[str, ...]  # the instructions strictly between that are, or call, matmuls
    flops: float  # their matmul flops, one execution of the collective (loops: x trip counts)

    @property
    def hidden(self) -> bool:
        return bool(self.matmuls)


@dataclass(frozen=True)
class Schedule:
    """A module's async collectives and the matmuls in their windows."""

    windows: dict[str, Window]  # by the collective's instruction name (collective_windows)
    # (computation, instruction) -> matmul flops per step (per execution x the computation's
    # runs), for the matmuls in any window.
    step_flops: dict[tuple[str, str], float]


@dataclass(frozen=True)
class _Start:
    names: tuple[str, ...]  # the collective instructions (as parse_collectives names them)
    is_done: Callable[[Instr], bool]
    channel: tuple[str, str | None] | None = None  # TPU async fusions: (kind, channel_id) carried


def collective_windows(hlo_text: str) -> dict[str, Window]:
    """Each asynchronous collective's window, by its instruction name.

    A collective not in the result is synchronous.
    """
    return read_schedule(hlo_text).windows


def read_schedule(hlo_text: str) -> Schedule:
    """The windows of every computation, with the per-step flops of their matmuls."""
    module = parse_module(hlo_text)
    quoted = _quoted_attributes(hlo_text)
    runs = computation_runs(module)
    memo: dict[str, float] = {}
    windows: dict[str, Window] = {}
    step_flops: dict[tuple[str, str], float] = {}
    for comp in module.computations.values():
        found, flops = _computation_windows(module, comp, quoted, memo)
        windows.update(found)
        step_flops.update({(comp.name, name): f * runs[comp.name] for name, f in flops.items()})
    return Schedule(windows, step_flops)


def _quoted_attributes(hlo_text: str) -> dict[str, str]:
    """Instruction name -> its ``custom_call_target`` or ``_xla_host_transfer_rendezvous``."""
    found = {}
    for line in hlo_text.splitlines():
        if ('custom_call_target="Async' in line or "_xla_host_transfer_rendezvous" in line) \
                and (m := _QUOTED_RE.match(line)):
            found[m.group("name")] = m.group("target") or m.group("rdv") or ""
    return found


def _computation_windows(module: Module, comp: Computation, quoted: dict[str, str],
                         memo: dict[str, float]) -> tuple[dict[str, Window], dict[str, float]]:
    """The windows of the collectives started in ``comp``, and its matmuls' flops."""
    order = list(comp.instrs.values())  # the schedule
    starts = [(k, s) for k, instr in enumerate(order)
              if (s := _start(module, comp, instr, quoted)) is not None]
    if not starts:
        return {}, {}
    flops = [instruction_flops(module, comp, instr, memo) for instr in order]
    flops_before = [0.0]  # prefix sums over the schedule
    for f in flops:
        flops_before.append(flops_before[-1] + f)
    windows = {}
    for k, start in starts:
        done = next((j for j in range(k + 1, len(order)) if start.is_done(order[j])), None)
        end = len(order) if done is None else done
        window = Window(computation=comp.name, start=order[k].name,
                        done=None if done is None else order[done].name,
                        matmuls=tuple(order[j].name for j in range(k + 1, end) if flops[j] > 0),
                        flops=flops_before[end] - flops_before[k + 1])
        names = list(start.names)
        if start.channel is not None:  # the collective also sits in the fusions it rides along
            for member in order[k:end + 1]:
                names += [n for n, kind, channel in _fused_collectives(module, member)
                          if (kind, channel) == start.channel]
        windows.update(dict.fromkeys(names, window))
    return windows, {instr.name: f for instr, f in zip(order, flops, strict=True) if f > 0}


def _start(module: Module, comp: Computation, instr: Instr,
           quoted: dict[str, str]) -> _Start | None:
    """What ``instr`` starts (and how to know its done), if it starts a collective."""
    base = instr.opcode.removesuffix("-start")
    if instr.opcode.endswith("-start") and base in KINDS:
        return _Start((instr.name,), lambda i: i.opcode == f"{base}-done"
                      and _reaches(comp, i, instr.name))
    if instr.opcode == "async-start":
        wrapped = _callee(module, instr)
        names = tuple(i.name for i in wrapped.instrs.values()
                      if i.opcode.removesuffix("-start") in KINDS) if wrapped else ()
        return _Start(names, lambda i: i.opcode == "async-done"
                      and _reaches(comp, i, instr.name)) if names else None
    if instr.opcode == "send" and "is_host_transfer=true" in instr.attrs:
        return _host_transfer(comp, instr, quoted)
    if instr.opcode == "fusion" and _root_target(module, instr, quoted) == ASYNC_START_TARGET:
        carried = _fused_collectives(module, instr)
        if carried:
            channel = carried[0][1:]
            return _Start((), lambda i: i.opcode == "fusion"
                          and _root_target(module, i, quoted) == ASYNC_DONE_TARGET
                          and any(c[1:] == channel for c in _fused_collectives(module, i)),
                          channel=channel)
    return None


def _host_transfer(comp: Computation, send: Instr, quoted: dict[str, str]) -> _Start:
    """A megascale transfer ends at the ``recv-done`` of the ``recv`` sharing its rendezvous.

    If the module pairs them so.
    """
    rendezvous = quoted.get(send.name)
    receives = {i.name for i in comp.instrs.values()
                if i.opcode == "recv" and rendezvous and quoted.get(i.name) == rendezvous}
    if receives:
        return _Start((send.name,), lambda i: i.opcode == "recv-done"
                      and bool(i.operands) and i.operands[0] in receives)
    return _Start((send.name,), lambda i: i.opcode == "send-done"
                  and _reaches(comp, i, send.name))


def _reaches(comp: Computation, done: Instr, start: str) -> bool:
    """Does ``done`` read ``start`` (directly, or through tuple elements, async updates, copies)?"""
    name = done.operands[0] if done.operands else None
    for _ in range(16):
        if name == start:
            return True
        instr = comp.instrs.get(name) if name else None
        if instr is None or instr.opcode not in _TO_START or not instr.operands:
            return False
        name = instr.operands[0]
    return False


def _callee(module: Module, instr: Instr) -> Computation | None:
    name = attr(instr, "calls")
    return module.computations.get(name.lstrip("%")) if name else None


def _root_target(module: Module, fusion: Instr, quoted: dict[str, str]) -> str | None:
    """The ``custom_call_target`` of the custom call a fusion's computation ends in."""
    callee = _callee(module, fusion)
    if callee is None or callee.root is None:
        return None
    root = callee.instrs[callee.root]
    return quoted.get(root.name) if root.opcode == "custom-call" else None


def _fused_collectives(module: Module, fusion: Instr) -> list[tuple[str, str, str | None]]:
    """(name, kind, channel_id) of the collectives inside a fusion's computation."""
    callee = _callee(module, fusion) if fusion.opcode == "fusion" else None
    if callee is None:
        return []
    return [(i.name, base, attr(i, "channel_id")) for i in callee.instrs.values()
            if (base := i.opcode.removesuffix("-start")) in KINDS]


# --------------------------------------------------------------------------------------------
# Per row of ``inspect``'s collectives table


def _row_key(kind: str, axes: Sequence[str], network: str | None) -> tuple:
    return kind, tuple(axes), network or ""


def add_overlap(rows: list[dict[str, Any]], collectives: Sequence[Collective],
                hlo_text: str) -> None:
    """Add overlap fields to each row of
    :func:`~jaxpar.inspect.hlo.collectives.summarize_collectives`.

    ``hidden_bytes`` + ``exposed_bytes`` = ``bytes``; ``hidden_count`` of ``count``;
    ``window_matmul_flops``, each matmul once though several windows hold it. All per step; rows can
    share a matmul.
    """
    schedule = read_schedule(hlo_text)
    sums: dict[tuple, list[float]] = {}
    matmuls: dict[tuple, set[tuple[str, str]]] = {}
    for c in collectives:
        window = schedule.windows.get(c.name.partition("[")[0])  # `ar[0,1]`: a split all-reduce
        key = _row_key(c.kind, c.axes, c.network)
        entry = sums.setdefault(key, [0.0, 0.0])
        if window is not None and window.hidden:
            entry[0] += c.bytes * c.executions
            entry[1] += c.executions
            matmuls.setdefault(key, set()).update((window.computation, m) for m in window.matmuls)
    for row in rows:
        key = _row_key(row["kind"], row["axes"], row.get("network"))
        hidden, count = sums.get(key, (0.0, 0.0))
        row["hidden_bytes"] = round(hidden)
        row["exposed_bytes"] = row["bytes"] - row["hidden_bytes"]
        row["hidden_count"] = round(count)
        row["window_matmul_flops"] = sum(schedule.step_flops[m] for m in matmuls.get(key, ()))


def overlap_totals(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """All rows together: ``bytes``, ``hidden_bytes``, ``exposed_bytes``, ``hidden_fraction``.

    ``hidden_fraction`` is None without bytes.
    """
    total = sum(row["bytes"] for row in rows)
    hidden = sum(row.get("hidden_bytes", 0) for row in rows)
    return {"bytes": total, "hidden_bytes": hidden, "exposed_bytes": total - hidden,
            "hidden_fraction": hidden / total if total else None}


def exposed_by_time(collectives: Sequence[Collective], hlo_text: str, peak_flops: float,
                    link_bytes_per_s: float) -> dict[tuple, float]:
    """Exposed bytes per row key, per step, each hidden window weighted by time.

    A window hides the share of the transfer (``wire_bytes`` at ``link_bytes_per_s``) its matmuls
    take at ``peak_flops``, at most all. An estimate: docs/inspect.md, "Hidden and exposed
    communication".
    """
    schedule = read_schedule(hlo_text)
    out: dict[tuple, float] = {}
    for c in collectives:
        window = schedule.windows.get(c.name.partition("[")[0])
        hidden = 0.0
        if window is not None and window.hidden and c.wire_bytes:
            hidden = min(1.0, window.flops / peak_flops / (c.wire_bytes / link_bytes_per_s))
        key = _row_key(c.kind, c.axes, c.network)
        out[key] = out.get(key, 0.0) + c.bytes * c.executions * (1 - hidden)
    return out
