"""The data-center network's part of a program compiled for several TPU slices.

For ``inspect --target ... --slices N`` and ``mesh.dcn``. The TPU compiler compiles one program per
slice. A sum or gather over slices becomes an in-slice collective plus a host ``send`` to the
"megascale" runtime. Each such ``send`` is read as one collective over the slices, counted per step
(:func:`jaxpar.inspect.hlo.text.computation_runs`). The spelling: docs/jax-notes.md, "How compiled
HLO spells collectives".
"""

from __future__ import annotations

import re

from jaxpar.inspect.hlo.collectives import Collective, wire_bytes
from jaxpar.inspect.hlo.text import Module, computation_runs, operand_arrays, parse_module

_TRANSFER = re.compile(r'_xla_megascale_transfer_type="(?P<kind>[A-Z_]+)"')
_SEND = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=.*?\bsend\(")
# The megascale runtime's transfer types (docs/jax-notes.md, "How compiled HLO spells
# collectives") -> collective kinds.
_KINDS = {"ALL_REDUCE": "all-reduce", "ALL_GATHER": "all-gather",
          "REDUCE_SCATTER": "reduce-scatter", "ALL_TO_ALL": "all-to-all"}


def program_partitions(hlo_text: str) -> int | None:
    """The module's ``num_partitions`` (None when the text does not say)."""
    return parse_module(hlo_text).num_partitions


def dcn_collectives(hlo_text: str, axes: tuple[str, ...], slices: int) -> list[Collective]:
    """The collectives over slices of a per-slice program."""
    module = parse_module(hlo_text)
    runs = computation_runs(module)
    found = []
    for line in hlo_text.splitlines():
        kind, send = _TRANSFER.search(line), _SEND.match(line)
        if not (kind and send and "is_host_transfer=true" in line):
            continue
        comp = _owner(module, send.group("name"))
        if comp is None:
            continue
        instr = module.computations[comp].instrs[send.group("name")]
        arrays = operand_arrays(module.computations[comp], instr, 0)
        payload = sum(a.bytes for a in arrays)
        name = _KINDS.get(kind.group("kind"), kind.group("kind").lower().replace("_", "-"))
        found.append(Collective(
            kind=name, lowered_as=f"megascale {kind.group('kind')}", name=instr.name,
            dtype="+".join(sorted({a.dtype for a in arrays})), bytes=payload,
            wire_bytes=wire_bytes(name, name, payload, slices), group_size=slices, axes=axes,
            executions=runs[comp]))
    return found


def _owner(module: Module, name: str) -> str | None:
    return next((c.name for c in module.computations.values() if name in c.instrs), None)
