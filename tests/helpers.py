"""Helpers shared by the test files: running the CLI, its one-line errors, equivalence checks.

Imported as ``from helpers import ...`` (pytest puts ``tests/`` on ``sys.path``).
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import jax
import numpy as np
import pytest
from packaging.version import Version  # a dependency of pytest

from jaxpar.inspect.tpu import INSTALL_HINT, libtpu_installed, libtpu_version

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


# --------------------------------------------------------------------------------------------
# Runs and checkpoints (test_checkpoint*.py)


def cached_jax_env(cache_dir: str | os.PathLike) -> dict[str, str]:
    """This environment plus a persistent compilation cache in ``cache_dir``, so that CLI
    subprocesses of one config compile once."""
    return dict(os.environ, PYTHONUNBUFFERED="1", COLUMNS="200",
                JAX_COMPILATION_CACHE_DIR=str(cache_dir),
                JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")


def metrics(run_dir: Path) -> list[dict]:
    """The rows of ``run_dir/metrics.jsonl``."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def losses(run_dir: Path) -> dict[int, tuple]:
    """Step -> (loss, grad_norm) of ``run_dir/metrics.jsonl``."""
    return {row["step"]: (row["loss"], row["grad_norm"]) for row in metrics(run_dir)}


_trainers: dict[tuple[str, ...], object] = {}


def trainer_for(overrides: list[str], devices: int | None = None):
    """A Trainer of the tiny preset per layout, for the whole test process (its jitted functions
    compile once); ``devices`` defaults to 1 for ``["mesh.data=1"]`` and 8 otherwise."""
    from jaxpar.config import load_config, validate
    from jaxpar.mesh import make_mesh
    from jaxpar.train.step import build_trainer

    key = (*overrides, f"devices={devices}")
    if key not in _trainers:
        if devices is None:
            devices = 1 if overrides == ["mesh.data=1"] else 8
        cfg = validate(load_config("tiny", overrides), devices)
        _trainers[key] = build_trainer(cfg, make_mesh(cfg, devices=jax.devices()[:devices]))
    return _trainers[key]


def random_state(trainer, seed: int):
    """A TrainState of random values (moments and counts included) in the trainer's layout:
    built on the host and put onto the devices, so nothing needs compiling."""
    rng = np.random.default_rng(seed)

    def leaf(abstract):
        if np.issubdtype(abstract.dtype, np.integer):
            value = np.asarray(rng.integers(1, 1000, abstract.shape), abstract.dtype)
        else:
            value = (0.02 * rng.standard_normal(abstract.shape)).astype(abstract.dtype)
        return jax.device_put(value, abstract.sharding)

    return jax.tree.map(leaf, trainer.abstract_state)


def flip_bytes(step_dir: Path, count: int = 16) -> Path:
    """Invert ``count`` bytes in the middle of the largest array data file of checkpoint
    ``step_dir`` (orbax's ocdbt files under ``state/**/d/``), as a bad disk would; returns it."""
    files = sorted((step_dir / "state").rglob("d/*"), key=lambda f: (f.stat().st_size, f.name))
    assert files, f"no array data files under {step_dir / 'state'}"
    data = bytearray(files[-1].read_bytes())
    middle = len(data) // 2
    for i in range(middle, middle + count):
        data[i] ^= 0xFF
    files[-1].write_bytes(bytes(data))
    return files[-1]


# --------------------------------------------------------------------------------------------
# Compiling for a TPU slice (libtpu) in a subprocess

CLI_TIMEOUT_S = 300
LIBTPU_PLATFORM = sys.platform == "linux" and platform.machine() == "x86_64"


def jax_at_least(oldest: str) -> bool:
    """The installed jax is ``oldest`` or newer (for markers of upstream differences)."""
    return Version(jax.__version__) >= Version(oldest)


def libtpu_at_least(oldest: str) -> bool:
    """The installed libtpu package is ``oldest`` or newer; False without one. (A libtpu.so
    named by TPU_LIBRARY_PATH is not the package's: its version is not known here.)"""
    version = libtpu_version()
    return version is not None and Version(version) >= Version(oldest)


def needs_libtpu() -> None:
    if libtpu_installed():
        return
    if os.environ.get("CI") and LIBTPU_PLATFORM:
        pytest.fail(f"libtpu is not installed, but it can be on this platform: {INSTALL_HINT}")
    pytest.skip(f"libtpu (the TPU compiler) is not installed: {INSTALL_HINT}"
                + ("" if LIBTPU_PLATFORM else " (no libtpu wheel for this platform)"))


def run_inspect(*args: str, cwd: Path, hide_libtpu: bool = False,
                preamble: str = "") -> subprocess.CompletedProcess:
    """``jaxpar inspect ARGS`` in a fresh interpreter, without the test process's CPU and TPU
    settings: ``--target`` must keep jax off any TPU and quiet libtpu by itself. (jax exports
    TPU_LIBRARY_PATH and TPU_SKIP_MDS_QUERY into os.environ once it has found libtpu.)

    ``hide_libtpu``: run as an interpreter without libtpu would (it may be installed here).
    ``preamble``: Python lines run first in that interpreter (after ``import sys``).
    """
    env = {k: v for k, v in os.environ.items()
           if k not in ("XLA_FLAGS", "JAX_PLATFORMS", "ALLOW_MULTIPLE_LIBTPU_LOAD")
           and (not k.startswith("TPU_") or (k == "TPU_LIBRARY_PATH" and not hide_libtpu))}
    if hide_libtpu:
        preamble = "sys.modules['libtpu'] = None\n" + preamble
    code = f"import sys\n{preamble}from jaxpar.cli.main import main\nsys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, "inspect", *args], capture_output=True,
                          text=True, timeout=CLI_TIMEOUT_S, cwd=cwd, env=env)
