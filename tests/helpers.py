"""Helpers shared by the test files of every tier (tests/unit, tests/equivalence,
tests/integration): running the CLI, its one-line errors, equivalence checks, the layouts and
batches of the layout tests, and what a test file shares with one of another tier. No test file
imports another; what two share lives here (or in hf_models.py).

Imported as ``from helpers import ...`` (tests/conftest.py puts ``tests/`` on ``sys.path``).
Module-level caches (``functools.cache``) hold for one test file, like module-scoped fixtures:
tests/conftest.py clears them, and jax's compiled programs, after each file so that a worker's
memory stays that of the file it runs.
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
import json
import math
import os
import platform
import re
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from packaging.version import Version  # a dependency of pytest

from jaxpar.config import ConfigError, ModelConfig, load_config, validate
from jaxpar.data.chat import CHATML
from jaxpar.inspect.tpu import INSTALL_HINT, libtpu_installed, libtpu_version

TESTS = Path(__file__).resolve().parent
SCRIPTS = TESTS.parent / "scripts"

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
    """This environment minus the test process's device count and JAX_PLATFORMS (conftest.py),
    so that the device count must come from ``host_devices`` or ``--devices``; its other XLA
    flags (the quick CPU compiles) stay."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    if flags:
        env["XLA_FLAGS"] = " ".join(flags)
    return env


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
# Layouts against the single-device run (equivalence/test_parallel_layouts.py, test_pipeline.py,
# test_moe.py; integration/test_pipeline_5d.py runs them in subprocesses of 16 and 32 devices)

# Adam divides each gradient by its own magnitude (+ eps): for the few entries whose gradient is
# ~1e-9, a summation-order difference of 1e-7 x the largest gradient flips their update. eps=1e-6
# keeps the parameter comparison about the layout, not about amplified round-off; the gradient
# comparison (1e-4, measured ~1e-6) is the strict one.
LAYOUT_BASE = ["train.steps=3", "train.warmup_steps=1", "train.batch_size=8", "train.seq_len=32",
               "train.eps=1e-6"]
LAYOUT_STEPS = 3
# moe-tiny's layouts (equivalence/test_moe.py; unit/test_moe_plan.py plans them by hand): the
# sigmoid router with aux-loss-free balancing, so that every layout also updates (and routes with)
# the router biases, which must agree across layouts.
MOE_LAYOUT_BASE = [*LAYOUT_BASE, "model.moe.router=sigmoid_bias",
                   "model.moe.bias_update_rate=0.01"]


def make_batches(cfg) -> list[dict[str, np.ndarray]]:
    """``LAYOUT_STEPS`` batches of random tokens in ``cfg``'s shape, the same for every layout;
    some targets masked out, so that a misordered shard or a wrong normalisation cannot pass by
    symmetry."""
    rng = np.random.default_rng(1234)
    b, s = cfg.train.batch_size, cfg.train.seq_len
    batches = []
    for _ in range(LAYOUT_STEPS):
        mask = np.ones((b, s), np.float32)
        mask[0, -7:] = 0.0  # padding at the end of one row and the start of another
        mask[5, :3] = 0.0
        batches.append({
            "inputs": rng.integers(0, cfg.model.vocab_size, (b, s), dtype=np.int32),
            "targets": rng.integers(0, cfg.model.vocab_size, (b, s), dtype=np.int32),
            "mask": mask,
        })
    return batches


def layout_trainer(overrides: tuple[str, ...], preset: str = "tiny",
                   base: tuple[str, ...] | None = None):
    """(config, trainer) of ``preset`` with ``base`` (``LAYOUT_BASE``) and ``overrides`` on the
    first devices, as many as the mesh axes in ``overrides`` multiply to (``mesh.dcn.*`` split
    those axes over slices and add none)."""
    from jaxpar.mesh import make_mesh
    from jaxpar.train.step import build_trainer

    cfg = load_config(preset, [*(LAYOUT_BASE if base is None else base), *overrides])
    n_devices = math.prod(
        int(o.split("=")[1]) for o in overrides
        if o.startswith("mesh.") and not o.startswith("mesh.dcn.")) or 1
    cfg = validate(cfg, n_devices)
    return cfg, build_trainer(cfg, make_mesh(cfg, devices=jax.devices()[:n_devices]))


