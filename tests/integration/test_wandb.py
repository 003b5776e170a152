"""``logging.wandb`` through the command line, with no network: an offline run's file under
``run_dir`` holds config.yaml as its config, the metrics.jsonl rows as its history and summary,
and the plan in its summary; a resumed run continues the same W&B run and logs again the steps
after its checkpoint; a server that cannot be reached is one warning line and the run goes on;
bad input and a missing wandb are one line, exit 2, before any compile. Two processes writing one
run: ``tests/integration/test_multiprocess.py``."""

from __future__ import annotations

import shutil
import socket
from pathlib import Path

import pytest
import yaml
from helpers import assert_one_line_error, metrics, run_jaxpar, wandb_env, wandb_run

from jaxpar.config import load_config
from jaxpar.cost.estimate import estimate
from jaxpar.hardware import profile_of
from jaxpar.train.metrics import scalars

pytest.importorskip("wandb")

SHORT = ("logging.every=1", "logging.progress=false", "data.max_bytes=200000", "host_devices=2",
         "mesh.data=2")


def train(tmp_path: Path, run_dir: Path, *overrides: str, env: dict | None = None,
          timeout: float = 300):
    result = run_jaxpar("train", "tiny", *SHORT, f"run_dir={run_dir}", *overrides,
                        env=env or wandb_env(tmp_path), cwd=tmp_path, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def offline_runs(run_dir: Path) -> list[dict]:
    """Every offline run file under run_dir/wandb, oldest first."""
    runs = [wandb_run(f) for f in (run_dir / "wandb").glob("offline-run-*/run-*.wandb")]
    return sorted(runs, key=lambda run: run["start"])


def assert_history_is_the_metrics(history: list[dict], rows: list[dict]) -> None:
    logged = {row["step"]: row for row in history}
    assert sorted(logged) == [row["step"] for row in rows]
    for row in rows:
        assert logged[row["step"]] == {**scalars(row), "step": row["step"]}, row["step"]


def test_an_offline_run_holds_the_config_the_metrics_and_the_plan(tmp_path):
    run_dir = tmp_path / "run"
    result = train(tmp_path, run_dir, "train.steps=3", "logging.wandb.mode=offline",
                   "logging.wandb.project=jaxpar-test", "logging.wandb.tags=[tiny,cpu]")
    (run,) = offline_runs(run_dir)
    assert run["id"] == (run_dir / "wandb_run_id").read_text().strip()
    assert f"logging.wandb: W&B run {run['id']} (offline) in " in result.stdout
    assert "wandb sync " in result.stdout
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert run["config"] == {"_wandb": {}, **config}
    rows = metrics(run_dir)
    assert_history_is_the_metrics(run["history"], rows)
    summary = run["summary"]
    assert {k: summary[k] for k in scalars(rows[-1])} == scalars(rows[-1])
    assert summary["step"] == 3
    assert (summary["mesh/data"], summary["layout/zero"]) == (2, config["parallel"]["zero"])
    plan = estimate(load_config(str(run_dir / "config.yaml")), profile_of("cpu"))
    assert summary["plan/hardware"] == "cpu"
    assert summary["plan/peak_memory_bytes"] == plan.memory.peak
    assert summary["plan/step_time_s"] == pytest.approx(plan.time.step)


def test_a_resumed_run_continues_the_same_wandb_run(tmp_path):
    run_dir = tmp_path / "run"
    train(tmp_path, run_dir, "train.steps=3", "checkpoint.every=2", "logging.wandb.mode=offline")
    # As if killed after step 3, before its checkpoint: the newest one on disk is step 2.
    shutil.rmtree(run_dir / "checkpoints" / "3")
    result = train(tmp_path, run_dir, "train.steps=5", "checkpoint.every=2",
                   "logging.wandb.mode=offline")
    first, second = offline_runs(run_dir)
    assert first["id"] == second["id"] == (run_dir / "wandb_run_id").read_text().strip()
    assert f"W&B run {first['id']} (offline, continued)" in result.stdout
    assert [r["step"] for r in first["history"]] == [1, 2, 3]
    assert [r["step"] for r in second["history"]] == [3, 4, 5]  # step 3 logged again
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert_history_is_the_metrics(first["history"][:2] + second["history"], rows)
    # A fresh start in the same run_dir (no checkpoint to resume) is a new W&B run.
    shutil.rmtree(run_dir / "checkpoints")
    train(tmp_path, run_dir, "train.steps=1", "logging.wandb.mode=offline")
    assert offline_runs(run_dir)[-1]["id"] not in (first["id"], "")


def closed_port() -> int:
    with socket.socket() as s:  # a port the system just gave out, closed again
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_server_out_of_reach_is_one_warning_and_the_run_goes_on(tmp_path):
    env = dict(wandb_env(tmp_path, f"http://127.0.0.1:{closed_port()}"),
               WANDB_API_KEY="x" * 40)  # a key, so that wandb tries the server
    run_dir = tmp_path / "run"
    result = train(tmp_path, run_dir, "train.steps=2", "logging.wandb.mode=online",
                   "logging.wandb.init_timeout_s=5", env=env, timeout=240)
    warnings = [line for line in result.stdout.splitlines() if line.startswith("logging.wandb")]
    assert len(warnings) == 1 and "no W&B run" in warnings[0], result.stdout
    assert "training goes on without it" in warnings[0]
    assert [r["step"] for r in metrics(run_dir)] == [1, 2]


BAD = {
    "mode": (["logging.wandb.mode=cloud"], ["logging.wandb.mode", "disabled, online, offline"]),
    "project": (["logging.wandb.project=team/run"], ["logging.wandb.project=team/run"]),
    "tag": (["logging.wandb.tags=[" + "t" * 65 + "]"], ["logging.wandb.tags", "64"]),
    "timeout": (["logging.wandb.init_timeout_s=-1"], ["logging.wandb.init_timeout_s=-1"]),
}


@pytest.mark.parametrize(("overrides", "needles"), list(BAD.values()), ids=list(BAD))
def test_bad_wandb_settings_are_one_line_before_anything_runs(tmp_path, overrides, needles):
    result = run_jaxpar("train", "tiny", f"run_dir={tmp_path / 'run'}", *overrides,
                        env=dict(wandb_env(tmp_path), JAX_LOG_COMPILES="1"), cwd=tmp_path)
    assert_one_line_error(result, *needles, empty_stdout=True)
    assert not (tmp_path / "run").exists()


def test_wandb_missing_names_the_extra_before_any_compile(tmp_path):
    blocker = tmp_path / "blocked" / "wandb"  # stands in for a missing package
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('No module named wandb')\n")
    env = wandb_env(tmp_path)
    env.update(JAX_LOG_COMPILES="1",  # any compile would add stderr lines
               PYTHONPATH=":".join(p for p in (str(blocker.parent), env.get("PYTHONPATH")) if p))
    result = run_jaxpar("train", "tiny", f"run_dir={tmp_path / 'run'}",
                        "logging.wandb.mode=offline", env=env, cwd=tmp_path)
    assert_one_line_error(result, "logging.wandb.mode=offline", "jaxpar[track]")
    assert not (tmp_path / "run" / "wandb").exists()
    assert not (tmp_path / "run" / "config.yaml").exists()
