"""Which collectives did the compiler emit, over which mesh axes, moving how many bytes?

`parse_collectives` reads compiled HLO text (per-device shapes) into one logical `Collective` per
instruction: kind, payload, mesh axes. `summarize_collectives` folds them into the per-step rows of
`jaxpar inspect --json`. Logical, because backends spell one communication differently (`lowered_as`
keeps the spelling): docs/jax-notes.md, "How compiled HLO spells collectives".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from jaxpar.inspect.hlo.groups import (
    MeshIds,
    ReplicaPartitionLayout,
    as_mesh,
    attr_groups,
    flattened_groups,
    group_axes,
    permute_axes,
    permute_pairs,
)
from jaxpar.inspect.hlo.text import (
    Computation,
    Instr,
    Module,
    attr,
    computation_runs,
    operand_arrays,
    parse_module,
)

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
    # Operand dtypes, most bytes first, '+'-joined where a combined collective mixes them:
    # 'f32', 'bf16', 'f32+bf16' (XLA's combiners merge gradient sums of both kinds into one).
    dtype: str
    # Logical payload per device: all-reduce, all-to-all, permute: the operands; all-gather: the
    # gathered result; reduce-scatter: the unscattered input; ragged-all-to-all: the smaller of
    # its input and output buffers (the average a device moves at most).
    bytes: int
    # What each device sends with ring algorithms over N devices: all-reduce 2(N-1)/N * bytes,
    # all-gather, reduce-scatter and all-to-all (N-1)/N, permute all of it. An all-reduce +
    # dynamic-slice reduce-scatter, or an all-reduce + dynamic-update-slice all-gather, pays the
    # all-reduce's 2(N-1)/N, since that is what runs.
    wire_bytes: int
    group_size: int  # N: devices per replica group (permute: the largest connected set)
    axes: tuple[str, ...]  # mesh axes the groups span, in mesh order; size-1 axes never appear
    # Runs per call of the program (loop trip counts around it); a fraction when averaged
    # over devices that run different branches (pipeline stages).
    executions: float = 1
    network: str | None = None  # over several slices (mesh.dcn): "ICI" inside one, else "DCN"

# --------------------------------------------------------------------------------------------
# Classification
# --------------------------------------------------------------------------------------------

# Ops that forward a value without reading it as data (TPU copies asynchronously), or read it
# element by element (a dtype cast: XLA:CPU may cast the whole all-reduced bf16 result before
# the fusion that slices it).
_PASS_THROUGH = {
    "bitcast",
    "convert",
    "copy",
    "copy-start",
    "copy-done",
    "reshape",
    "get-tuple-element",
    "all-reduce-done",
}


def _only_sliced(module: Module, comp: Computation, name: str, group_size: int) -> bool:
    """Is the value `name` only ever cut down to 1/group_size (or less) by dynamic-slices?

    Followed through layout-only ops and fusions; any other use sees the full result. Offsets are
    not checked: XLA hoists them out of scanned loops.
    """
    # (computation, value, fusion instructions we entered, outermost first)
    stack: list[tuple[Computation, str, tuple[tuple[Computation, Instr], ...]]]
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
                full = operand_arrays(comp, user, 0)[0].elements
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


def _sliced_elements(module: Module, comp: Computation, instr: Instr, n: int) -> set[int]:
    """Which results of an all-reduce are only used cut down to 1/n (`_only_sliced`).

    A combined (tuple) all-reduce is judged element by element through its get-tuple-elements.
    """
    if len(instr.operands) <= 1:
        return {0} if _only_sliced(module, comp, instr.name, n) else set()
    uses = comp.users.get(instr.name, [])
    if comp.root == instr.name or any(u.opcode != "get-tuple-element" for u, _ in uses):
        return set()
    by_element: dict[int, list[str]] = {}
    for user, _ in uses:
        by_element.setdefault(int(attr(user, "index") or 0), []).append(user.name)
    return {
        i
        for i in range(len(instr.operands))
        if by_element.get(i)
        and all(_only_sliced(module, comp, name, n) for name in by_element[i])
    }


def _padded_elements(module: Module, comp: Computation, instr: Instr, n: int) -> set[int]:
    """Which operands of an all-reduce are one device's 1/n shard written into zeros."""
    return {i for i, name in enumerate(instr.operands)
            if _is_padded_shard(module, comp, name, n)}


