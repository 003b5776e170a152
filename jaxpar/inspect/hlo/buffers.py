"""The largest arrays a compiled program materialises: what its temp memory is made of.

The shapes say *what* the biggest buffers are: ``f32[..., S, S]`` scores, ``[tokens, vocab]`` logits
or a one-hot. Which results count as buffers: docs/inspect.md, "Reading collectives".
"""

from __future__ import annotations

import re
from typing import Any

from jaxpar.inspect.hlo.text import Array, parse_module

NOT_BUFFERS = frozenset({"parameter", "bitcast", "get-tuple-element", "tuple", "constant"})
_CALLS_RE = re.compile(r"\bcalls=%?([\w.\-]+)")


def largest_arrays(hlo: str, count: int = 3) -> list[dict[str, Any]]:
    """The ``count`` largest array shapes the program's instructions produce, biggest first.

    ``{"array": "f32[2,2048,2048]", "bytes": ..., "instructions": n, "opcode": ...}``.
    """
    module = parse_module(hlo)
    fused = {m.group(1) for comp in module.computations.values()
             for instr in comp.instrs.values() if instr.opcode == "fusion"
             for m in _CALLS_RE.finditer(instr.attrs)}
    found: dict[Array, dict[str, Any]] = {}
    for name, comp in module.computations.items():
        if name in fused:
            continue
        for instr in comp.instrs.values():
            if instr.opcode in NOT_BUFFERS:
                continue
            for array in instr.arrays:
                row = found.setdefault(array, {"array": _text(array), "bytes": array.bytes,
                                               "instructions": 0, "opcode": instr.opcode})
                row["instructions"] += 1
    return sorted(found.values(), key=lambda row: -row["bytes"])[:count]


def _text(array: Array) -> str:
    return f"{array.dtype}[{','.join(map(str, array.dims))}]"
