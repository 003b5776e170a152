"""Replica groups of compiled HLO, mapped onto the user's mesh: which mesh axes a collective spans.

Every spelling (lists, `{}`, iota, named meshes) is expanded to explicit groups. In an SPMD program
the ids are positions in ``mesh.devices.flat``, so id `i` is the mesh coordinate `unravel_index(i,
mesh shape)`. `device_ids` is used only for physical ids. Why: docs/jax-notes.md, "How compiled HLO
spells collectives".
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from jaxpar.inspect.hlo.text import Instr, attr, split_balanced

# --------------------------------------------------------------------------------------------
# The user's mesh: logical ids -> coordinates -> axes
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MeshIds:
    names: tuple[str, ...]
    sizes: tuple[int, ...]
    device_ids: tuple[int, ...]

    @property
    def size(self) -> int:
        return math.prod(self.sizes)

    def physical_positions(self, id_lists: list[list[int]]) -> list[list[int]] | None:
        """Positions of the ids if they can only be physical device ids, else None.

        An id outside range(n) means physical ids; all are then looked up in device_ids.
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


def as_mesh(
    mesh_shape: Mapping[str, int] | Sequence[tuple[str, int]], device_ids: Sequence[int] | None
) -> MeshIds:
    items = list(mesh_shape.items()) if isinstance(mesh_shape, Mapping) else list(mesh_shape)
    names = tuple(str(name) for name, _ in items)
    sizes = tuple(int(size) for _, size in items)
    n = math.prod(sizes)
    ids = tuple(range(n)) if device_ids is None else tuple(int(d) for d in device_ids)
    if len(ids) != n:
        raise ValueError(f"{len(ids)} device ids for a mesh of {n} devices")
    return MeshIds(names, sizes, ids)


def group_axes(mesh: MeshIds, groups: list[list[int]]) -> tuple[int, tuple[str, ...]]:
    axes: set[int] = set()
    for group in groups:
        axes |= mesh.axes_between(mesh.positions(group))
    return max(len(g) for g in groups), mesh.named(axes)


def permute_axes(mesh: MeshIds, pairs: list[list[int]]) -> tuple[int, tuple[str, ...]]:
    """Axes along which sources and targets differ; group = largest connected set."""
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
# mesh['axis_0'=2,'axis_1'=4], device_ids=(...) {'axis_0','axis_1':(1)2}, and the spelling
# `@mesh<a=2,b=4> {a}` of other XLA versions (docs/jax-notes.md).
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
    """Expand a named-mesh replica group list as XLA's MeshAxesReplicaGroupList does."""
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


def parse_groups(text: str) -> list[list[int]] | None:
    """Groups of ids from a `replica_groups=` value; None for `{}` (all participants)."""
    if m := _MESH_RE.match(text):
        return _mesh_groups(m)
    if m := _IOTA_RE.match(text):
        dims, reshape = _ints(m.group(1)), _ints(m.group(2))
        perm = _ints(m.group(3)) if m.group(3) else None
        return _iota(dims, reshape, perm).tolist()
    inner, _ = split_balanced(text[1:])  # text starts with the outer `{`
    groups = [_ints(g) for g in re.findall(r"\{([^{}]*)\}", inner)]
    return groups or None


def attr_groups(instr: Instr) -> list[list[int]] | None:
    start = instr.attrs.find("replica_groups=")
    if start < 0:
        return None
    return parse_groups(instr.attrs[start + len("replica_groups=") :].lstrip())


@dataclass(frozen=True)
class ReplicaPartitionLayout:
    """How the module's flattened ids decompose: replica * partitions + partition."""

    replicas: int
    partitions: int
    declared: bool  # the HloModule line said so; hand-written snippets often don't


def flattened_groups(
    instr: Instr, groups: list[list[int]] | None, layout: ReplicaPartitionLayout, mesh: MeshIds
) -> list[list[int]]:
    """Groups as flattened ids (replica * partitions + partition), per XLA's group modes."""
    if groups and (physical := mesh.physical_positions(groups)) is not None:
        return physical
    replicas, partitions = layout.replicas, layout.partitions
    has_channel = attr(instr, "channel_id") is not None
    global_ids = attr(instr, "use_global_device_ids") == "true"
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


def permute_pairs(instr: Instr, layout: ReplicaPartitionLayout, mesh: MeshIds) -> list[list[int]]:
    start = instr.attrs.find("source_target_pairs=")
    if start < 0:
        return []
    inner, _ = split_balanced(instr.attrs[start + len("source_target_pairs=") + 1 :])
    pairs = [_ints(p) for p in re.findall(r"\{([^{}]*)\}", inner)]
    if (physical := mesh.physical_positions(pairs)) is not None:
        return physical
    replicas, partitions = layout.replicas, layout.partitions
    if not layout.declared:
        return pairs
    if attr(instr, "channel_id") is not None:  # partition ids, within each replica
        return [[r * partitions + s, r * partitions + t] for r in range(replicas) for s, t in pairs]
    return [[s * partitions + p, t * partitions + p] for p in range(partitions) for s, t in pairs]