# Ops read backwards to the value they forward unchanged (for zeros: also a cast or broadcast).
_FORWARDING = {"bitcast", "copy", "copy-start", "copy-done", "reshape", "convert"}


def _source(module: Module, comp: Computation, name: str,
            entered: tuple[tuple[Computation, Instr], ...] = (),
            through: frozenset[str] = frozenset(_FORWARDING),
            ) -> tuple[Computation, Instr | None, tuple[tuple[Computation, Instr], ...]]:
    """The instruction producing `name`, read back through `through` ops and fusion boundaries.

    `entered`: the fusions stepped into, outermost first.
    """
    for _ in range(64):
        instr = comp.instrs.get(name)
        if instr is None:
            return comp, None, entered
        if instr.opcode in through and instr.operands:
            name = instr.operands[0]
        elif instr.opcode == "fusion" and (callee := _callee(module, instr)) and callee.root:
            comp, name, entered = callee, callee.root, (*entered, (comp, instr))
        elif instr.opcode == "parameter" and entered:
            number = int(instr.operands[0])
            outer, fusion = entered[-1]
            if number >= len(fusion.operands):
                return comp, None, entered
            comp, name, entered = outer, fusion.operands[number], entered[:-1]
        else:
            return comp, instr, entered
    return comp, None, entered


def _is_zero(module: Module, comp: Computation, name: str,
             entered: tuple[tuple[Computation, Instr], ...]) -> bool:
    comp, instr, _ = _source(module, comp, name, entered, frozenset(_FORWARDING | {"broadcast"}))
    if instr is None or instr.opcode != "constant" or not instr.operands:
        return False
    try:
        return float(instr.operands[0]) == 0
    except ValueError:  # an array literal `{...}`: not worth reading
        return False


def _is_padded_shard(module: Module, comp: Computation, name: str, n: int) -> bool:
    """Is `name` a `dynamic-update-slice` of 1/n of its elements into zeros?

    An all-gather spelled as a sum (docs/jax-notes.md, "How compiled HLO spells collectives"). On
    TPU usually fused; offsets are not checked.
    """
    comp, instr, entered = _source(module, comp, name)
    if instr is None or instr.opcode != "dynamic-update-slice" or len(instr.operands) < 2:
        return False
    full = instr.arrays[0].elements if instr.arrays else 0
    update = operand_arrays(comp, instr, 1)
    if not full or not update or update[0].elements * n != full:
        return False
    return _is_zero(module, comp, instr.operands[0], entered)


def _split_combined(
    comp: Computation, instr: Instr, kinds: dict[int, str], n: int, axes: tuple[str, ...]
) -> list[Collective]:
    """One logical collective per kind among an all-reduce's elements.

    `kinds`: element -> 'all-gather', 'reduce-scatter' or 'all-reduce'. A mixed combined all-reduce
    is split.
    """
    out = []
    whole = len(set(kinds.values())) == 1
    for kind in ("all-gather", "reduce-scatter", "all-reduce"):
        elements = sorted(i for i, k in kinds.items() if k == kind)
        if not elements:
            continue
        if kind == "all-gather":
            # The gathered result, in the all-reduce's result dtype (TPU may sum f32 shards
            # into a bf16 result: the cast to bf16 for the matmul, moved into the collective).
            results = instr.arrays if len(instr.arrays) == len(instr.operands) else None
            arrays = [a for i in elements
                      for a in ((results[i],) if results else operand_arrays(comp, instr, i))]
        else:
            arrays = [a for i in elements for a in operand_arrays(comp, instr, i)]
        payload = sum(a.bytes for a in arrays)
        lowered_as = {"all-gather": f"{instr.opcode}+dynamic-update-slice",
                      "reduce-scatter": f"{instr.opcode}+dynamic-slice",
                      "all-reduce": instr.opcode}[kind]
        out.append(
            Collective(
                kind=kind,
                lowered_as=lowered_as,
                name=instr.name if whole else f"{instr.name}[{','.join(map(str, elements))}]",
                dtype=_dtypes(arrays),
                bytes=payload,
                wire_bytes=wire_bytes(kind, lowered_as, payload, n),
                group_size=n,
                axes=axes,
            )
        )
    return out


