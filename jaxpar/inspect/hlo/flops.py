"""Matmul flops of a compiled program, counted per execution (loop trip counts included).

``compiled.cost_analysis()['flops']`` counts a while-loop body once, however often it runs, so
it cannot compare a scanned program with an unrolled one. This walks the optimized HLO instead:
every ``dot`` costs 2 x (output elements) x (contracted elements), times how often its
computation runs per step (loop trip counts, :func:`jaxpar.inspect.hlo.text.called`).

A conditional runs one of its branches per execution, and which one the text cannot say: it
counts as its costliest branch. That is exact where every execution takes a branch of the same
cost, and an upper bound where some take a cheaper one: the flash kernels' ``lax.switch`` over
a block's kind (:func:`jaxpar.model.attention.block_kind`) runs its FULL or MASKED branch (the
same dots) on the blocks it computes and an empty one on the causal blocks it skips, so the
count for ring or all-gather attention over ``context`` is every block's, as if none were
skipped. (Counting every branch, as before, counted each computed block twice.)
"""

from __future__ import annotations

import math

from jaxpar.inspect.hlo.text import Computation, Module, attr, called, operand_arrays, parse_module


def _own_dot_flops(comp: Computation) -> float:
    """The dots of ``comp`` itself, one execution."""
    total = 0.0
    for instr in comp.instrs.values():
        if instr.opcode != "dot":
            continue
        lhs = operand_arrays(comp, instr, 0)[0]
        contracting = attr(instr, "lhs_contracting_dims") or "{}"
        dims = [int(d) for d in contracting.strip("{}").split(",") if d.strip()]
        total += 2 * instr.arrays[0].elements * math.prod(lhs.dims[d] for d in dims)
    return total


def _flops(module: Module, name: str, memo: dict[str, float]) -> float:
    """One execution of computation ``name``, with everything it calls."""
    if name not in memo:
        memo[name] = 0.0  # a (malformed) cycle counts nothing rather than recursing forever
        comp = module.computations[name]
        total = _own_dot_flops(comp)
        for instr in comp.instrs.values():
            branches = []
            for callee, times, branch in called(module, comp, instr):
                if callee not in module.computations:
                    continue
                if branch:
                    branches.append(_flops(module, callee, memo))
                else:
                    total += times * _flops(module, callee, memo)
            total += max(branches, default=0.0)
        memo[name] = total
    return memo[name]


def dot_flops(hlo_text: str) -> float:
    """Per-device matmul flops of one call of the program in ``hlo_text``."""
    module = parse_module(hlo_text)
    return _flops(module, module.entry, {})
