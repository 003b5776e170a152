"""When a run joins JAX's multi-controller runtime (``distributed.enabled``, SLURM's environment):
the decision only, no runtime started. Runs on several processes:
``tests/integration/test_multiprocess.py``."""

from __future__ import annotations

import os

import pytest

from jaxpar.config import load_config
from jaxpar.distributed import wants_distributed

SLURM_TWO_TASKS = {"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "node[1-2]", "SLURM_NTASKS": "2",
                   "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}


@pytest.mark.parametrize(("overrides", "slurm", "joins"), [
    ([], {}, False),  # auto, outside a cluster: one process
    ([], SLURM_TWO_TASKS, True),  # auto, JAX's detection sees 2 SLURM tasks
    ([], dict(SLURM_TWO_TASKS, SLURM_NTASKS="1"), False),  # a one-task SLURM job
    (["distributed.enabled=off"], SLURM_TWO_TASKS, False),
    (["distributed.num_processes=2"], {}, True),  # a field given
    (["distributed.enabled=on"], {}, True),
])
def test_when_a_run_joins_the_runtime(monkeypatch, overrides, slurm, joins):
    for key in list(os.environ):
        if key.startswith(("SLURM_", "OMPI_")):
            monkeypatch.delenv(key)
    for key, value in slurm.items():
        monkeypatch.setenv(key, value)
    assert wants_distributed(load_config("tiny", overrides).distributed) is joins
