"""The optimizer state's layout, without optax: Muon's matrices, each ``train.optimizer``'s
per-parameter array shapes, and their splits. The optimizers and the cost model
(:mod:`jaxpar.cost.params`) both read it, so ``jaxpar plan`` counts the state the step builds
(checked by ``tests/unit/test_optimizer_setup.py``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from jax.sharding import PartitionSpec

from jaxpar.parallel.rules import MODEL_DIMS, resolve_spec, split_names

# Axes that are a batch of independent matrices to Muon: the scanned layers, the routed experts.
MUON_BATCH_AXES = frozenset({"layers", "experts"})
MUON_NS_STEPS = 5  # Newton-Schulz iterations per Muon update (optax's default)
ADAFACTOR_MIN_DIM = 128  # optax.adafactor's min_dim_size_to_factor (its default)
STATE_BYTES = {"float32": 4, "bfloat16": 2}  # train.opt_state_dtype


def muon_matrix_axes(name: str, names: Sequence[str | None]
                     ) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(reduction, output) axes of a stacked layer weight for Muon, or None (AdamW's). Layers and
    experts are batch axes. A weight ending in ``embed`` (``wo``, ``w_down``) maps all other axes
    to it; any other maps its first axis to the rest."""
    if not names or names[0] != "layers" or name.rsplit("/", 1)[-1] in ("scale", "router"):
        return None
    matrix = [i for i, n in enumerate(names) if n not in MUON_BATCH_AXES]
    if len(matrix) < 2:
        return None
    split = len(matrix) - 1 if names[matrix[-1]] in MODEL_DIMS else 1
    return tuple(matrix[:split]), tuple(matrix[split:])


def adafactor_factored_dims(shape: Sequence[int]) -> tuple[int, int] | None:
    """The two dims adafactor factors the second moment over; None: unfactored."""
    if len(shape) < 2:
        return None
    order = sorted(range(len(shape)), key=lambda i: (shape[i], i))
    if shape[order[-2]] < ADAFACTOR_MIN_DIM:
        return None
    return order[-2], order[-1]


def state_shapes(optimizer: str, name: str, shape: tuple[int, ...],
                 names: Sequence[str | None]) -> list[tuple[int, ...]]:
    """The shapes of the optimizer-state arrays one parameter adds (step counters aside)."""
    if optimizer == "adamw":
        return [shape, shape]
    if optimizer == "lion":
        return [shape]
    if optimizer == "muon":
        return [shape] if muon_matrix_axes(name, names) is not None else [shape, shape]
    if optimizer == "adafactor":
        dims = adafactor_factored_dims(shape)
        if dims is None:  # v_row, v_col placeholders, then the full v
            return [(1,), (1,), shape]
        d1, d0 = dims
        return [tuple(s for i, s in enumerate(shape) if i != d0),
                tuple(s for i, s in enumerate(shape) if i != d1), (1,)]
    raise ValueError(f"unknown optimizer {optimizer}")


def state_counters(optimizer: str, weight_decay: float) -> int:
    """Bytes of non-per-parameter state: int32 step counts, Muon's three float32 Newton-Schulz
    coefficients."""
    if optimizer == "muon":
        return 4 * 4 + 3 * 4
    return 3 * 4 if optimizer == "adafactor" and weight_decay else 2 * 4


def state_spec(param_shape: tuple[int, ...], spec: Any, shape: tuple[int, ...]) -> PartitionSpec:
    """Spec of a state array of ``shape`` for a parameter of ``param_shape`` split by ``spec``:
    the parameter's, less a dim for Adafactor's factors, else replicated (as the cost model)."""
    entries = list(spec) + [None] * (len(param_shape) - len(spec))
    if tuple(shape) == tuple(param_shape):
        return PartitionSpec(*entries)
    if len(shape) == len(param_shape) - 1:
        for d in range(len(param_shape)):
            if param_shape[:d] + param_shape[d + 1:] == tuple(shape):
                return PartitionSpec(*(entries[:d] + entries[d + 1:]))
    return PartitionSpec()



def muon_specs(name: str, names: Sequence[str | None], rules: Mapping[str, Sequence[str]],
               mesh_shape: Mapping[str, int]) -> tuple[PartitionSpec, ...] | None:
    """Layouts one parameter's momentum passes through before Muon's iterations (None: not Muon),
    ending whole where the matrices are held. Where ``tensor`` splits a matrix axis the gather is
    two-stage, ``tensor`` last (larger gather on the faster link; docs/optimizers.md)."""
    if muon_matrix_axes(name, names) is None:
        return None
    split = split_names(name, names)  # a pipeline's dense first blocks: not cut into stages

    def spec(keep: Any) -> PartitionSpec:
        entries: list[Any] = []
        for n in split:
            axes = tuple(a for a in rules.get(n, ()) if mesh_shape.get(a, 1) > 1
                         and (n in MUON_BATCH_AXES or keep(a)))
            entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
        return PartitionSpec(*entries)

    first, whole = spec(lambda a: a == "tensor"), spec(lambda a: False)
    return (whole,) if first == whole else (first, whole)


class MuonLayout(NamedTuple):
    """Layout of one Muon parameter's Newton-Schulz iterations. ``owners`` empty: momentum
    gathered whole through ``stages``. Else owner-computes: an all-to-all over ``owners`` gives
    each device whole matrices to iterate, then sends them back."""

    stages: tuple[PartitionSpec, ...]
    held: PartitionSpec
    owners: tuple[str, ...]


def muon_layout(name: str, names: Sequence[str | None], rules: Mapping[str, Sequence[str]],
                mesh_shape: Mapping[str, int], zero: int) -> MuonLayout | None:
    """One parameter's :class:`MuonLayout` (None: not Muon): owner-computes where the momentum is
    split like the parameter (ZeRO-3) and its batch axes lead."""
    stages = muon_specs(name, names, rules, mesh_shape)
    if stages is None:
        return None
    split = split_names(name, names)
    held = resolve_spec(name, split, None, rules, mesh_shape)
    entries = list(held) + [None] * (len(names) - len(held))
    batch = [n in MUON_BATCH_AXES for n in names]
    owners: tuple[str, ...] = ()
    if zero == 3 and batch == sorted(batch, reverse=True):
        in_matrix = {a for e, b in zip(entries, batch, strict=True) if not b
                     for a in ((e,) if isinstance(e, str) else e or ())}
        owners = tuple(a for a in mesh_shape if a in in_matrix)
    return MuonLayout(stages, PartitionSpec(*entries), owners)