def assert_one_line_config_error(overrides: list[str], needle: str, key: str,
                                 devices: int = 8) -> None:
    """tiny with ``overrides`` fails validation with one line matching ``needle`` that names
    ``key``."""
    with pytest.raises(ConfigError, match=needle) as err:
        validate(load_config("tiny", overrides), devices)
    assert "\n" not in str(err.value) and key in str(err.value), err.value


@functools.cache
def run_layout(overrides: tuple[str, ...], preset: str = "tiny",
               base: tuple[str, ...] | None = None) -> dict:
    """``preset`` (tiny) with ``base`` (``LAYOUT_BASE``) and ``overrides`` on as many devices as
    its mesh axes multiply to, built once per test file: the first batch's loss and gradients,
    the parameters after ``LAYOUT_STEPS`` steps, and the compiled step's collectives and HLO."""
    from jaxpar.inspect.hlo.collectives import parse_collectives

    cfg, trainer = layout_trainer(overrides, preset, base)
    batches = [trainer.put_batch(b) for b in make_batches(cfg)]
    state = trainer.init()
    loss, grads = trainer.loss_and_grads(state, batches[0])
    step = trainer.compile_step()
    for batch in batches:
        state, metrics = step(state, batch)
    return {
        "cfg": cfg,
        "trainer": trainer,
        "loss": float(loss),
        "grads": jax.tree.map(np.asarray, grads),
        "params": jax.tree.map(np.asarray, state.params),
        "last_loss": float(metrics["loss"]),
        "state": state,
        "collectives": parse_collectives(step.as_text(), cfg.mesh_shape),
        "hlo": step.as_text(),
    }


def in_model_order(result: dict) -> tuple[dict, dict]:
    """Gradients and parameters with the stacked layers in model order."""
    order = result["trainer"].layer_order
    grads, params = result["grads"], result["params"]
    if order is None:
        return grads, params
    back = np.argsort(order)
    def unpermute(tree: dict) -> dict:
        return dict(tree, layers=jax.tree.map(lambda a: a[back], tree["layers"]))
    return unpermute(grads), unpermute(params)


def with_random_adapters(trainer, state, seed: int = 7, scale: float = 0.3):
    """``state`` with every LoRA ``B`` drawn at random (numpy, from the parameter's path and
    ``seed``, so every layout gets the same values; laid out as the trainer lays it out): the
    adapters then change the model from the first step, which a fresh ``B`` (zeros) does not."""
    def leaf(path, a):
        name = jax.tree_util.keystr(path)
        if "lora_" not in name or not name.endswith("['b']"):
            return a
        rng = np.random.default_rng([seed, *name.encode()])
        value = (scale * rng.standard_normal(a.shape)).astype(a.dtype)
        return jax.device_put(value, a.sharding)
    return state._replace(params=jax.tree_util.tree_map_with_path(leaf, state.params))


def lora_loss_and_grads(overrides: tuple[str, ...], preset: str = "tiny",
                        base: tuple[str, ...] | None = None, seed: int = 7) -> dict:
    """Like :func:`run_layout` but cheaper (no step compiled): the first batch's loss and
    gradients from an initial state whose LoRA ``B`` are random (:func:`with_random_adapters`);
    also the trainer, that state (on the host) and the batch."""
    cfg, trainer = layout_trainer(overrides, preset, base)
    batch = trainer.put_batch(make_batches(cfg)[0])
    state = with_random_adapters(trainer, trainer.init(), seed)
    loss, grads = trainer.loss_and_grads(state, batch)
    return {"cfg": cfg, "trainer": trainer, "state": state, "batch": batch, "loss": float(loss),
            "grads": jax.tree.map(np.asarray, grads),
            "params": jax.tree.map(np.asarray, state.params)}


