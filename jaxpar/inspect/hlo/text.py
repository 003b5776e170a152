"""Reading compiled HLO text: array shapes, instructions, computations, and how often each runs.

The parser keeps each instruction's opcode, operands, result arrays and attributes, in computations,
plus the replica and partition counts. Each `Collective` carries `executions`: how often its
computation runs per call, from the trip counts of the loops around it. `bytes` and `wire_bytes` are
per execution; `summarize_collectives` multiplies. How trip counts are read: docs/jax-notes.md, "How
compiled HLO spells collectives".
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field

# --------------------------------------------------------------------------------------------
# Shapes
# --------------------------------------------------------------------------------------------

# `f32[8,16]`, `bf16[]`, `pred[<=4]`: the dtype and the dims; layouts (`{1,0:T(8,128)(2,1)S(1)}`)
# never contain brackets, so they are skipped for free.
_ARRAY_RE = re.compile(r"\b([a-z][a-z0-9]*)\[([^\]]*)\]")


@dataclass(frozen=True)
class Array:
    dtype: str
    dims: tuple[int, ...]

    @property
    def elements(self) -> int:
        return math.prod(self.dims)

    @property
    def bytes(self) -> int:
        # Sub-byte types (s4, f4e2m1fn) are counted packed; pred is stored as one byte.
        return -(-self.elements * _dtype_bits(self.dtype) // 8)


def _dtype_bits(dtype: str) -> int:
    if dtype == "pred":
        return 8
    if dtype in ("token", "opaque"):
        return 0
    # The first number in an XLA type name is its width: s4, u8, bf16, f8e4m3fn, f4e2m1fn, c128.
    m = re.match(r"[a-z]+?(\d+)", dtype)
    if not m:
        raise ValueError(f"unknown HLO element type {dtype!r}")
    return int(m.group(1))


def _parse_arrays(type_text: str) -> tuple[Array, ...]:
    """All arrays of a (possibly nested tuple) HLO type, in order."""
    arrays = []
    for dtype, dims in _ARRAY_RE.findall(type_text):
        # `<=8` is a dynamic dim with bound 8; the bound is what is allocated and sent.
        sizes = tuple(int(d.strip().lstrip("<=") or 0) for d in dims.split(",") if d.strip())
        arrays.append(Array(dtype, sizes))
    return tuple(arrays)


# --------------------------------------------------------------------------------------------
# Instruction-level parser
# --------------------------------------------------------------------------------------------

# `[ROOT] %name = TYPE opcode(operands), attrs`. TYPE is the shortest text before the first
# ` opcode(`: types never contain a space followed by an identifier and `(`.
_INSTR_RE = re.compile(
    r"^\s*(?P<root>ROOT\s+)?%?(?P<name>[\w.\-#]+)\s*=\s*(?P<type>.+?)\s+"
    r"(?P<opcode>[a-z][\w\-]*)\((?P<rest>.*)$"
)
_HEAD_RE = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-#]+\s*=\s")
# `[ENTRY] %name (params) -> result {`, or hand-written `add {`.
_COMP_RE = re.compile(r"^\s*(?P<entry>ENTRY\s+)?%?(?P<name>[\w.\-#]+)\s*(?:\(.*)?\{\s*$")
_STRING_RE = re.compile(r'"(?:[^"\\]|\\.)*"')
_TRIP_COUNT_RE = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')
# Attributes naming computations that run as part of an instruction (reductions' `to_apply` runs
# per element and holds no collectives, so it is left out).
_CALLED_RE = re.compile(
    r"\b(?P<key>body|condition|calls|true_computation|false_computation)=%?(?P<name>[\w.\-]+)"
    r"|\bbranch_computations=\{(?P<branches>[^}]*)\}"
)
_COMMENT_RE = re.compile(r"/\*.*?\*/")


@dataclass
class Instr:
    name: str
    opcode: str
    arrays: tuple[Array, ...]  # of the result type, tuples flattened
    operands: list[str]  # operand instruction names
    inline_types: list[tuple[Array, ...] | None]  # operand types printed inline, if any
    attrs: str  # attribute text with string literals blanked out
    root: bool
    trip_count: int | None = None  # while loops: XLA's known_trip_count
    # A tuple result's top-level elements, each flattened (empty for an array result).
    elements: tuple[tuple[Array, ...], ...] = ()


@dataclass
class Computation:
    name: str
    instrs: dict[str, Instr] = field(default_factory=dict)
    users: dict[str, list[tuple[Instr, int]]] = field(default_factory=lambda: defaultdict(list))
    params: dict[int, str] = field(default_factory=dict)  # parameter number -> name
    root: str | None = None


@dataclass
class Module:
    computations: dict[str, Computation]
    replica_count: int | None
    num_partitions: int | None
    entry: str | None = None


def split_balanced(text: str) -> tuple[str, str]:
    """Split `a, (b, c)), attrs` after the `)` closing an already-open `(`."""
    depth = 0
    for i, ch in enumerate(text):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            if depth == 0:
                return text[:i], text[i + 1 :]
            depth -= 1
    raise ValueError(f"unbalanced HLO operand list: {text[:80]!r}")


def _split_top_level(text: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def _parse_instr(line: str) -> Instr | None:
    m = _INSTR_RE.match(line)
    if not m:
        return None
    operand_text, attrs = split_balanced(m.group("rest"))
    operands: list[str] = []
    inline: list[tuple[Array, ...] | None] = []
    for item in _split_top_level(_COMMENT_RE.sub("", operand_text)):
        # `f32[8,16]{1,0} %param.1` (types printed inline) or just `%param.1`; `parameter(0)`
        # and `constant(...)` have literals here, which are kept as-is and never looked up.
        type_text, _, ref = item.rpartition(" ")
        operands.append(ref.lstrip("%"))
        inline.append(_parse_arrays(type_text) or None)
    return Instr(
        name=m.group("name"),
        opcode=m.group("opcode"),
        arrays=_parse_arrays(m.group("type")),
        operands=operands,
        inline_types=inline,
        attrs=_STRING_RE.sub('""', attrs),
        root=bool(m.group("root")),
        trip_count=int(t.group(1)) if (t := _TRIP_COUNT_RE.search(attrs)) else None,
        elements=_tuple_elements(m.group("type")),
    )


def _tuple_elements(type_text: str) -> tuple[tuple[Array, ...], ...]:
    """The top-level elements of a tuple type ``(f32[2], (s32[], f32[4]))``, each flattened."""
    text = type_text.strip()
    if not text.startswith("("):
        return ()
    inner, _ = split_balanced(text[1:])
    return tuple(_parse_arrays(part) for part in _split_top_level(inner))


def _open_brackets(line: str) -> int:
    text = _STRING_RE.sub('""', line)
    return sum(text.count(c) for c in "([") - sum(text.count(c) for c in ")]")


def _continues(line: str) -> bool:
    """Does this line stop mid-instruction (open `(`, trailing comma, no opcode yet)?"""
    unfinished_head = _HEAD_RE.match(line) is not None and _INSTR_RE.match(line) is None
    return _open_brackets(line) > 0 or line.endswith(",") or unfinished_head


def _logical_lines(text: str) -> Iterator[str]:
    """The module's lines, wrapped instructions joined back."""
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            continue
        if pending and _continues(pending):
            pending += " " + line
            continue
        if pending:
            yield pending
        pending = line
    if pending:
        yield pending


