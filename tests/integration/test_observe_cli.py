"""``train.profile`` and ``logging.tensorboard`` errors through the command line: one line, before
any compile (``JAX_LOG_COMPILES=1`` would add stderr lines), nothing written. The trace and the
scalars of a run: ``tests/equivalence/test_observe.py``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import assert_one_line_error

PROFILE_ERRORS = {
    "start-step-0": (["train.profile.start_step=0"], ["train.profile.start_step=0", ">= 1"]),
    "steps-0": (["train.profile.start_step=2", "train.profile.steps=0"],
                ["train.profile.steps=0", ">= 1"]),
    "beyond-train-steps": (["train.steps=10", "train.profile.start_step=9",
                            "train.profile.steps=3"], ["up to step 11", "train.steps=10"]),
}


def _run_cli(tmp_path: Path, *args: str, pythonpath: str | None = None
             ) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_LOG_COMPILES="1")  # any compile would add stderr lines
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join([pythonpath, env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "jaxpar.cli", "train", "tiny", *args,
                           f"run_dir={tmp_path / 'run'}"], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path, env=env)


@pytest.mark.parametrize(("overrides", "needles"), list(PROFILE_ERRORS.values()),
                         ids=list(PROFILE_ERRORS))
def test_profile_errors_are_one_line_before_any_compile(tmp_path, overrides, needles):
    assert_one_line_error(_run_cli(tmp_path, *overrides), *needles, empty_stdout=True)
    assert not (tmp_path / "run").exists()


def test_tensorboard_without_tensorboardx_names_the_extra(tmp_path):
    blocker = tmp_path / "blocked" / "tensorboardX"  # stands in for a missing package
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('No module named tensorboardX')\n")
    result = _run_cli(tmp_path, "logging.tensorboard=true", pythonpath=str(blocker.parent))
    assert_one_line_error(result, "logging.tensorboard=true", "jaxpar[tensorboard]")
    assert not (tmp_path / "run").exists()