def emulated_ragged_all_to_all(groups: int):
    """``lax.ragged_all_to_all`` as its docstring defines it, from all-gathers (XLA:CPU cannot
    compile the real one): source s sends operand[input_offsets[d] : + send_sizes[d]] to device
    d, which writes it at output_offsets[d] (the offsets the *sender* passes)."""

    def ragged(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
               axis_name):
        # The real collective's result has the receive buffer's type, which the computed one
        # here would not show: a buffer invariant where the rows vary makes autodiff sum the
        # received rows' gradient over those axes (not compilable on CPU, so checked here).
        assert jax.typeof(operand).mat.varying <= jax.typeof(output).mat.varying
        me = lax.axis_index(axis_name)
        everyone = lax.all_gather(operand, axis_name)
        starts, sizes, lands = (lax.all_gather(v, axis_name)
                                for v in (input_offsets, send_sizes, output_offsets))
        # What the receiver was told to expect matches what is sent.
        rows = jnp.arange(output.shape[0])
        result = output
        for s in range(groups):
            start, size, land = starts[s, me], sizes[s, me], lands[s, me]
            inside = ((rows >= land) & (rows < land + size)).reshape(
                -1, *[1] * (operand.ndim - 1))
            source = jnp.clip(rows - land + start, 0, operand.shape[0] - 1)
            result = jnp.where(inside, everyone[s][source], result)
        # The contract: what each receiver expects (recv_sizes) is what is sent to it. A
        # violation poisons the result, so the comparison with the reference fails.
        ok = jnp.all(sizes[:, me] == recv_sizes)
        return jnp.where(ok, result, jnp.full_like(result, -(2**20)))

    return ragged


def record_stash(monkeypatch) -> dict:
    """Patch the pipeline's residual split to record, per trace, the shapes and dtypes of what a
    stage stashes (``stashed``) and of the weights it leaves out (``weights``), and how many
    VJP leaves are taken from the weights again (``reused``)."""
    from jaxpar.parallel.pipeline import stages

    seen = {}
    split = stages.Residuals.split

    def record(self, vjp_fn, weights):
        stashed = split(self, vjp_fn, weights)
        seen["stashed"] = [(tuple(a.shape), a.dtype) for a in stashed]
        seen["weights"] = [(tuple(a.shape), a.dtype) for a in weights]
        seen["reused"] = sum(w is not None for w in self.layout[1])
        return stashed

    monkeypatch.setattr(stages.Residuals, "split", record)
    return seen


def per_step_bytes(cs) -> int:
    """Payload per step: a collective in the scanned layer loop runs once per layer."""
    return sum(c.bytes * c.executions for c in cs)


def synthetic_batch(trainer, seed: int, poison: bool = False) -> dict:
    """A batch of random tokens for ``trainer``, on its devices; ``poison`` makes the loss NaN."""
    t = trainer.cfg.train
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, trainer.cfg.model.vocab_size, (t.batch_size, t.seq_len + 1))
    mask = np.ones((t.batch_size, t.seq_len), np.float32)
    if poison:
        mask[0, 0] = np.nan
    return trainer.put_batch({"inputs": tokens[:, :-1].astype(np.int32),
                              "targets": tokens[:, 1:].astype(np.int32), "mask": mask})


# --------------------------------------------------------------------------------------------
# The cost model's tiny (unit/test_cost_model.py, equivalence/test_cost_vs_compiled.py)


def tiny_8x32(*overrides: str):
    """tiny (2 layers, d_model 64, float32) with batches of 8 x 32 tokens and ``overrides``,
    validated on 8 devices."""
    return validate(load_config("tiny", ["train.batch_size=8", "train.seq_len=32", *overrides]),
                    8)


# --------------------------------------------------------------------------------------------
# Compiled steps


def compiled_temp_bytes(cfg, devices: int) -> int:
    """Temp bytes of the compiled train step of ``cfg`` (validated) on the first ``devices``."""
    from jaxpar.mesh import make_mesh
    from jaxpar.train.step import build_trainer

    trainer = build_trainer(cfg, make_mesh(cfg, devices=jax.devices()[:devices]))
    return trainer.compile_step().memory_analysis().temp_size_in_bytes


def only_collective(cs: list):
    """The one collective of ``cs`` (unit/test_hlo_text.py, equivalence/test_hlo_compiled.py)."""
    assert len(cs) == 1, cs
    return cs[0]


