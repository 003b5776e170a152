"""lm-eval's model ``jaxpar`` (jaxpar/lm_eval.py) against lm-eval's ``hf`` model on the same
checkpoint exported to Hugging Face: the small local tasks of tests/data/lm_eval (multiple
choice, greedy generation, rolling log-likelihood) give the same per-request numbers to 1e-4,
in this process on one device and through ``python -m jaxpar.lm_eval`` on ``data=2 tensor=2``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import env_without_device_flags
from hf_models import scorable_checkpoint

pytest.importorskip("lm_eval", reason="lm-eval is an optional extra: pip install 'jaxpar[eval]'")
pytest.importorskip("accelerate", reason="lm-eval's hf model needs lm-eval[hf]")

TASKS_DIR = Path(__file__).resolve().parents[1] / "data" / "lm_eval"
TASKS = ["jaxpar_tiny_choice", "jaxpar_tiny_generate", "jaxpar_tiny_rolling"]
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    return scorable_checkpoint(tmp_path_factory.mktemp("lm_eval"))


@pytest.fixture(scope="module")
def harness_env(tmp_path_factory):
    """lm-eval reads the task files' data_files relative to the working directory, and caches
    the datasets it builds: both kept to the test."""
    env = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(tmp_path_factory.mktemp("datasets"))}
    saved = {k: os.environ.get(k) for k in env}
    cwd = os.getcwd()
    os.environ.update(env)
    os.chdir(TASKS_DIR)
    yield env
    os.chdir(cwd)
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def responses(model: str, model_args: dict) -> dict[str, list]:
    """Per task, each request's response, in lm-eval's sample order."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    import jaxpar.lm_eval  # noqa: F401  (registers the model "jaxpar")

    results = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=TASKS,
                                      task_manager=TaskManager(include_path=str(TASKS_DIR)),
                                      log_samples=True, batch_size=4)
    return {task: [r for sample in sorted(results["samples"][task], key=lambda s: s["doc_id"])
                   for r in sample["resps"]] for task in TASKS}


@pytest.fixture(scope="module")
def reference(made, harness_env):
    return responses("hf", {"pretrained": str(made["hf"]), "dtype": "float32",
                            "device": "cpu"})


def assert_same(got: dict[str, list], want: dict[str, list]) -> float:
    """The two runs' responses agree; returns the largest log-likelihood difference."""
    worst = 0.0
    for task in got:
        assert len(got[task]) == len(want[task]) > 0, task
        for a, b in zip(got[task], want[task], strict=True):
            if task == "jaxpar_tiny_generate":
                assert a == b
            elif task == "jaxpar_tiny_choice":
                (loglik, greedy), (ref, ref_greedy) = a[0], b[0]
                assert greedy == ref_greedy
                worst = max(worst, abs(loglik - ref))
            else:
                worst = max(worst, abs(a[0] - b[0]))
    assert worst <= TOLERANCE, worst
    print(f"largest |log-likelihood difference| against hf: {worst:.2e}")
    return worst


def test_jaxpar_matches_the_hf_model_request_by_request(made, harness_env, reference):
    got = responses("jaxpar", {"checkpoint": str(made["checkpoint"])})
    assert_same(got, reference)
    assert len(got["jaxpar_tiny_choice"]) == 16 and len(got["jaxpar_tiny_rolling"]) == 2


def test_the_command_line_on_a_mesh(made, harness_env, reference, tmp_path):
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "-m", "jaxpar.lm_eval", "run", "--model", "jaxpar", "--model_args",
         f"checkpoint={made['checkpoint']},overrides=mesh.data=2 mesh.tensor=2 host_devices=4",
         "--tasks", "jaxpar_tiny_choice", "--include_path", str(TASKS_DIR), "--batch_size", "4",
         "--output_path", str(out), "--log_samples"],
        capture_output=True, text=True, timeout=300, cwd=TASKS_DIR,
        env={**env_without_device_flags(), **harness_env})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "jaxpar_tiny_choice" in result.stdout
    (samples,) = out.rglob("samples_jaxpar_tiny_choice_*.jsonl")
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    # The samples file writes each response's numbers as strings.
    got = [[(float(r[0][0]), r[0][1] == "True")]
           for row in sorted(rows, key=lambda r: r["doc_id"]) for r in row["resps"]]
    assert_same({"jaxpar_tiny_choice": got},
                {"jaxpar_tiny_choice": reference["jaxpar_tiny_choice"]})
