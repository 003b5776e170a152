"""What the optimizer step adds beyond the state: Muon's Newton-Schulz iterations.

``train.optimizer=muon`` runs :data:`~jaxpar.parallel.optimizer_state.MUON_NS_STEPS`
iterations on each stacked matrix's momentum, whole. The step gathers it
(:func:`jaxpar.parallel.optimizer_state.muon_specs`) over every axis but ``tensor``, then over
``tensor``; each device iterates on every matrix it holds (other axes repeat the work) and
keeps its slice.

Per Muon parameter, step and device: one float32 all-gather per stage, its payload the
result; per ``m x n`` matrix held (m <= n) and iteration, ``X X^T`` (2 m^2 n), ``A A``
(2 m^3) and ``B X`` (2 m^2 n) matmul flops, elementwise work left out. Memory: gathered
matrices, results and copies beside the gradients (``update_bytes``). Owner-computes and
the rest: docs/optimizers.md, "What Muon's Newton-Schulz iterations cost under sharding".
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from jaxpar.config import MESH_AXES, Config
from jaxpar.cost.ledger import EXPOSED, Ledger
from jaxpar.cost.params import PARAM_BYTES, ParamCost, entry_axes, model_params
from jaxpar.parallel.optimizer_state import (
    MUON_BATCH_AXES,
    MUON_NS_STEPS,
    muon_layout,
    muon_matrix_axes,
)
from jaxpar.parallel.rules import logical_rules, split_names


@dataclass(frozen=True)
class MuonMatrix:
    """One Muon parameter's Newton-Schulz work on one device."""

    name: str
    gathers: tuple[tuple[tuple[str, ...], int], ...]  # (axes, gathered bytes) per stage
    batch: int  # matrices this device iterates on (its layers x experts)
    m: int  # the short side
    n: int  # the long side
    # Owner-computes: (axes, payload) of the all-to-alls there and back.
    exchanges: tuple[tuple[tuple[str, ...], int], ...] = ()

    @property
    def flops(self) -> int:
        """Matmul flops of all the iterations on this device's matrices."""
        m, n = self.m, self.n
        return self.batch * MUON_NS_STEPS * (4 * m * m * n + 2 * m ** 3)

    @property
    def whole_bytes(self) -> int:
        """The float32 matrices as iterated (the last gather's result)."""
        return self.batch * self.m * self.n * PARAM_BYTES


def _axes(spec: tuple, mesh: Mapping[str, int]) -> set[str]:
    return {a for e in spec for a in entry_axes(e) if mesh[a] > 1}


def muon_matrices(cfg: Config, params: list[ParamCost]) -> list[MuonMatrix]:
    """Every Muon parameter's gathers and iterations per device (none for other optimizers)."""
    if cfg.train.optimizer != "muon":
        return []
    mesh, rules = cfg.mesh_shape, logical_rules(cfg)
    trained = {p.name: p for p in params if p.trained}
    out = []
    for shape in model_params(cfg.model, cfg.train.lora if cfg.train.lora.rank > 0 else None,
                              cfg.vocab_rows()):
        p = trained.get(shape.name)
        names = split_names(shape.name, shape.names)
        axes = muon_matrix_axes(shape.name, shape.names)
        if p is None or axes is None:
            continue
        layout = muon_layout(shape.name, shape.names, rules, mesh, cfg.parallel.zero)
        rows, cols = (math.prod(shape.shape[i] for i in side) for side in axes)
        if layout.owners:
            out.append(_owner_matrix(shape.name, shape.shape, names, p, layout.owners, mesh,
                                     min(rows, cols), max(rows, cols)))
            continue
        stages = layout.stages
        size = math.prod(shape.shape) * PARAM_BYTES
        # The momentum starts in its moment layout (ZeRO-1: embed also over data x fsdp).
        held = _axes(p.moment_spec, mesh)
        gathers = []
        for spec in stages:
            kept = _axes(tuple(spec), mesh)
            gone = tuple(a for a in MESH_AXES if a in held - kept)
            if gone:
                gathers.append((gone, size // math.prod(mesh[a] for a in kept)))
            held = kept
        batch = math.prod(d for d, n in zip(shape.shape, names, strict=True)
                          if n in MUON_BATCH_AXES) // math.prod(mesh[a] for a in held)
        out.append(MuonMatrix(shape.name, tuple(gathers), batch, min(rows, cols),
                              max(rows, cols)))
    return out


def _owner_matrix(name: str, shape: tuple[int, ...], names: tuple, p: ParamCost,
                  owners: tuple[str, ...], mesh: Mapping[str, int], m: int, n: int
                  ) -> MuonMatrix:
    """Owner-computes: B local entries padded to c k for k owners, c iterated here; each
    all-to-all carries the padded local block."""
    local_batch = math.prod(d for d, a in zip(shape, names, strict=True)
                            if a in MUON_BATCH_AXES)
    local_batch //= math.prod(mesh[a] for e, a2 in zip(p.spec, names, strict=False)
                              if a2 in MUON_BATCH_AXES for a in entry_axes(e))
    k = math.prod(mesh[a] for a in owners)
    c = -(-local_batch // k)
    payload = p.bytes_per_device // local_batch * c * k
    return MuonMatrix(name, (), c, m, n, exchanges=((owners, payload), (owners, payload)))


def muon_collectives(c: Ledger) -> None:
    """Muon's momentum gathers, or owner-computes exchanges: a row per kind and axes."""
    rows: dict[tuple[str, tuple[str, ...]], list[int]] = {}
    for matrix in muon_matrices(c.st.cfg, c.params):
        for kind, moves in (("all-gather", matrix.gathers), ("all-to-all", matrix.exchanges)):
            for axes, nbytes in moves:
                rows.setdefault((kind, axes), []).append(nbytes)
    what = {"all-gather": "Muon: momentum gathered whole for the Newton-Schulz iterations, "
                          "once per step",
            "all-to-all": "Muon: matrices to their owners' devices and the results back "
                          "(owner-computes), once per step"}
    for (kind, axes), sizes in rows.items():
        c.add(kind, axes, len(sizes), sum(sizes), what[kind], EXPOSED)


def muon_flops(cfg: Config, params: list[ParamCost]) -> float:
    """Newton-Schulz matmul flops per device per step."""
    return float(sum(m.flops for m in muon_matrices(cfg, params)))


# XLA:CPU schedules every gather before the iterations and keeps, beside the gathered
# momentum, each matrix's whole result until it is sliced and more copies in between: the
# compiled peak's update phase is 2.3-2.7x the gathered matrices on top of the moments'
# temporaries (tiny at d_model 256, d_ff 1024, 4, 8 and 16 layers, fsdp=8 and data=2 x fsdp=2
# x tensor=2; the GPU/TPU compilers' schedules are not measured).
GATHERED_COPIES = 2.5


# Owner-computes: the padded local blocks sent and received, the matrices assembled, their
# results and the pieces sent back are all alive at once: 5x one exchange's payload (tiny at
# d_model 256, d_ff 1024, 8 and 16 layers, fsdp=8).
OWNER_COPIES = 1


def update_bytes(cfg: Config, params: list[ParamCost]) -> int:
    """Muon's update working set beyond the moments' temporaries: the gathered matrices
    :data:`GATHERED_COPIES` times; owner-computes: :data:`OWNER_COPIES` exchange payloads."""
    total = 0.0
    for m in muon_matrices(cfg, params):
        total += (OWNER_COPIES * m.exchanges[0][1] if m.exchanges
                  else GATHERED_COPIES * m.whole_bytes)
    return round(total)