# The JSON contract of docs/design.md ("jaxpar inspect ... --json writes"), plus the header's
# `run` (equivalence/test_inspect_report.py, integration/test_inspect_cli.py).
INSPECT_JSON_KEYS = {"devices", "mesh", "params", "memory", "collectives", "flops"}


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
# Runs and checkpoints (test_checkpoint*.py, test_generate*.py, test_hf_export.py)


def cached_jax_env(cache_dir: str | os.PathLike) -> dict[str, str]:
    """This environment plus a persistent compilation cache in ``cache_dir``, so that CLI
    subprocesses of one config compile once."""
    return dict(os.environ, PYTHONUNBUFFERED="1", COLUMNS="200",
                JAX_COMPILATION_CACHE_DIR=str(cache_dir),
                JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")


# What a restore says of an array that fails its checksum.
CHECKSUM_MISMATCH = re.compile(r"^checkpoint (\S+): array '([^']+)' does not match its checksum "
                               r"\(damaged file\?\)$")


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
                preamble: str = "", command: str = "inspect") -> subprocess.CompletedProcess:
    """``jaxpar inspect ARGS`` in a fresh interpreter, without the test process's CPU and TPU
    settings: ``--target`` must keep jax off any TPU and quiet libtpu by itself. (jax exports
    TPU_LIBRARY_PATH and TPU_SKIP_MDS_QUERY into os.environ once it has found libtpu.)

    ``hide_libtpu``: run as an interpreter without libtpu would (it may be installed here).
    ``preamble``: Python lines run first in that interpreter (after ``import sys``).
    ``command``: another subcommand that compiles for ``--target`` (``plan --verify``).
    """
    env = {k: v for k, v in os.environ.items()
           if k not in ("XLA_FLAGS", "JAX_PLATFORMS", "ALLOW_MULTIPLE_LIBTPU_LOAD")
           and (not k.startswith("TPU_") or (k == "TPU_LIBRARY_PATH" and not hide_libtpu))}
    if hide_libtpu:
        preamble = "sys.modules['libtpu'] = None\n" + preamble
    code = f"import sys\n{preamble}from jaxpar.cli.main import main\nsys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, command, *args], capture_output=True,
                          text=True, timeout=CLI_TIMEOUT_S, cwd=cwd, env=env)


# --------------------------------------------------------------------------------------------
# Pictures of inspect reports (unit/test_picture_drawing.py: hand-written reports;
# equivalence/test_picture_of_compiled_report.py: a compiled one)

MESH_AXES = ["pipe", "data", "fsdp", "expert", "context", "tensor"]


@functools.cache
def real_report() -> dict[str, Any]:
    """``inspect_step``'s report of tiny compiled on data=2 x tensor=4 (once per process)."""
    from jaxpar.inspect.report import inspect_step
    from jaxpar.mesh import make_mesh

    cfg = validate(load_config("tiny", ["mesh.data=2", "mesh.tensor=4"]), 8)
    return inspect_step(cfg, make_mesh(cfg))


