"""Helpers shared by the test files: running the CLI, its one-line errors, equivalence checks.

Imported as ``from helpers import ...`` (pytest puts ``tests/`` on ``sys.path``).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Mapping

import jax
import numpy as np

# --------------------------------------------------------------------------------------------
# The command line


def run_jaxpar(*args: str, cwd: str | os.PathLike | None = None,
               env: Mapping[str, str] | None = None,
               timeout: float = 300) -> subprocess.CompletedProcess:
    """``python -m jaxpar.cli ARGS`` in a fresh interpreter, output captured as text."""
    return subprocess.run([sys.executable, "-m", "jaxpar.cli", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=cwd,
                          env=None if env is None else dict(env))


def env_without_device_flags() -> dict[str, str]:
    """This environment minus the test process's XLA_FLAGS and JAX_PLATFORMS (conftest.py), so
    that the device count must come from ``host_devices`` or ``--devices``."""
    return {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}


def assert_one_line_error(result: subprocess.CompletedProcess, *needles: str, code: int = 2,
                          empty_stdout: bool = False) -> str:
    """The run exited with ``code`` and wrote exactly one stderr line, ``jaxpar: error: ...``,
    holding every needle (and, with ``empty_stdout``, nothing on stdout); returns the line."""
    assert result.returncode == code, (result.returncode, result.stderr[-3000:])
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].strip(), f"stderr is not one line: {result.stderr!r}"
    line = lines[0]
    assert line.startswith("jaxpar: error: "), line
    for needle in needles:
        assert needle in line, f"{needle!r} missing from {line!r}"
    if empty_stdout:
        assert result.stdout == ""
    return line


# --------------------------------------------------------------------------------------------
# Equivalence with the single-device run


def max_relative_error(actual: dict, expected: dict) -> dict[str, float]:
    """Per leaf: the largest absolute difference over the largest magnitude of ``expected``."""
    errors = jax.tree.map(
        lambda a, e: float(np.max(np.abs(a - e)) / max(np.max(np.abs(e)), 1e-30)),
        actual, expected)
    return {jax.tree_util.keystr(path): err
            for path, err in jax.tree_util.tree_leaves_with_path(errors)}


def assert_grads_and_params_match(got: dict, ref: dict, tolerance: float = 1e-4) -> None:
    """Gradients of the first step and parameters after the last agree leaf by leaf."""
    grad_errors = max_relative_error(got["grads"], ref["grads"])
    assert max(grad_errors.values()) < tolerance, grad_errors
    param_errors = max_relative_error(got["params"], ref["params"])
    assert max(param_errors.values()) < tolerance, param_errors


def assert_params_moved(ref: dict) -> None:
    """Guards an equivalence test against comparing two untouched initialisations: every
    parameter of the reference run moved away from its initial value."""
    init = jax.tree.map(np.asarray, ref["trainer"].init().params)
    moved = max_relative_error(ref["params"], init)
    assert min(moved.values()) > 1e-4, moved


# --------------------------------------------------------------------------------------------
# Compiled steps


def compiled_temp_bytes(cfg, devices: int) -> int:
    """Temp bytes of the compiled train step of ``cfg`` (validated) on the first ``devices``."""
    from jaxpar.mesh import make_mesh
    from jaxpar.train.step import build_trainer

    trainer = build_trainer(cfg, make_mesh(cfg, devices=jax.devices()[:devices]))
    return trainer.compile_step().memory_analysis().temp_size_in_bytes


# Control flow in optimized HLO text: tests that prove a program is SPMD.

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
