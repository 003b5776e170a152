"""What the optimizer step adds beyond the state: Muon's Newton-Schulz iterations.

``train.optimizer=muon`` orthogonalises each stacked layer matrix's momentum by
:data:`~jaxpar.parallel.optimizer_state.MUON_NS_STEPS` Newton-Schulz iterations, which need
the whole matrix: the step gathers the momentum (:func:`jaxpar.parallel.optimizer_state.muon_specs`)
first over every axis but ``tensor`` (``fsdp``; ZeRO-1's ``data`` x ``fsdp``), then over
``tensor``, iterates on every matrix a device holds (its pipeline stage's layers, its expert
shard's experts: the other axes repeat the same work), and keeps its slice of the result.

Per Muon parameter, once per step, per device: one all-gather per stage over the axes it
removes, its payload the gathered result (float32: the update is computed in float32); and,
for each of the ``batch`` matrices held (``m x n``, m <= n: optax iterates on the wide
orientation), per iteration ``A = X X^T`` (2 m^2 n), ``A A`` (2 m^3) and ``B X`` (2 m^2 n)
matmul flops. The elementwise work (the Frobenius normalisation, ``b A + c A A``, ``a X +
B X``) is left out, as for the model's flops. Memory: the gathered matrices, their results
and the iterations' copies live beside the gradients during the update (``update_bytes``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from jaxpar.config import MESH_AXES, Config
from jaxpar.cost.ledger import Ledger
from jaxpar.cost.params import PARAM_BYTES, ParamCost, entry_axes, model_params
from jaxpar.parallel.optimizer_state import (
    MUON_BATCH_AXES,
    MUON_NS_STEPS,
    muon_matrix_axes,
    muon_specs,
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

    @property
    def flops(self) -> int:
        """Matmul flops of all the iterations on this device's matrices."""
        m, n = self.m, self.n
        return self.batch * MUON_NS_STEPS * (4 * m * m * n + 2 * m ** 3)

    @property
    def whole_bytes(self) -> int:
        """The float32 matrices as the iterations read them (the last gather's result)."""
        return self.batch * self.m * self.n * PARAM_BYTES


def _axes(spec: tuple, mesh: Mapping[str, int]) -> set[str]:
    return {a for e in spec for a in entry_axes(e) if mesh[a] > 1}


def muon_matrices(cfg: Config, params: list[ParamCost]) -> list[MuonMatrix]:
    """Every Muon parameter's gathers and iterations, per device (none for other optimizers)."""
    if cfg.train.optimizer != "muon":
        return []
    mesh, rules = cfg.mesh_shape, logical_rules(cfg)
    trained = {p.name: p for p in params if p.trained}
    out = []
    for shape in model_params(cfg.model, cfg.train.lora if cfg.train.lora.rank > 0 else None):
        p = trained.get(shape.name)
        names = split_names(shape.name, shape.names)
        axes = muon_matrix_axes(shape.name, shape.names)
        if p is None or axes is None:
            continue
        stages = muon_specs(shape.name, shape.names, rules, mesh)
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
        rows, cols = (math.prod(shape.shape[i] for i in side) for side in axes)
        out.append(MuonMatrix(shape.name, tuple(gathers), batch, min(rows, cols),
                              max(rows, cols)))
    return out


def muon_collectives(c: Ledger) -> None:
    """Muon's gathers of the momentum before the iterations: one row per set of axes."""
    by_axes: dict[tuple[str, ...], list[int]] = {}
    for matrix in muon_matrices(c.st.cfg, c.params):
        for axes, nbytes in matrix.gathers:
            by_axes.setdefault(axes, []).append(nbytes)
    for axes, sizes in by_axes.items():
        c.add("all-gather", axes, len(sizes), sum(sizes),
              "Muon: momentum gathered whole for the Newton-Schulz iterations, once per step",
              False)


def muon_flops(cfg: Config, params: list[ParamCost]) -> float:
    """Newton-Schulz matmul flops per device per step."""
    return float(sum(m.flops for m in muon_matrices(cfg, params)))


# XLA:CPU schedules every gather before the iterations and keeps, beside the gathered
# momentum, each matrix's whole result until it is sliced and more copies in between: the
# compiled peak's update phase is 2.3-2.7x the gathered matrices on top of the moments'
# temporaries (tiny at d_model 256, d_ff 1024, 4, 8 and 16 layers, fsdp=8 and data=2 x fsdp=2
# x tensor=2; the GPU/TPU compilers' schedules are not measured).
GATHERED_COPIES = 2.5


def update_bytes(cfg: Config, params: list[ParamCost]) -> int:
    """Muon's working set during the update beyond the moments' temporaries: the gathered
    matrices, :data:`GATHERED_COPIES` times over."""
    return round(GATHERED_COPIES * sum(m.whole_bytes for m in muon_matrices(cfg, params)))