def _report_param(name: str, shape: list[int], spec: list[Any], shards: int) -> dict[str, Any]:
    size = 4
    for n in shape:
        size *= n
    return {"name": name, "shape": shape, "spec": spec, "bytes_per_device": size // shards}


def hand_report(mesh: dict[str, int]) -> dict[str, Any]:
    """A report in the shape of ``inspect_step``'s, for any mesh (the numbers are made up)."""
    devices = 1
    for size in mesh.values():
        devices *= size
    split = [a for a in MESH_AXES if mesh.get(a, 1) > 1]
    f = "fsdp" if mesh.get("fsdp", 1) > 1 else None
    t = "tensor" if mesh.get("tensor", 1) > 1 else None
    nf, nt = mesh.get("fsdp", 1), mesh.get("tensor", 1)
    return {
        "devices": devices,
        "mesh": {a: mesh.get(a, 1) for a in MESH_AXES},
        "run": {"device_kind": "cpu", "param_count": 853120, "param_bytes": 3412480,
                "n_layers": 4, "batch_size": 16, "seq_len": 128, "grad_accum": 1,
                "dtype": "float32", "remat": "dots", "zero": 3, "sequence_parallel": True,
                "compile_seconds": 1.0},
        "params": [
            _report_param("embedding", [256, 128], [t, f], nf * nt),
            _report_param("final_norm/scale", [128], [f], nf),
            _report_param("layers/attn/wk", [4, 128, 4, 16], [None, f, t, None], nf * nt),
            _report_param("layers/attn/wo", [4, 8, 16, 128], [None, t, None, f], nf * nt),
            _report_param("layers/attn/wq", [4, 128, 8, 16], [None, f, t, None], nf * nt),
            _report_param("layers/attn/wv", [4, 128, 4, 16], [None, f, t, None], nf * nt),
            _report_param("layers/attn_norm/scale", [4, 128], [None, f], nf),
            _report_param("layers/mlp/w_down", [4, 384, 128], [None, t, f], nf * nt),
            _report_param("layers/mlp/w_gate", [4, 128, 384], [None, f, t], nf * nt),
            _report_param("layers/mlp/w_up", [4, 128, 384], [None, f, t], nf * nt),
            _report_param("layers/mlp_norm/scale", [4, 128], [None, f], nf),
            _report_param("lm_head", [128, 256], [f, t], nf * nt),
        ],
        "memory": {"argument_bytes": 2568972, "output_bytes": 2563176, "temp_bytes": 12121752,
                   "peak_bytes": 14691072, "alias_bytes": 2562828, "params_bytes": 854272,
                   "optimizer_bytes": 1708552},
        "collectives": [
            {"kind": kind, "count": 10 + k, "instructions": 4, "bytes": 2**20 * (k + 1),
             "wire_bytes": 2**19 * (k + 1), "axes": [axis], "lowered_as": [kind]}
            for k, (axis, kind) in enumerate(itertools.product(
                split, ["all-gather", "reduce-scatter", "all-reduce"]))
        ] + ([{"kind": "collective-permute", "count": 29, "bytes": 819200, "wire_bytes": 819200,
               "axes": split[:2], "lowered_as": ["collective-permute"]}] if len(split) > 1
             else []),
        "flops": {"compiled": 1e9, "analytic": 1e9},
    }


DEMO_MESH = {"data": 1, "fsdp": 2, "context": 2, "tensor": 2}
ALL_AXES = dict.fromkeys(MESH_AXES, 2)  # 64 devices


def device_boxes(fig) -> list[str]:
    return [p.get_gid() for ax in fig.axes for p in ax.patches
            if (p.get_gid() or "").startswith("device:")]


def axis_labels(fig) -> dict[str, str]:
    """``{axis: label text}`` for the texts that name a mesh axis."""
    return {t.get_gid().removeprefix("axis-label:"): t.get_text() for ax in fig.axes
            for t in ax.texts if (t.get_gid() or "").startswith("axis-label:")}


def assert_a_box_per_device_and_a_label_per_split_axis(report: dict[str, Any]) -> None:
    """The mesh picture of ``report`` draws one box per device, labels every axis that splits
    something (naming it), and no two of its texts overlap."""
    from jaxpar.pictures.figures import report_figure

    fig = report_figure(report)
    assert sorted(device_boxes(fig)) == sorted(f"device:{i}" for i in range(report["devices"]))
    split = {a for a, size in report["mesh"].items() if size > 1}
    labels = axis_labels(fig)
    assert set(labels) == split
    for axis, text in labels.items():
        assert axis in text
    assert overlapping_texts(fig) == []


def overlapping_texts(fig) -> list[tuple[str, str]]:
    """Pairs of drawn texts whose boxes overlap by more than a pixel each way."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    from matplotlib.text import Text

    texts = list(fig.texts)
    for ax in fig.axes:  # the children are the texts and the titles
        texts += [c for c in ax.get_children() if isinstance(c, Text)] + [ax.xaxis.label]
        if ax.axison:  # tick labels are drawn only inside the view limits
            low, high = sorted(ax.get_xlim())
            texts += [t for t in ax.get_xticklabels() if low <= t.get_position()[0] <= high]
    boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in texts
             if t.get_visible() and t.get_text().strip()]
    return [(a, b) for (a, box_a), (b, box_b) in itertools.combinations(boxes, 2)
            if min(box_a.x1, box_b.x1) - max(box_a.x0, box_b.x0) > 1
            and min(box_a.y1, box_b.y1) - max(box_a.y0, box_b.y0) > 1]


def random_qkv(heads: int, kv_heads: int, seq: int, batch: int = 2, dim: int = 16,
               seed: int = 0) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Normal q [batch, seq, heads, dim], k and v [batch, seq, kv_heads, dim] (the kernel
    tests of equivalence/test_document_mask.py and test_sliding_window.py)."""
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(kq, (batch, seq, heads, dim)),
            jax.random.normal(kk, (batch, seq, kv_heads, dim)),
            jax.random.normal(kv, (batch, seq, kv_heads, dim)))