def parse_module(text: str) -> Module:
    computations: dict[str, Computation] = {}
    replica_count = num_partitions = None
    current: Computation | None = None
    entry = None
    for line in _logical_lines(text):
        if line.startswith("HloModule"):
            if m := re.search(r"\breplica_count=(\d+)", line):
                replica_count = int(m.group(1))
            if m := re.search(r"\bnum_partitions=(\d+)", line):
                num_partitions = int(m.group(1))
            continue
        if current is None:
            if " = " not in line and (m := _COMP_RE.match(line)):
                current = computations.setdefault(m.group("name"), Computation(m.group("name")))
                if m.group("entry"):
                    entry = m.group("name")
            continue
        if line == "}":
            current = None
            continue
        instr = _parse_instr(line)
        if instr is None:
            continue
        current.instrs[instr.name] = instr
        for operand in instr.operands:
            _add_element_reference(current, operand)
        for index, operand in enumerate(instr.operands):
            current.users[operand].append((instr, index))
        if instr.opcode == "parameter":
            current.params[int(instr.operands[0])] = instr.name
        if instr.root:
            current.root = instr.name
    return Module(computations, replica_count, num_partitions, entry)


def _add_element_reference(comp: Computation, operand: str) -> None:
    """Newer XLA's ``%name#k`` as the ``get-tuple-element`` older XLA wrote, same name."""
    base, hash_, index = operand.rpartition("#")
    if not hash_ or not index.isdigit() or operand in comp.instrs or base not in comp.instrs:
        return
    source = comp.instrs[base]
    elements = source.elements or (source.arrays,)
    k = int(index)
    element = elements[k] if k < len(elements) else ()
    comp.instrs[operand] = Instr(name=operand, opcode="get-tuple-element", arrays=element,
                                 operands=[base], inline_types=[None], attrs=f"index={k}",
                                 root=False)
    comp.users[base].append((comp.instrs[operand], 0))


def _value_through_copies(comp: Computation, name: str) -> Instr | None:
    """The source `name` is a copy, bitcast or convert of."""
    instr = comp.instrs.get(name)
    while instr is not None and instr.opcode in ("copy", "bitcast", "convert") and instr.operands:
        instr = comp.instrs.get(instr.operands[0])
    return instr


