"""Reading control flow out of optimized HLO text, for tests that prove a program is SPMD."""

from __future__ import annotations

import re

COLLECTIVE = re.compile(r"\b(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute|"
                        r"ragged-all-to-all)(-start)?\(")
CALLS = re.compile(r"(?:to_apply|calls|body|condition|true_computation|false_computation)="
                   r"%?([\w.\-]+)")
BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")


def computations(hlo: str) -> dict[str, list[str]]:
    """Computation name -> its instruction lines."""
    out: dict[str, list[str]] = {}
    name = None
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
        if head and not line.startswith(" "):
            name = head.group(1)
            out[name] = []
        elif name is not None and line.strip() and line.strip() != "}":
            out[name].append(line)
    return out


def _called(line: str) -> list[str]:
    names = CALLS.findall(line)
    for group in BRANCHES.findall(line):
        names += [n.strip().lstrip("%") for n in group.split(",")]
    return names


def collectives_in_conditionals(hlo: str) -> list[str]:
    """Every collective instruction reachable from a branch of a ``conditional``."""
    comps = computations(hlo)
    todo = [n for lines in comps.values() for line in lines if " conditional(" in line
            for n in _called(line) if n in comps]
    if "conditional(" in hlo:
        assert todo, "conditionals found but their branches were not parsed"
    seen, found = set(), []
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for line in comps[name]:
            if COLLECTIVE.search(line):
                found.append(f"{name}: {line.strip()[:120]}")
            todo += [n for n in _called(line) if n in comps]
    return found
