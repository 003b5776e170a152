"""Matmul flops of a compiled program, counted per execution (loop trip counts included).

``cost_analysis()['flops']`` counts a loop body once, so this walks the optimized HLO instead: each
``dot`` and ``convolution``, times how often its computation runs. A conditional counts as its
costliest branch, so skipped attention blocks are counted. The rules: docs/inspect.md, "Reading
collectives".
"""

from __future__ import annotations

import math
import re

from jaxpar.inspect.hlo.text import (
    Computation,
    Instr,
    Module,
    attr,
    called,
    operand_arrays,
    parse_module,
)

_WINDOW_RE = re.compile(r"\bwindow=\{([^}]*)\}")


def _dot_flops(comp: Computation, instr: Instr) -> float:
    lhs = operand_arrays(comp, instr, 0)[0]
    contracting = attr(instr, "lhs_contracting_dims") or "{}"
    dims = [int(d) for d in contracting.strip("{}").split(",") if d.strip()]
    return 2 * instr.arrays[0].elements * math.prod(lhs.dims[d] for d in dims)


def _window(instr: Instr, spatial: int) -> dict[str, list]:
    """``window={size=4x1 stride=2x1 pad=3_3x0_0 ...}`` per spatial dim, with XLA's defaults."""
    fields = {"size": [1] * spatial, "stride": [1] * spatial, "pad": [(0, 0)] * spatial,
              "lhs_dilate": [1] * spatial, "rhs_dilate": [1] * spatial}
    m = _WINDOW_RE.search(instr.attrs)
    for item in (m.group(1).split() if m else []):
        key, _, value = item.partition("=")
        if key == "pad":
            fields[key] = [tuple(int(p) for p in v.split("_")) for v in value.split("x")]
        elif key in fields:
            fields[key] = [int(v) for v in value.split("x")]
    return fields


def _valid_taps(size_in: int, size_out: int, kernel: int, stride: int, pad_low: int,
                lhs_dilate: int, rhs_dilate: int) -> int:
    """(output, kernel) position pairs of one dimension that read input, not padding.

    The TPU compiler writes some dots as convolutions overhanging a size-1 input.
    """
    dilated = (size_in - 1) * lhs_dilate + 1
    total = 0
    for k in range(kernel):
        offset = k * rhs_dilate - pad_low  # input index = o * stride + offset
        if lhs_dilate == 1:
            low = max(0, -(offset // stride) if offset < 0 else 0)
            high = min(size_out - 1, (dilated - 1 - offset) // stride)
            total += max(0, high - low + 1)
        else:  # transposed convolutions: only every lhs_dilate-th index is an element
            total += sum(1 for o in range(size_out)
                         if 0 <= o * stride + offset < dilated
                         and (o * stride + offset) % lhs_dilate == 0)
    return total


def _convolution_flops(comp: Computation, instr: Instr) -> float:
    """2 x multiply-adds: per output batch and feature, kernel input features x taps inside the
    input.
    """
    labels = attr(instr, "dim_labels") or ""
    lhs_labels, _, rest = labels.partition("_")
    rhs_labels, _, out_labels = rest.partition("->")
    lhs, rhs = (operand_arrays(comp, instr, i)[0] for i in (0, 1))
    out = instr.arrays[0]
    if not out_labels or "i" not in rhs_labels or "o" not in rhs_labels:
        return 0.0
    taps = 1.0  # kernel taps per output element that read the input, averaged
    window = _window(instr, sum(c.isdigit() for c in out_labels))
    for label in (c for c in out_labels if c.isdigit()):
        d = int(label)  # the window lists spatial dimensions by number
        size_out = out.dims[out_labels.index(label)]
        valid = _valid_taps(lhs.dims[lhs_labels.index(label)], size_out,
                            rhs.dims[rhs_labels.index(label)], window["stride"][d],
                            window["pad"][d][0], window["lhs_dilate"][d], window["rhs_dilate"][d])
        taps *= valid / size_out if size_out else 0.0
    return 2 * out.elements * rhs.dims[rhs_labels.index("i")] * taps


def own_flops(comp: Computation, instr: Instr) -> float:
    """The matmul flops of ``instr`` itself (a ``dot`` or ``convolution``), one execution."""
    if instr.opcode == "dot":
        return _dot_flops(comp, instr)
    if instr.opcode == "convolution":
        return _convolution_flops(comp, instr)
    return 0.0


def instruction_flops(module: Module, comp: Computation, instr: Instr,
                      memo: dict[str, float]) -> float:
    """One execution of ``instr`` with everything it calls; ``memo`` caches computations.

    A fusion's matmuls, a loop's body times its trip count, a conditional's costliest branch.
    """
    total = own_flops(comp, instr)
    branches = []
    for callee, times, branch in called(module, comp, instr):
        if callee not in module.computations:
            continue
        if branch:
            branches.append(_flops(module, callee, memo))
        else:
            total += times * _flops(module, callee, memo)
    return total + max(branches, default=0.0)


def _flops(module: Module, name: str, memo: dict[str, float]) -> float:
    """One execution of computation ``name``, with everything it calls."""
    if name not in memo:
        memo[name] = 0.0  # a (malformed) cycle counts nothing rather than recursing forever
        comp = module.computations[name]
        memo[name] = sum(instruction_flops(module, comp, instr, memo)
                         for instr in comp.instrs.values())
    return memo[name]


def dot_flops(hlo_text: str) -> float:
    """Per-device matmul flops (dots and convolutions) of one call of ``hlo_text``."""
    module = parse_module(hlo_text)
    return _flops(module, module.entry, {})
