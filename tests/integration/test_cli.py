"""The ``jaxpar`` command line, run as a subprocess: exit codes, one-line errors, run_dir files.

Config errors must come before any compile: each error run sets ``JAX_LOG_COMPILES=1`` (jax then
logs every compilation to stderr) and must print exactly one stderr line, and must leave run_dir
unwritten. The presets set ``host_devices: 8``, so these runs use 8 virtual CPU devices. A fresh
interpreter also shows that the config layer (read before jax starts) imports neither jax nor flax.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import assert_one_line_error

from jaxpar.config import config_from_dict, load_config, validate

JAXPAR = Path(sys.executable).with_name("jaxpar")
ERROR_TIMEOUT_S = 60  # an error run imports jax at most; it never compiles
METRIC_KEYS = {"step", "loss", "grad_norm", "lr", "tokens_per_s", "step_time_s"}


def run_cli(*args: str, cwd: Path, timeout: float = ERROR_TIMEOUT_S,
            console_script: bool = False, log_compiles: bool = True) -> subprocess.CompletedProcess:
    """Run jaxpar; with ``log_compiles`` any compilation would add lines to stderr."""
    command = [str(JAXPAR)] if console_script else [sys.executable, "-m", "jaxpar.cli"]
    env = dict(os.environ, COLUMNS="200")
    if log_compiles:
        env["JAX_LOG_COMPILES"] = "1"
    return subprocess.run([*command, *args], capture_output=True, text=True, timeout=timeout,
                          cwd=cwd, env=env)


# --------------------------------------------------------------------------------------------
# Config errors: exit 2, one stderr line naming the field, nothing written, nothing compiled.

CLI_ERROR_CASES = {
    "unknown-key": (["model.d_modle=3"], ["model.d_modle", "d_model"]),
    "unknown-top-level-key": (["bogus=1"], ["bogus"]),
    "wrong-type-int": (["train.steps=abc"], ["train.steps", "int"]),
    "wrong-type-bool": (["parallel.sequence_parallel=maybe"], ["parallel.sequence_parallel"]),
    "bad-choice-remat": (["train.remat=sometimes"], ["train.remat", "none, full, dots"]),
    "bad-choice-dtype": (["train.dtype=float16"], ["train.dtype", "float32, bfloat16"]),
    "bad-choice-zero": (["parallel.zero=2"], ["parallel.zero", "1, 3"]),
    "mesh-product-mismatch": (["mesh.data=2", "mesh.tensor=2"], ["mesh", "8 devices"]),
    "two-minus-one-axes": (["mesh.fsdp=-1"], ["mesh", "-1"]),
    "heads-not-divisible-by-tensor": (["mesh.tensor=8", "model.n_heads=4",
                                       "model.n_kv_heads=4"], ["model.n_heads", "mesh.tensor"]),
    "batch-not-divisible": (["train.batch_size=6"], ["train.batch_size", "data*fsdp*expert"]),
    "seq-len-under-sequence-parallel": (
        ["mesh.tensor=4", "parallel.sequence_parallel=true", "train.seq_len=34"],
        ["train.seq_len", "context*tensor"]),
    "unknown-rules-mesh-axis": (["parallel.rules.mlp=tensr"], ["parallel.rules.mlp", "tensor"]),
    "pipe-virtual-stages": (["mesh.data=4", "mesh.pipe=2", "parallel.virtual_stages=2"],
                            ["parallel.virtual_stages=2", "interleaved"]),
    "moe-top-k-over-experts": (["model.moe.num_experts=4", "model.moe.top_k=8"],
                               ["model.moe.top_k=8", "model.moe.num_experts=4"]),
    "missing-equals": (["mesh.tensor"], ["mesh.tensor", "key=value"]),
    "bad-choice-optimizer": (["train.optimizer=sgd"],
                             ["train.optimizer", "adamw, adafactor, lion, muon"]),
    "decay-fraction-range": (["train.decay_fraction=0"], ["train.decay_fraction", "(0, 1]"]),
}


@pytest.mark.parametrize(("overrides", "needles"), list(CLI_ERROR_CASES.values()),
                         ids=list(CLI_ERROR_CASES))
def test_train_config_error_is_one_line_exit_2_before_any_compile(tmp_path, overrides, needles):
    run_dir = tmp_path / "run"
    result = run_cli("train", "tiny", *overrides, f"run_dir={run_dir}", cwd=tmp_path)
    assert_one_line_error(result, *needles)
    assert not run_dir.exists()
    assert result.stdout == ""


def test_unknown_preset_is_one_line_error_exit_2(tmp_path):
    run_dir = tmp_path / "run"
    result = run_cli("train", "no-such-preset", f"run_dir={run_dir}", cwd=tmp_path)
    assert_one_line_error(result, "no-such-preset", "tiny", "demo-5d")
    assert not run_dir.exists()


def test_malformed_yaml_file_is_one_line_error_exit_2(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("model: [1, 2\ntrain:\n  steps: 3\n")
    run_dir = tmp_path / "run"
    result = run_cli("train", str(path), f"run_dir={run_dir}", cwd=tmp_path)
    assert_one_line_error(result, "broken.yaml", "YAML")
    assert not run_dir.exists()


def test_config_command_reports_errors_the_same_way(tmp_path):
    assert_one_line_error(run_cli("config", "tiny", "train.remat=sometimes", cwd=tmp_path),
                          "train.remat", "none, full, dots")


def test_missing_data_source_is_one_line_error_exit_2(tmp_path):
    run_dir = tmp_path / "run"
    missing = tmp_path / "missing"
    result = run_cli("train", "tiny", f"data.source={missing}", f"run_dir={run_dir}",
                     cwd=tmp_path)
    assert_one_line_error(result, "data.source", str(missing))
    assert not run_dir.exists()


@pytest.mark.parametrize("value", ["0", "-1"])
def test_bad_host_devices_is_one_line_error_exit_2(tmp_path, value):
    run_dir = tmp_path / "run"
    result = run_cli("train", "tiny", f"host_devices={value}", f"run_dir={run_dir}",
                     cwd=tmp_path)
    assert_one_line_error(result, "host_devices")
    assert not run_dir.exists()


# --------------------------------------------------------------------------------------------
# Usage: help, missing or unknown subcommands.


@pytest.mark.parametrize("args", [["--help"], ["train", "--help"], ["config", "--help"]],
                         ids=["top", "train", "config"])
def test_help_exits_0_and_mentions_presets_and_key_value(tmp_path, args):
    result = run_cli(*args, cwd=tmp_path, console_script=JAXPAR.exists())
    assert result.returncode == 0, result.stderr
    for needle in ("tiny", "demo-5d", "key=value"):
        assert needle in result.stdout, needle


@pytest.mark.parametrize("args", [[], ["train"], ["bogus", "tiny"], ["train", "tiny", "--foo"]],
                         ids=["no-subcommand", "no-config", "unknown-subcommand",
                              "unknown-option"])
def test_usage_error_is_one_line_exit_2(tmp_path, args):
    assert_one_line_error(run_cli(*args, cwd=tmp_path))


def test_console_script_is_installed_and_reports_errors(tmp_path):
    assert JAXPAR.exists(), f"{JAXPAR} missing: is the package installed in this venv?"
    assert_one_line_error(run_cli(cwd=tmp_path, console_script=True))


# --------------------------------------------------------------------------------------------
# Success paths.


def test_config_prints_resolved_yaml_with_minus_one_axis_filled(tmp_path):
    result = run_cli("config", "tiny", "mesh.tensor=2", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    printed = yaml.safe_load(result.stdout)
    assert printed["mesh"]["data"] == 4 and printed["mesh"]["tensor"] == 2
    expected = validate(load_config("tiny", ["mesh.tensor=2"]), 8)
    assert config_from_dict(printed) == expected
    assert not (tmp_path / "runs").exists()  # `config` writes nothing


def test_train_tiny_writes_config_and_metrics_and_prints_done(tmp_path):
    run_dir = tmp_path / "run"
    overrides = ["train.steps=3", "logging.every=1", "logging.progress=false",
                 f"run_dir={run_dir}"]
    result = run_cli("train", "tiny", *overrides, cwd=tmp_path, timeout=240,
                     log_compiles=False)
    assert result.returncode == 0, result.stderr[-4000:]

    saved = config_from_dict(yaml.safe_load((run_dir / "config.yaml").read_text()))
    assert saved == validate(load_config("tiny", overrides), 8)
    assert saved.mesh.data == 8

    rows = [json.loads(line) for line in
            (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [row["step"] for row in rows] == [1, 2, 3]
    for row in rows:
        assert METRIC_KEYS <= row.keys(), row.keys()
        assert all(math.isfinite(row[key]) for key in METRIC_KEYS - {"step"}), row
        assert row["tokens_per_s"] > 0 and row["step_time_s"] > 0 and row["lr"] > 0

    lines = [line for line in result.stdout.splitlines() if line.strip()]
    assert lines and lines[-1].startswith("done"), result.stdout[-2000:]


@pytest.mark.parametrize("count", [2, 8])
def test_host_devices_sets_the_device_count_without_xla_flags(tmp_path, count):
    # The user never touches XLA_FLAGS: host_devices alone must give that many CPU devices.
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    result = subprocess.run(
        [sys.executable, "-m", "jaxpar.cli", "config", "tiny", f"host_devices={count}"],
        capture_output=True, text=True, timeout=ERROR_TIMEOUT_S, cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr
    printed = yaml.safe_load(result.stdout)
    assert printed["mesh"]["data"] == count  # data=-1 resolved against the devices jax found


# --------------------------------------------------------------------------------------------
# The config layer comes before jax.


def test_config_module_imports_neither_jax_nor_flax():
    """host_devices must be read before jax starts, so the config layer may not import it."""
    code = ("import sys, jaxpar.config, jaxpar.cli.main; "
            "bad = [m for m in ('jax', 'flax', 'optax') if m in sys.modules]; "
            "assert not bad, bad")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