# --------------------------------------------------------------------------------------------
# Text generation (equivalence/test_generate.py, integration/test_generate_end_to_end.py)

# Initialised with a large scale (init_std=0.5), so that the greedy argmax margins are far above
# float32 round-off and token-for-token equality is the right test.
GENERATION_MODEL = ModelConfig(d_model=64, n_layers=2, n_heads=8, n_kv_heads=4, d_ff=128,
                               vocab_size=256, init_std=0.5)
# Lengths 4, 19 (past the 16-token bucket) and 2; with a mesh of data=2 they pad to 4 rows.
GENERATION_PROMPTS = [[0, 5, 17, 99], [0, 200, *[3] * 16, 42], [0, 7]]


def greedy_by_full_forward(model, prompt: tuple[int, ...], new: int) -> list[int]:
    """Greedy tokens of ``model`` by full forward passes, the reference of cached generation
    (one compile: the sequence is padded to its final length; causal attention keeps the
    padding out of the logits read)."""
    import jax.numpy as jnp
    from flax import nnx

    graphdef, state = nnx.split(model)
    total = len(prompt) + new

    @jax.jit
    def next_token(state, tokens, last):
        logits, _ = nnx.merge(graphdef, state)(tokens[None], jnp.arange(total)[None])
        return jnp.argmax(logits[0, last])

    tokens = np.zeros(total, np.int32)
    tokens[:len(prompt)] = prompt
    for i in range(len(prompt), total):
        tokens[i] = int(next_token(state, tokens, i - 1))
    return tokens[len(prompt):].tolist()


# --------------------------------------------------------------------------------------------
# scripts/benchmark.py (unit/test_benchmark_options.py, equivalence/test_bench_timing.py,
# integration/test_benchmark.py)


def benchmark_script():
    """scripts/benchmark.py as a module (scripts/ is not a package; its helpers import by name)."""
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    spec = importlib.util.spec_from_file_location("jaxpar_benchmark", SCRIPTS / "benchmark.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --------------------------------------------------------------------------------------------
# Corpora and tokenizers made on the spot (unit/test_tokenized_data.py,
# integration/test_tokenize_cli.py)

CORPUS_WORDS = ("lorem", "ipsum", "dolor", "sit", "amet", "consectetur", "adipiscing", "elit",
                "sed", "do", "eiusmod", "tempor", "ünïcødé", "✓")


def write_text_corpus(directory: Path, documents: int = 40, seed: int = 0) -> dict[str, str]:
    """``documents`` .txt files of 20 to 120 words (a few non-ASCII), named doc000.txt...;
    returns name -> text."""
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True, exist_ok=True)
    docs = {}
    for i in range(documents):
        words = rng.choice(CORPUS_WORDS, size=int(rng.integers(20, 120)))
        docs[f"doc{i:03d}.txt"] = f"document {i}: " + " ".join(words)
        (directory / f"doc{i:03d}.txt").write_text(docs[f"doc{i:03d}.txt"], encoding="utf-8")
    return docs


