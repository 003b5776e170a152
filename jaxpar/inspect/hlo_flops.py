"""Matmul flops of a compiled program, counted per execution (loop trip counts included).

``compiled.cost_analysis()['flops']`` counts a while-loop body once, however often it runs, so
it cannot compare a scanned program with an unrolled one. This walks the optimized HLO instead:
every ``dot`` costs 2 x (output elements) x (contracted elements), times how often its
computation runs per step (:func:`jaxpar.inspect.hlo_text.computation_runs`). A branch of a
conditional counts as running every time (an upper bound for programs that branch).
"""

from __future__ import annotations

import math

from jaxpar.inspect.hlo_text import attr, computation_runs, operand_arrays, parse_module


def dot_flops(hlo_text: str) -> float:
    """Per-device matmul flops of one call of the program in ``hlo_text``."""
    module = parse_module(hlo_text)
    runs = computation_runs(module)
    total = 0.0
    for comp in module.computations.values():
        for instr in comp.instrs.values():
            if instr.opcode != "dot":
                continue
            lhs = operand_arrays(comp, instr, 0)[0]
            contracting = attr(instr, "lhs_contracting_dims") or "{}"
            dims = [int(d) for d in contracting.strip("{}").split(",") if d.strip()]
            contracted = math.prod(lhs.dims[d] for d in dims)
            total += runs[comp.name] * 2 * instr.arrays[0].elements * contracted
    return total