def _callee(module: Module, instr: Instr) -> Computation | None:
    called = attr(instr, "calls")
    return module.computations.get(called.lstrip("%")) if called else None


def _is_tpu_reduce_scatter_fusion(module: Module, instr: Instr) -> bool:
    called = attr(instr, "calls") or ""
    return (
        instr.opcode == "fusion"
        and called.lstrip("%").startswith("all-reduce-scatter")
        and called.lstrip("%") in module.computations
    )


def _payload_bytes(comp: Computation, instr: Instr, base: str) -> tuple[int, str]:
    """Bytes and dtype an instruction sends, from its operands (never its `-start` tuple result)."""
    indices = range(len(instr.operands))
    if base == "ragged-all-to-all":
        # (input, output, offsets and sizes...). The sizes are data, so what travels is not
        # in the text: a device sends at most its input buffer and receives at most its output
        # buffer, and all devices together send what they receive, so on average a device
        # moves at most the smaller of the two (one of them is sized for the worst case).
        sent, received = (operand_arrays(comp, instr, i) for i in (0, 1))
        smaller = min(sent, received, key=lambda arrays: sum(a.bytes for a in arrays))
        return sum(a.bytes for a in smaller), _dtypes(smaller)
    if base == "collective-permute" and "slice_sizes=" in instr.attrs:
        indices = range(1)  # in-place form (input, output, input/output start indices)
    arrays = [a for i in indices for a in operand_arrays(comp, instr, i)]
    return sum(a.bytes for a in arrays), _dtypes(arrays)


def _dtypes(arrays: list) -> str:
    """The arrays' dtypes, most bytes first (ties: first seen), '+'-joined."""
    total: dict[str, int] = {}
    for a in arrays:
        total[a.dtype] = total.get(a.dtype, 0) + a.bytes
    return "+".join(sorted(total, key=lambda d: -total[d]))


def wire_bytes(kind: str, lowered_as: str, payload: int, n: int) -> int:
    """What one device sends for a collective of ``kind`` over ``n`` devices (Collective)."""
    if n <= 1:
        return 0
    if kind == "collective-permute":
        return payload
    if kind == "all-reduce" or lowered_as.endswith(("+dynamic-slice", "+dynamic-update-slice")):
        return payload * 2 * (n - 1) // n  # reduce-scatter + all-gather ring
    return payload * (n - 1) // n


def _tpu_reduce_scatter(
    module: Module,
    comp: Computation,
    fusion: Instr,
    mesh: MeshIds,
    layout: ReplicaPartitionLayout,
) -> Collective:
    callee = _callee(module, fusion)
    inner = next(
        (i for i in callee.instrs.values() if i.opcode.removesuffix("-start") == "all-reduce"),
        None,
    )
    if inner is not None:
        payload, dtype = _payload_bytes(callee, inner, "all-reduce")
        groups = flattened_groups(inner, attr_groups(inner), layout, mesh)
        n, axes = group_axes(mesh, groups)
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
        wire_bytes=wire_bytes("reduce-scatter", lowered_as, payload, n),
        group_size=n,
        axes=axes,
    )


def _collectives_of(module: Module, comp: Computation, instr: Instr, base: str, mesh: MeshIds,
                    layout: ReplicaPartitionLayout) -> list[Collective]:
    """The logical collective(s) of one instruction of opcode ``base`` (or ``base-start``).

    Its payload, its groups' mesh axes, and what XLA:CPU's all-reduce + dynamic-slice really is.
    """
    payload, dtype = _payload_bytes(comp, instr, base)
    if base == "collective-permute":
        pairs = permute_pairs(instr, layout, mesh)
        n, axes = permute_axes(mesh, pairs)
    else:
        groups = flattened_groups(instr, attr_groups(instr), layout, mesh)
        n, axes = group_axes(mesh, groups)
    kind, lowered_as = base, instr.opcode
    if base == "all-reduce" and n > 1:
        # XLA's combiner merges reductions that are logically different into one all-reduce:
        # each element is judged on its own (zero-padded shards first: a gathered weight that
        # is then sliced is still a gather), and a mixed one is split.
        padded = _padded_elements(module, comp, instr, n)
        sliced = _sliced_elements(module, comp, instr, n) - padded
        if padded or sliced:
            kinds = {i: "all-gather" if i in padded else
                     "reduce-scatter" if i in sliced else "all-reduce"
                     for i in range(len(instr.operands))}
            return _split_combined(comp, instr, kinds, n, axes)
    if base == "all-gather":
        payload *= n  # the gathered result
    return [Collective(kind=kind, lowered_as=lowered_as, name=instr.name, dtype=dtype,
                       bytes=payload, wire_bytes=wire_bytes(kind, lowered_as, payload, n),
                       group_size=n, axes=axes)]