def write_bpe_tokenizer(path: Path, texts: list[str], vocab_size: int = 300) -> Path:
    """A byte-level BPE tokenizer.json trained on ``texts``, with ``<|endoftext|>`` (id 0)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.save(str(path))
    return path


# --- chat data (data.loss_on=assistant): tests/unit/test_chat_data.py, equivalence/test_chat_loss

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>")
CHARS = [chr(c) for c in range(32, 127)] + ["\n"]


def save_chat_tokenizer(directory: Path, template: str | None = CHATML) -> str:
    """One token per character (printable ASCII and newline) plus ChatML's special tokens, and
    a tokenizer_config.json with ``template`` as its chat_template (None: no template)."""
    from tokenizers import AddedToken, Regex, Tokenizer, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate([*SPECIALS, *CHARS])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in SPECIALS])
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"eos_token": "<|endoftext|>"}
    if template is not None:
        config["chat_template"] = template
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return str(directory / "tokenizer.json")


def write_chat(path: Path, records: list) -> str:
    """A chat .jsonl: each record as one line (a string as it is: a deliberately bad line)."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n"
                            for r in records))
    return str(path)


# --- Weights & Biases (logging.wandb): tests/integration/test_wandb.py, test_multiprocess.py

WANDB_BLOCK = 32768  # the transaction log's block size (LevelDB's log format)


def wandb_records(path: Path) -> list:
    """The records of an offline run's ``run-<id>.wandb`` file, parsed with wandb's own protobuf
    (wandb 0.31 ships no reader of the file): a 7-byte header (``:W&B``, 0xBEE1, version 0),
    then LevelDB log blocks of 32 KiB whose chunks (CRC, length, type: full, first, middle,
    last) carry one serialized ``Record`` each; a block's tail under 7 bytes is padding."""
    from wandb.proto.wandb_internal_pb2 import Record

    data = path.read_bytes()
    assert data[:4] == b":W&B" and data[4:7] == b"\xe1\xbe\x00", data[:7]
    at, pending, records = 7, b"", []
    while at + 7 <= len(data):
        left = WANDB_BLOCK - at % WANDB_BLOCK
        if left < 7:
            at += left
            continue
        length, kind = int.from_bytes(data[at + 4:at + 6], "little"), data[at + 6]
        pending += data[at + 7:at + 7 + length]
        at += 7 + length
        if kind in (1, 4):  # full, last
            records.append(Record.FromString(pending))
            pending = b""
    return records


def wandb_run(path: Path) -> dict[str, Any]:
    """What an offline run file holds: its ``id``, ``start`` time (s), ``config`` and final
    ``summary`` (dicts of decoded JSON values) and ``history`` (one dict per logged row, W&B's
    own ``_*`` keys dropped)."""
    def key(item) -> str:
        return item.key or "/".join(item.nested_key)

    out: dict[str, Any] = {"id": None, "start": 0.0, "config": {}, "summary": {}, "history": []}
    for record in wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            out["id"] = record.run.run_id
            out["start"] = record.run.start_time.seconds + record.run.start_time.nanos / 1e9
            out["config"].update({key(i): json.loads(i.value_json)
                                  for i in record.run.config.update})
        elif kind == "config":
            out["config"].update({key(i): json.loads(i.value_json) for i in record.config.update})
        elif kind == "summary":
            out["summary"].update({key(i): json.loads(i.value_json)
                                   for i in record.summary.update})
        elif kind == "history":
            out["history"].append({key(i): json.loads(i.value_json) for i in record.history.item
                                   if not key(i).startswith("_")})
    return out


def wandb_env(tmp_path: Path, base_url: str = "http://127.0.0.1:9",
              base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this environment) without its WANDB_ variables, in which wandb can
    reach no real server (``base_url``: a closed port) and keeps its settings and caches under
    ``tmp_path``."""
    env = {k: v for k, v in (base or os.environ).items() if not k.startswith("WANDB_")}
    return dict(env, WANDB_SILENT="true", WANDB_BASE_URL=base_url,
                WANDB_CONFIG_DIR=str(tmp_path / "wandb-config"),
                WANDB_CACHE_DIR=str(tmp_path / "wandb-cache"),
                WANDB_DATA_DIR=str(tmp_path / "wandb-data"))