def _constant_int(comp: Computation, name: str) -> int | None:
    instr = _value_through_copies(comp, name)
    if instr is None or instr.opcode != "constant" or not instr.operands:
        return None
    try:
        return int(instr.operands[0])
    except ValueError:
        return None


def _loop_step(module: Module, loop: Instr, index: int) -> int:
    """What the loop body adds to tuple element `index` per iteration: k, else 1.

    k for a root element `add(get-tuple-element(param, index), constant k)`. TPU's unrolled
    collective-matmul loops add 2.
    """
    body = module.computations.get((attr(loop, "body") or "").lstrip("%"))
    root = body.instrs.get(body.root) if body and body.root else None
    if root is None or root.opcode != "tuple" or index >= len(root.operands):
        return 1
    update = _value_through_copies(body, root.operands[index])
    if update is None or update.opcode != "add" or len(update.operands) != 2:
        return 1
    for counter, other in (update.operands, update.operands[::-1]):
        read = _value_through_copies(body, counter)
        step = _constant_int(body, other)
        if (read is not None and read.opcode == "get-tuple-element" and step is not None
                and step > 0 and int(attr(read, "index") or 0) == index
                and (source := body.instrs.get(read.operands[0])) is not None
                and source.opcode == "parameter"):
            return step
    return 1


def _inferred_trip_count(module: Module, comp: Computation, loop: Instr) -> int | None:
    """The trip count of `for (i = c; i < N; i += k)`: ceil((N - c) / k).

    Read from the condition, the initial tuple and the body's counter update.
    """
    cond = module.computations.get((attr(loop, "condition") or "").lstrip("%"))
    root = cond.instrs.get(cond.root) if cond and cond.root else None
    if root is None or root.opcode != "compare" or "direction=LT" not in root.attrs:
        return None
    counter = cond.instrs.get(root.operands[0])
    bound = _constant_int(cond, root.operands[1])
    if counter is None or counter.opcode != "get-tuple-element" or bound is None:
        return None
    init = _value_through_copies(comp, loop.operands[0]) if loop.operands else None
    index = int(attr(counter, "index") or 0)
    if init is None or init.opcode != "tuple" or index >= len(init.operands):
        return None
    start = _constant_int(comp, init.operands[index])
    if start is None or start < 0:
        return None
    return max(0, -(-(bound - start) // _loop_step(module, loop, index)))


def called(module: Module, comp: Computation, instr: Instr) -> list[tuple[str, float, bool]]:
    """The computations ``instr`` calls: (name, times per execution, is one conditional branch).

    An async start's wrapped computation is called by the start only. A ``call`` names it
    ``to_apply=``.
    """
    if instr.opcode in ("async-update", "async-done"):
        return []
    if instr.opcode == "call" and (callee := attr(instr, "to_apply")):
        return [(callee.lstrip("%"), 1, False)]
    out = []
    for m in _CALLED_RE.finditer(instr.attrs):
        key = m.group("key")
        names = ([m.group("name")] if m.group("name") else
                 [b.strip().lstrip("%") for b in m.group("branches").split(",")])
        times: float = 1
        if key in ("body", "condition"):
            times = instr.trip_count or _inferred_trip_count(module, comp, instr) or 1
        branch = key in (None, "true_computation", "false_computation")
        out.extend((name, times, branch) for name in names)
    return out


def computation_runs(module: Module) -> dict[str, float]:
    """How many times each computation runs per call of the entry computation.

    Each conditional branch counts as running every time (an upper bound).
    """
    calls: dict[str, list[tuple[str, float]]] = defaultdict(list)  # callee -> (caller, times)
    for comp in module.computations.values():
        for instr in comp.instrs.values():
            for name, times, _ in called(module, comp, instr):
                calls[name].append((comp.name, times))
    runs: dict[str, float] = {}

    def count(name: str, visiting: frozenset[str] = frozenset()) -> float:
        if name not in runs:
            callers = calls.get(name)
            if not callers or name == module.entry or name in visiting:
                runs[name] = 1
            else:
                runs[name] = sum(count(caller, visiting | {name}) * times
                                 for caller, times in callers)
        return runs[name]

    for name in module.computations:
        count(name)
    return runs


def attr(instr: Instr, key: str) -> str | None:
    m = re.search(rf"(?:^|[\s,]){re.escape(key)}=([^\s,]+)", instr.attrs)
    return m.group(1) if m else None


def operand_arrays(comp: Computation, instr: Instr, index: int) -> tuple[Array, ...]:
    if instr.inline_types[index] is not None:
        return instr.inline_types[index]
    source = comp.instrs.get(instr.operands[index])
    if source is None:
        raise ValueError(f"operand %{instr.operands[index]} of %{instr.name} is not defined")
    return source.arrays