def parse_collectives(
    hlo_text: str,
    mesh_shape: Mapping[str, int] | Sequence[tuple[str, int]],
    device_ids: Sequence[int] | None = None,
) -> list[Collective]:
    """The collectives of a compiled HLO module, in text order, mapped onto `mesh_shape`.

    `mesh_shape`: `dict(mesh.shape)`. `device_ids`: `[d.id for d in mesh.devices.flat]` (default
    `range(n)`), needed only for physical ids. A conditional's branch counts as run on every call.
    """
    mesh = as_mesh(mesh_shape, device_ids)
    module = parse_module(hlo_text)
    replicas = module.replica_count or 1
    partitions = module.num_partitions or max(1, mesh.size // replicas)
    if replicas * partitions != mesh.size:
        raise ValueError(
            f"HLO is for {replicas} replicas x {partitions} partitions, mesh has {mesh.size}"
        )
    declared = module.replica_count is not None or module.num_partitions is not None
    layout = ReplicaPartitionLayout(replicas, partitions, declared)

    # TPU's all-reduce-scatter fusions are reported whole; their inner all-reduce is not.
    fused_reduce_scatters = {
        _callee(module, instr).name
        for comp in module.computations.values()
        for instr in comp.instrs.values()
        if _is_tpu_reduce_scatter_fusion(module, instr)
    }

    runs = computation_runs(module)
    fused = {(attr(i, "calls") or "").lstrip("%") for c in module.computations.values()
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
            channel = attr(instr, "channel_id")
            if channel is not None and comp.name in fused:
                if (base, channel) in counted_channels:
                    continue  # another placement of a collective already counted (TPU async)
                counted_channels.add((base, channel))
            found.extend(_collectives_of(module, comp, instr, base, mesh, layout))
        found[in_this_computation:] = [dataclasses.replace(c, executions=runs[comp.name])
                                       for c in found[in_this_computation:]]
    return found


def summarize_collectives(cs: Sequence[Collective]) -> list[dict]:
    """One row per (kind, axes), sorted: the `collectives` of inspect --json.

    Over several slices, per (kind, axes, network). `count`, `bytes`, `wire_bytes` are per step;
    `instructions` counts the program text's.
    """
    rows: dict[tuple[str, tuple[str, ...], str], dict] = {}
    for c in cs:
        row = rows.setdefault(
            (c.kind, c.axes, c.network or ""),
            {
                "kind": c.kind,
                "count": 0,
                "instructions": 0,
                "bytes": 0,
                "wire_bytes": 0,
                "axes": list(c.axes),
                "lowered_as": set(),
                "dtypes": set(),
            },
        )
        if c.network is not None:
            row["network"] = c.network
        row["count"] += c.executions
        row["instructions"] += 1
        row["bytes"] += c.bytes * c.executions
        row["wire_bytes"] += c.wire_bytes * c.executions
        row["lowered_as"].add(c.lowered_as)
        row["dtypes"].update(d for d in c.dtype.split("+") if d)
    for row in rows.values():
        row["lowered_as"] = sorted(row["lowered_as"])
        row["dtypes"] = sorted(row["dtypes"])
        # Averages over pipeline stages can be fractional; JSON keeps whole numbers.
        for key in ("count", "bytes", "wire_bytes"):
            row[key] = round(row[key])
    return [rows[key] for key in sorted(rows)]
