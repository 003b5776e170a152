"""Which collectives did the compiler emit, over which mesh axes, moving how many bytes?

`parse_collectives` reads the text of a compiled XLA program (`jax.jit(f).lower(...).compile()
.as_text()`, the optimised, SPMD-partitioned HLO with per-device shapes) and returns one
`Collective` per collective instruction, described *logically*: the kind of communication, its
payload, and the mesh axes its device groups span. `summarize_collectives` folds those into the
rows of `jaxpar inspect --json`.

Why a logical view is needed: the same communication is spelled differently by each backend and
XLA version, and users ask about the communication, not the spelling.

- Async forms. GPU/TPU split collectives into `all-reduce-start` / `all-reduce-done` pairs (the
  start's result is a tuple mixing operand and output buffers), or wrap them in
  `async-start(..., calls=%wrapped)`. We count the `-start` (or the wrapped instruction) once and
  never the `-done`; payloads are computed from the *operands*, so tuple results do not matter.
- Reduce-scatter. XLA:CPU's SPMD partitioner never emits `reduce-scatter`: it emits an `all-reduce`
  whose result is only cut down to the local shard by `dynamic-slice` (often inside a fusion, after
  a bitcast or copy). TPU wraps the same pair in a `fusion(kind=kCustom,
  calls=%all-reduce-scatter...)`. Both are reported as one logical `reduce-scatter`; `lowered_as`
  keeps the spelling ('all-reduce+dynamic-slice', 'all-reduce-scatter-fusion'). Each device must
  keep at most 1/N of the N-way reduction (exactly 1/N, or less when the output is also sharded
  over axes the input was replicated on); an all-reduce over (data, fsdp) of which each device
  keeps 1/fsdp is a mix of both and stays an `all-reduce`.
- Replica groups. They come as explicit lists `{{0,1},{2,3}}`, as `{}` (everyone), as iota lists
  `[2,4]<=[8]` / `[4,2]<=[2,4]T(1,0)`, or (jax 0.10) as named meshes of the *sharding's tile
  assignment* (not the user's mesh), e.g. `mesh['axis_0'=2,'axis_1'=1,'axis_2'=4] {'axis_0'}`.
  All are expanded to explicit groups and then mapped onto the user's mesh.

Which numbers are in the groups: in an SPMD program (`num_partitions` = devices) the ids are
*logical*: `use_global_device_ids=true` ids are flattened ids `replica * num_partitions +
partition`, and `channel_id`-only ops on all-to-all / collective-permute use partition ids. Either
way an id is a position in the executable's device assignment, which JAX builds from
`mesh.devices.flat`; so id `i` is the mesh coordinate `unravel_index(i, mesh shape)`. (Checked on
CPU with a mesh whose devices are permuted: the groups keep position numbers, not device ids.)
`device_ids` is used only when a group names an id outside `range(n)`, which no logical id can be:
then the text holds physical device ids (a non-SPMD dump, or other processes' devices, whose ids
start at 2048) and they are looked up in `device_ids`.

Counting per step: a collective in a while-loop body (`lax.scan` over layers, gradient
accumulation) runs once per iteration. Each `Collective` carries `executions`, how often its
computation runs per call of the program: the product of the `known_trip_count`s of the loops
around it, summed over call sites. XLA:CPU records a loop's trip count in the while op's
backend_config (`known_trip_count`); TPU's compiler does not, so there it is read off the loop
itself: a condition `i < N` on a counter that starts at the constant 0 (the form `lax.scan` and
`fori_loop` lower to) runs N times. A loop whose trip count is found neither way counts once.
`bytes` and `wire_bytes` are per execution; `summarize_collectives` multiplies, so its rows are
per-step totals.

Async copies on TPU: the TPU compiler places one async all-gather inside several fusions (the
start fusion, the fusions it overlaps with, the done fusion), all with the same `channel_id`;
inside fused computations a channel is one collective, counted once. (Outside fusions channel
ids are not unique: XLA:CPU gives every ppermute of a shard_map `channel_id=1`.)
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

KINDS = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
    "ragged-all-to-all",
)


@dataclass(frozen=True)
class Collective:
    """One logical collective of a compiled program, per device."""

    kind: str  # one of KINDS
    lowered_as: str  # spelling in the HLO, e.g. 'all-reduce-start', 'all-reduce+dynamic-slice'
    name: str  # HLO instruction name (of the fusion for TPU's all-reduce-scatter)
    dtype: str  # dtype of the largest operand, e.g. 'f32', 'bf16'
    # Logical payload per device: all-reduce, all-to-all, permute: the operands; all-gather: the
    # gathered result; reduce-scatter: the unscattered input; ragged-all-to-all: its input buffer.
    bytes: int
    # What each device sends with ring algorithms over N devices: all-reduce 2(N-1)/N * bytes,
    # all-gather, reduce-scatter and all-to-all (N-1)/N, permute all of it. An all-reduce +
    # dynamic-slice reduce-scatter pays the all-reduce's 2(N-1)/N, since that is what runs.
    wire_bytes: int
    group_size: int  # N: devices per replica group (permute: the largest connected set)
    axes: tuple[str, ...]  # mesh axes the groups span, in mesh order; size-1 axes never appear
    # Runs per call of the program (loop trip counts around it); a fraction when averaged
    # over devices that run different branches (pipeline stages).
    executions: float = 1


# --------------------------------------------------------------------------------------------
# Shapes
# --------------------------------------------------------------------------------------------

# `f32[8,16]`, `bf16[]`, `pred[<=4]`: the dtype and the dims; layouts (`{1,0:T(8,128)(2,1)S(1)}`)
# never contain brackets, so they are skipped for free.
_ARRAY_RE = re.compile(r"\b([a-z][a-z0-9]*)\[([^\]]*)\]")


@dataclass(frozen=True)
class _Array:
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


def _parse_arrays(type_text: str) -> tuple[_Array, ...]:
    """All arrays of a (possibly nested tuple) HLO type, in order."""
    arrays = []
    for dtype, dims in _ARRAY_RE.findall(type_text):
        # `<=8` is a dynamic dim with bound 8; the bound is what is allocated and sent.
        sizes = tuple(int(d.strip().lstrip("<=") or 0) for d in dims.split(",") if d.strip())
        arrays.append(_Array(dtype, sizes))
    return tuple(arrays)


# --------------------------------------------------------------------------------------------
# Instruction-level parser
# --------------------------------------------------------------------------------------------

# `[ROOT] %name = TYPE opcode(operands), attrs`. TYPE is the shortest text before the first
# ` opcode(`: types never contain a space followed by an identifier and `(`.
_INSTR_RE = re.compile(
    r"^\s*(?P<root>ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<type>.+?)\s+"
    r"(?P<opcode>[a-z][\w\-]*)\((?P<rest>.*)$"
)
_HEAD_RE = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s")
# `[ENTRY] %name (params) -> result {`, or hand-written `add {`.
_COMP_RE = re.compile(r"^\s*(?P<entry>ENTRY\s+)?%?(?P<name>[\w.\-]+)\s*(?:\(.*)?\{\s*$")
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
class _Instr:
    name: str
    opcode: str
    arrays: tuple[_Array, ...]  # of the result type, tuples flattened
    operands: list[str]  # operand instruction names
    inline_types: list[tuple[_Array, ...] | None]  # operand types printed inline, if any
    attrs: str  # attribute text with string literals blanked out
    root: bool
    trip_count: int | None = None  # while loops: XLA's known_trip_count


@dataclass
class _Computation:
    name: str
    instrs: dict[str, _Instr] = field(default_factory=dict)
    users: dict[str, list[tuple[_Instr, int]]] = field(default_factory=lambda: defaultdict(list))
    params: dict[int, str] = field(default_factory=dict)  # parameter number -> name
    root: str | None = None


@dataclass
class _Module:
    computations: dict[str, _Computation]
    replica_count: int | None
    num_partitions: int | None
    entry: str | None = None


def _split_balanced(text: str) -> tuple[str, str]:
    """Split `a, (b, c)), attrs` after the `)` that closes an already-open `(`."""
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


def _parse_instr(line: str) -> _Instr | None:
    m = _INSTR_RE.match(line)
    if not m:
        return None
    operand_text, attrs = _split_balanced(m.group("rest"))
    operands: list[str] = []
    inline: list[tuple[_Array, ...] | None] = []
    for item in _split_top_level(_COMMENT_RE.sub("", operand_text)):
        # `f32[8,16]{1,0} %param.1` (types printed inline) or just `%param.1`; `parameter(0)`
        # and `constant(...)` have literals here, which are kept as-is and never looked up.
        type_text, _, ref = item.rpartition(" ")
        operands.append(ref.lstrip("%"))
        inline.append(_parse_arrays(type_text) or None)
    return _Instr(
        name=m.group("name"),
        opcode=m.group("opcode"),
        arrays=_parse_arrays(m.group("type")),
        operands=operands,
        inline_types=inline,
        attrs=_STRING_RE.sub('""', attrs),
        root=bool(m.group("root")),
        trip_count=int(t.group(1)) if (t := _TRIP_COUNT_RE.search(attrs)) else None,
    )


def _open_brackets(line: str) -> int:
    text = _STRING_RE.sub('""', line)
    return sum(text.count(c) for c in "([") - sum(text.count(c) for c in ")]")


def _continues(line: str) -> bool:
    """Does this line stop mid-instruction (an open `(`, a trailing comma, no opcode yet)?"""
    unfinished_head = _HEAD_RE.match(line) is not None and _INSTR_RE.match(line) is None
    return _open_brackets(line) > 0 or line.endswith(",") or unfinished_head


def _logical_lines(text: str) -> Iterator[str]:
    """Lines of the module, with an instruction wrapped over several lines joined back."""
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


def _parse_module(text: str) -> _Module:
    computations: dict[str, _Computation] = {}
    replica_count = num_partitions = None
    current: _Computation | None = None
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
                current = computations.setdefault(m.group("name"), _Computation(m.group("name")))
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
        for index, operand in enumerate(instr.operands):
            current.users[operand].append((instr, index))
        if instr.opcode == "parameter":
            current.params[int(instr.operands[0])] = instr.name
        if instr.root:
            current.root = instr.name
    return _Module(computations, replica_count, num_partitions, entry)


def _value_through_copies(comp: _Computation, name: str) -> _Instr | None:
    """The instruction `name` is a copy, bitcast or convert of, followed to its source."""
    instr = comp.instrs.get(name)
    while instr is not None and instr.opcode in ("copy", "bitcast", "convert") and instr.operands:
        instr = comp.instrs.get(instr.operands[0])
    return instr


def _constant_int(comp: _Computation, name: str) -> int | None:
    instr = _value_through_copies(comp, name)
    if instr is None or instr.opcode != "constant" or not instr.operands:
        return None
    try:
        return int(instr.operands[0])
    except ValueError:
        return None


def _inferred_trip_count(module: _Module, comp: _Computation, loop: _Instr) -> int | None:
    """N for a loop `for (i = 0; i < N; i++)`, read from its condition and initial tuple."""
    cond = module.computations.get((_attr(loop, "condition") or "").lstrip("%"))
    root = cond.instrs.get(cond.root) if cond and cond.root else None
    if root is None or root.opcode != "compare" or "direction=LT" not in root.attrs:
        return None
    counter = cond.instrs.get(root.operands[0])
    bound = _constant_int(cond, root.operands[1])
    if counter is None or counter.opcode != "get-tuple-element" or bound is None:
        return None
    init = _value_through_copies(comp, loop.operands[0]) if loop.operands else None
    index = int(_attr(counter, "index") or 0)
    if init is None or init.opcode != "tuple" or index >= len(init.operands):
        return None
    return bound if _constant_int(comp, init.operands[index]) == 0 else None


def _executions(module: _Module, branch_runs: Mapping[int, Sequence[float]] | None = None,
                ) -> dict[str, float]:
    """How many times each computation runs per call of the entry computation.

    A conditional runs one of its branches; which one the text cannot say, so each counts as
    running every time unless ``branch_runs[n]`` gives, for conditionals of ``n`` branches, each
    branch's share of the calls (what the pipeline executor's table says, averaged over stages).
    """
    calls: dict[str, list[tuple[str, float]]] = defaultdict(list)  # callee -> (caller, times)
    for comp in module.computations.values():
        for instr in comp.instrs.values():
            for m in _CALLED_RE.finditer(instr.attrs):
                names = ([m.group("name")] if m.group("name") else
                         [b.strip().lstrip("%") for b in m.group("branches").split(",")])
                times: float = 1
                if m.group("key") in ("body", "condition"):
                    times = (instr.trip_count or _inferred_trip_count(module, comp, instr)
                             or 1)
                shares = (branch_runs or {}).get(len(names)) if m.group("branches") else None
                for i, name in enumerate(names):
                    calls[name].append((comp.name, shares[i] if shares else times))
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


def _attr(instr: _Instr, key: str) -> str | None:
    m = re.search(rf"(?:^|[\s,]){re.escape(key)}=([^\s,]+)", instr.attrs)
    return m.group(1) if m else None


def _operand_arrays(comp: _Computation, instr: _Instr, index: int) -> tuple[_Array, ...]:
    if instr.inline_types[index] is not None:
        return instr.inline_types[index]
    source = comp.instrs.get(instr.operands[index])
    if source is None:
        raise ValueError(f"operand %{instr.operands[index]} of %{instr.name} is not defined")
    return source.arrays


# --------------------------------------------------------------------------------------------
# The user's mesh: logical ids -> coordinates -> axes
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Mesh:
    names: tuple[str, ...]
    sizes: tuple[int, ...]
    device_ids: tuple[int, ...]

    @property
    def size(self) -> int:
        return math.prod(self.sizes)

    def physical_positions(self, id_lists: list[list[int]]) -> list[list[int]] | None:
        """Positions of the ids if they can only be physical device ids, else None.

        Logical ids are positions in mesh.devices.flat (module docstring), so they lie in
        range(n); an id outside it (another process's device, from 2048 on) means the text
        names physical ids, which are then all looked up in device_ids.
        """
        if all(0 <= i < self.size for ids in id_lists for i in ids):
            return None
        index = {d: p for p, d in enumerate(self.device_ids)}
        missing = sorted({i for ids in id_lists for i in ids} - set(index))
        if missing:
            raise ValueError(f"device ids {missing} are neither positions nor ids of this mesh")
        return [[index[i] for i in ids] for ids in id_lists]

    def positions(self, ids: Sequence[int]) -> list[int]:
        if not all(0 <= i < self.size for i in ids):
            raise ValueError(f"replica group {list(ids)} exceeds the mesh of {self.size}")
        return list(ids)

    def coords(self, position: int) -> tuple[int, ...]:
        return tuple(int(c) for c in np.unravel_index(position, self.sizes))

    def axes_between(self, positions: Sequence[int]) -> set[int]:
        coords = [self.coords(p) for p in positions]
        return {a for a in range(len(self.sizes)) if len({c[a] for c in coords}) > 1}

    def named(self, axes: set[int]) -> tuple[str, ...]:
        return tuple(self.names[a] for a in sorted(axes))


def _as_mesh(
    mesh_shape: Mapping[str, int] | Sequence[tuple[str, int]], device_ids: Sequence[int] | None
) -> _Mesh:
    items = list(mesh_shape.items()) if isinstance(mesh_shape, Mapping) else list(mesh_shape)
    names = tuple(str(name) for name, _ in items)
    sizes = tuple(int(size) for _, size in items)
    n = math.prod(sizes)
    ids = tuple(range(n)) if device_ids is None else tuple(int(d) for d in device_ids)
    if len(ids) != n:
        raise ValueError(f"{len(ids)} device ids for a mesh of {n} devices")
    return _Mesh(names, sizes, ids)


def _group_axes(mesh: _Mesh, groups: list[list[int]]) -> tuple[int, tuple[str, ...]]:
    axes: set[int] = set()
    for group in groups:
        axes |= mesh.axes_between(mesh.positions(group))
    return max(len(g) for g in groups), mesh.named(axes)


def _permute_axes(mesh: _Mesh, pairs: list[list[int]]) -> tuple[int, tuple[str, ...]]:
    """Axes along which sources and targets differ; group = largest connected set of devices."""
    moving = [mesh.positions(p) for p in pairs if p[0] != p[1]]
    axes: set[int] = set()
    parent: dict[int, int] = {}

    def find(x: int) -> int:
        while parent.setdefault(x, x) != x:
            x = parent[x]
        return x

    for source, target in moving:
        axes |= mesh.axes_between([source, target])
        parent[find(source)] = find(target)
    components: dict[int, int] = defaultdict(int)
    for x in list(parent):
        components[find(x)] += 1
    return max(components.values(), default=1), mesh.named(axes)


# --------------------------------------------------------------------------------------------
# Replica groups -> logical device ids
# --------------------------------------------------------------------------------------------

_IOTA_RE = re.compile(r"\[(\d+(?:,\d+)*)\]<=\[(\d+(?:,\d+)*)\](?:T\((\d+(?:,\d+)*)\))?")
# mesh['axis_0'=2,'axis_1'=4], device_ids=(...) {'axis_0','axis_1':(1)2}  (jax 0.10), and the
# spelling `@mesh<a=2,b=4> {a}` of other XLA versions.
_MESH_RE = re.compile(
    r"(?:@mesh<|mesh\[)(?P<axes>[^\]>]*)[\]>]"
    r"(?:,\s*device_ids=\((?P<ids>\[[\d,]+\](?:T\([\d,]+\))?|[\d,\s]+)\))?"
    r"\s*\{(?P<select>[^}]*)\}"
)
_AXIS_REF_RE = re.compile(r"'?([^':,\s]+)'?(?::\((\d+)\)(\d+))?")


def _ints(text: str) -> list[int]:
    return [int(x) for x in re.findall(r"\d+", text)]


def _iota(dims: Sequence[int], reshape: Sequence[int], perm: Sequence[int] | None) -> np.ndarray:
    """XLA's iota tile assignment: iota over `reshape`, transposed by `perm`, viewed as `dims`."""
    array = np.arange(math.prod(reshape)).reshape(reshape)
    if perm is not None:
        array = array.transpose(perm)
    return array.reshape(dims)


def _mesh_groups(m: re.Match[str]) -> list[list[int]]:
    """Expand a named-mesh replica group list exactly as XLA's MeshAxesReplicaGroupList does."""
    names, sizes = [], []
    for item in m.group("axes").split(","):
        name, _, size = item.rpartition("=")
        names.append(name.strip().strip("'\""))
        sizes.append(int(size))
    n = math.prod(sizes)
    ids = m.group("ids")
    if ids is None:
        devices = np.arange(n).reshape(sizes)
    elif ids.startswith("["):  # iota form `[4,16]T(1,0)`: reshape dims, then a transpose
        reshape, _, perm = ids[1:].partition("]")
        devices = _iota(sizes, _ints(reshape), _ints(perm) if perm else None)
    else:
        devices = np.array(_ints(ids)).reshape(sizes)

    # Each referenced axis (or sub-axis `a:(pre)size`, whose `pre` is the product of the more
    # major sub-axes) becomes a dim of a finer reshape of the device array; groups are the
    # devices that differ only along the referenced dims.
    refs: dict[int, list[tuple[int, int, int]]] = defaultdict(list)  # axis -> (pre, size, order)
    for order, ref in enumerate(_AXIS_REF_RE.finditer(m.group("select"))):
        axis = names.index(ref.group(1))
        pre, size = (int(ref.group(2)), int(ref.group(3))) if ref.group(2) else (1, sizes[axis])
        refs[axis].append((pre, size, order))
    fine_dims: list[int] = []
    grouped: dict[int, int] = {}  # ref order -> fine dim
    for axis, full in enumerate(sizes):
        prefix = 1
        for pre, size, order in sorted(refs.get(axis, [])):
            if pre != prefix:
                fine_dims.append(pre // prefix)
                prefix = pre
            grouped[order] = len(fine_dims)
            fine_dims.append(size)
            prefix *= size
        if prefix != full or not refs.get(axis):
            fine_dims.append(full // prefix)
    group_dims = [grouped[o] for o in sorted(grouped)]
    other_dims = [d for d in range(len(fine_dims)) if d not in group_dims]
    group_size = math.prod(fine_dims[d] for d in group_dims)
    fine = devices.reshape(fine_dims).transpose(other_dims + group_dims)
    return fine.reshape(-1, group_size).tolist()


def _parse_groups(text: str) -> list[list[int]] | None:
    """Groups of ids from a `replica_groups=` value; None for `{}` (all participants)."""
    if m := _MESH_RE.match(text):
        return _mesh_groups(m)
    if m := _IOTA_RE.match(text):
        dims, reshape = _ints(m.group(1)), _ints(m.group(2))
        perm = _ints(m.group(3)) if m.group(3) else None
        return _iota(dims, reshape, perm).tolist()
    inner, _ = _split_balanced(text[1:])  # text starts with the outer `{`
    groups = [_ints(g) for g in re.findall(r"\{([^{}]*)\}", inner)]
    return groups or None


def _attr_groups(instr: _Instr) -> list[list[int]] | None:
    start = instr.attrs.find("replica_groups=")
    if start < 0:
        return None
    return _parse_groups(instr.attrs[start + len("replica_groups=") :].lstrip())


@dataclass(frozen=True)
class _Layout:
    """How the module's flattened ids decompose: replica * partitions + partition."""

    replicas: int
    partitions: int
    declared: bool  # the HloModule line said so; hand-written snippets often don't


def _flattened_groups(
    instr: _Instr, groups: list[list[int]] | None, layout: _Layout, mesh: _Mesh
) -> list[list[int]]:
    """Groups as flattened ids (replica * partitions + partition), per XLA's group modes."""
    if groups and (physical := mesh.physical_positions(groups)) is not None:
        return physical
    replicas, partitions = layout.replicas, layout.partitions
    has_channel = _attr(instr, "channel_id") is not None
    global_ids = _attr(instr, "use_global_device_ids") == "true"
    base = instr.opcode.removesuffix("-start")
    if global_ids or not layout.declared:  # kFlattenedID, or read a bare snippet that way
        return groups or [list(range(replicas * partitions))]
    if has_channel and base in ("all-reduce", "all-gather", "reduce-scatter"):
        # kCrossReplicaAndPartition: each group of replicas, together with all partitions.
        replica_groups = groups or [list(range(replicas))]
        return [[r * partitions + p for r in g for p in range(partitions)] for g in replica_groups]
    if has_channel:  # kCrossPartition (all-to-all, collective-permute): per replica.
        partition_groups = groups or [list(range(partitions))]
        return [[r * partitions + p for p in g] for r in range(replicas) for g in partition_groups]
    # kCrossReplica: the same replica groups in every partition.
    replica_groups = groups or [list(range(replicas))]
    return [[r * partitions + p for r in g] for p in range(partitions) for g in replica_groups]


def _permute_pairs(instr: _Instr, layout: _Layout, mesh: _Mesh) -> list[list[int]]:
    start = instr.attrs.find("source_target_pairs=")
    if start < 0:
        return []
    inner, _ = _split_balanced(instr.attrs[start + len("source_target_pairs=") + 1 :])
    pairs = [_ints(p) for p in re.findall(r"\{([^{}]*)\}", inner)]
    if (physical := mesh.physical_positions(pairs)) is not None:
        return physical
    replicas, partitions = layout.replicas, layout.partitions
    if not layout.declared:
        return pairs
    if _attr(instr, "channel_id") is not None:  # partition ids, within each replica
        return [[r * partitions + s, r * partitions + t] for r in range(replicas) for s, t in pairs]
    return [[s * partitions + p, t * partitions + p] for p in range(partitions) for s, t in pairs]


# --------------------------------------------------------------------------------------------
# Classification
# --------------------------------------------------------------------------------------------

# Ops that forward a value without reading it as data (TPU copies asynchronously).
_PASS_THROUGH = {
    "bitcast",
    "copy",
    "copy-start",
    "copy-done",
    "reshape",
    "get-tuple-element",
    "all-reduce-done",
}


def _only_sliced(module: _Module, comp: _Computation, name: str, group_size: int) -> bool:
    """Is the value `name` only ever cut down to 1/group_size (or less) by dynamic-slices?

    Follows the value through layout-only ops and into and out of fusions. Any other use,
    including being returned from a non-fusion computation, sees the full result. The slice
    offsets are not checked: in a scanned layer stack XLA hoists their partition-id arithmetic
    out of the loop, and a constant offset would have been simplified into a `slice`.
    """
    # (computation, value, fusion instructions we entered, outermost first)
    stack: list[tuple[_Computation, str, tuple[tuple[_Computation, _Instr], ...]]]
    stack = [(comp, name, ())]
    seen: set[tuple[str, str]] = set()
    while stack:
        comp, name, entered = stack.pop()
        if (comp.name, name) in seen:
            continue
        seen.add((comp.name, name))
        uses = comp.users.get(name, [])
        if comp.root == name:
            if not entered:
                return False
            outer, fusion = entered[-1]
            stack.append((outer, fusion.name, entered[:-1]))
        elif not uses:
            return False
        for user, index in uses:
            if user.opcode in _PASS_THROUGH:
                stack.append((comp, user.name, entered))
            elif user.opcode == "dynamic-slice" and index == 0:
                full = _operand_arrays(comp, user, 0)[0].elements
                kept = user.arrays[0].elements
                if kept == 0 or full % kept or (full // kept) % group_size:
                    return False
            elif user.opcode == "fusion" and (callee := _callee(module, user)) is not None:
                if index not in callee.params:
                    return False
                stack.append((callee, callee.params[index], (*entered, (comp, user))))
            else:
                return False
    return True


def _sliced_elements(module: _Module, comp: _Computation, instr: _Instr, n: int) -> set[int]:
    """Which results of an all-reduce are only used cut down to 1/n (see `_only_sliced`).

    A one-operand all-reduce is all or nothing. A combined (tuple) all-reduce is judged element
    by element, through its get-tuple-element users; any other use of the tuple sees it all.
    """
    if len(instr.operands) <= 1:
        return {0} if _only_sliced(module, comp, instr.name, n) else set()
    uses = comp.users.get(instr.name, [])
    if comp.root == instr.name or any(u.opcode != "get-tuple-element" for u, _ in uses):
        return set()
    by_element: dict[int, list[str]] = {}
    for user, _ in uses:
        by_element.setdefault(int(_attr(user, "index") or 0), []).append(user.name)
    return {
        i
        for i in range(len(instr.operands))
        if by_element.get(i)
        and all(_only_sliced(module, comp, name, n) for name in by_element[i])
    }


def _split_combined(
    comp: _Computation, instr: _Instr, sliced: set[int], n: int, axes: tuple[str, ...]
) -> list[Collective]:
    """One logical collective for the sliced elements of a combined all-reduce, one for the rest."""
    out = []
    for kind, elements in (
        ("reduce-scatter", sorted(sliced)),
        ("all-reduce", sorted(set(range(len(instr.operands))) - sliced)),
    ):
        arrays = [a for i in elements for a in _operand_arrays(comp, instr, i)]
        payload = sum(a.bytes for a in arrays)
        lowered_as = f"{instr.opcode}+dynamic-slice" if kind == "reduce-scatter" else instr.opcode
        out.append(
            Collective(
                kind=kind,
                lowered_as=lowered_as,
                name=f"{instr.name}[{','.join(map(str, elements))}]",
                dtype=max(arrays, key=lambda a: a.bytes).dtype if arrays else "",
                bytes=payload,
                wire_bytes=_wire_bytes(kind, lowered_as, payload, n),
                group_size=n,
                axes=axes,
            )
        )
    return out


def _callee(module: _Module, instr: _Instr) -> _Computation | None:
    called = _attr(instr, "calls")
    return module.computations.get(called.lstrip("%")) if called else None


def _is_tpu_reduce_scatter_fusion(module: _Module, instr: _Instr) -> bool:
    called = _attr(instr, "calls") or ""
    return (
        instr.opcode == "fusion"
        and called.lstrip("%").startswith("all-reduce-scatter")
        and called.lstrip("%") in module.computations
    )


def _payload_bytes(comp: _Computation, instr: _Instr, base: str) -> tuple[int, str]:
    """Bytes and dtype of the data an instruction sends, from its operands (never its result,
    which for `-start` ops is a tuple of operand and output buffers)."""
    indices = range(len(instr.operands))
    if base == "ragged-all-to-all":
        indices = range(1)  # (input, output, offsets and sizes...): the input is the payload
    elif base == "collective-permute" and "slice_sizes=" in instr.attrs:
        indices = range(1)  # in-place form (input, output, input/output start indices)
    arrays = [a for i in indices for a in _operand_arrays(comp, instr, i)]
    if not arrays:
        return 0, ""
    largest = max(arrays, key=lambda a: a.bytes)  # max() keeps the first of equal ones
    return sum(a.bytes for a in arrays), largest.dtype


def _wire_bytes(kind: str, lowered_as: str, payload: int, n: int) -> int:
    if n <= 1:
        return 0
    if kind == "collective-permute":
        return payload
    if kind == "all-reduce" or lowered_as.endswith("+dynamic-slice"):
        return payload * 2 * (n - 1) // n  # reduce-scatter + all-gather ring
    return payload * (n - 1) // n


def _tpu_reduce_scatter(
    module: _Module,
    comp: _Computation,
    fusion: _Instr,
    mesh: _Mesh,
    layout: _Layout,
) -> Collective:
    callee = _callee(module, fusion)
    inner = next(
        (i for i in callee.instrs.values() if i.opcode.removesuffix("-start") == "all-reduce"),
        None,
    )
    if inner is not None:
        payload, dtype = _payload_bytes(callee, inner, "all-reduce")
        groups = _flattened_groups(inner, _attr_groups(inner), layout, mesh)
        n, axes = _group_axes(mesh, groups)
    else:  # no visible all-reduce: infer the group from how much the fusion scatters
        payload, dtype = _payload_bytes(comp, fusion, "reduce-scatter")
        kept = sum(a.bytes for a in fusion.arrays)
        n, axes = (payload // kept if kept else 1), ()
    lowered_as = "all-reduce-scatter-fusion"
    return Collective(
        kind="reduce-scatter",
        lowered_as=lowered_as,
        name=fusion.name,
        dtype=dtype,
        bytes=payload,
        wire_bytes=_wire_bytes("reduce-scatter", lowered_as, payload, n),
        group_size=n,
        axes=axes,
    )


def parse_collectives(
    hlo_text: str,
    mesh_shape: Mapping[str, int] | Sequence[tuple[str, int]],
    device_ids: Sequence[int] | None = None,
    branch_runs: Mapping[int, Sequence[float]] | None = None,
) -> list[Collective]:
    """The collectives of a compiled HLO module, in text order, mapped onto `mesh_shape`.

    `mesh_shape` is the ordered mesh (`dict(mesh.shape)`); `device_ids` is
    `[d.id for d in mesh.devices.flat]` (default `range(n)`), needed only when the text names
    physical device ids rather than logical ones (see the module docstring). `branch_runs`:
    per number of branches, each branch's share of a conditional's calls (else every branch
    counts as running on every call).
    """
    mesh = _as_mesh(mesh_shape, device_ids)
    module = _parse_module(hlo_text)
    replicas = module.replica_count or 1
    partitions = module.num_partitions or max(1, mesh.size // replicas)
    if replicas * partitions != mesh.size:
        raise ValueError(
            f"HLO is for {replicas} replicas x {partitions} partitions, mesh has {mesh.size}"
        )
    declared = module.replica_count is not None or module.num_partitions is not None
    layout = _Layout(replicas, partitions, declared)

    # TPU's all-reduce-scatter fusions are reported whole; their inner all-reduce is not.
    fused_reduce_scatters = {
        _callee(module, instr).name
        for comp in module.computations.values()
        for instr in comp.instrs.values()
        if _is_tpu_reduce_scatter_fusion(module, instr)
    }

    runs = _executions(module, branch_runs)
    fused = {(_attr(i, "calls") or "").lstrip("%") for c in module.computations.values()
             for i in c.instrs.values() if i.opcode == "fusion"}
    counted_channels: set[tuple[str, str]] = set()
    found: list[Collective] = []
    for comp in module.computations.values():
        if comp.name in fused_reduce_scatters:
            continue
        in_this_computation = len(found)
        for instr in comp.instrs.values():
            if _is_tpu_reduce_scatter_fusion(module, instr):
                found.append(_tpu_reduce_scatter(module, comp, instr, mesh, layout))
                continue
            base = instr.opcode.removesuffix("-start")
            if base not in KINDS or instr.opcode.endswith("-done"):
                continue
            channel = _attr(instr, "channel_id")
            if channel is not None and comp.name in fused:
                if (base, channel) in counted_channels:
                    continue  # another placement of a collective already counted (TPU async)
                counted_channels.add((base, channel))
            payload, dtype = _payload_bytes(comp, instr, base)
            if base == "collective-permute":
                pairs = _permute_pairs(instr, layout, mesh)
                n, axes = _permute_axes(mesh, pairs)
            else:
                groups = _flattened_groups(instr, _attr_groups(instr), layout, mesh)
                n, axes = _group_axes(mesh, groups)
            kind, lowered_as = base, instr.opcode
            if base == "all-reduce" and n > 1:
                sliced = _sliced_elements(module, comp, instr, n)
                if 0 < len(sliced) < len(instr.operands):
                    # XLA's combiner merged reductions that are logically different: report
                    # the sliced elements as a reduce-scatter and the rest as an all-reduce.
                    found.extend(_split_combined(comp, instr, sliced, n, axes))
                    continue
                if sliced:
                    kind, lowered_as = "reduce-scatter", f"{instr.opcode}+dynamic-slice"
            if base == "all-gather":
                payload *= n  # the gathered result
            found.append(
                Collective(
                    kind=kind,
                    lowered_as=lowered_as,
                    name=instr.name,
                    dtype=dtype,
                    bytes=payload,
                    wire_bytes=_wire_bytes(kind, lowered_as, payload, n),
                    group_size=n,
                    axes=axes,
                )
            )
        found[in_this_computation:] = [dataclasses.replace(c, executions=runs[comp.name])
                                       for c in found[in_this_computation:]]
    return found


def summarize_collectives(cs: Sequence[Collective]) -> list[dict]:
    """One row per (kind, axes), sorted by kind then axes: the `collectives` of inspect --json.

    `count`, `bytes` and `wire_bytes` are per step (each collective times its `executions`);
    `instructions` is how many collective instructions the program text holds.
    """
    rows: dict[tuple[str, tuple[str, ...]], dict] = {}
    for c in cs:
        row = rows.setdefault(
            (c.kind, c.axes),
            {
                "kind": c.kind,
                "count": 0,
                "instructions": 0,
                "bytes": 0,
                "wire_bytes": 0,
                "axes": list(c.axes),
                "lowered_as": set(),
            },
        )
        row["count"] += c.executions
        row["instructions"] += 1
        row["bytes"] += c.bytes * c.executions
        row["wire_bytes"] += c.wire_bytes * c.executions
        row["lowered_as"].add(c.lowered_as)
    for row in rows.values():
        row["lowered_as"] = sorted(row["lowered_as"])
        # Averages over pipeline stages can be fractional; JSON keeps whole numbers.
        for key in ("count", "bytes", "wire_bytes"):
            row[key] = round(row[key])
    return [rows[key] for key in sorted(rows)]
