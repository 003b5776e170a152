"""When a run joins JAX's multi-controller runtime (``distributed.enabled``, SLURM's environment):
the decision only, no runtime started. Runs on several processes:
``tests/integration/test_multiprocess.py``."""

from __future__ import annotations

import os
import threading

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


class _Runtime:
    """A stand-in for the runtime's client: its liveness query answers ``live``, raises, or
    (``live`` None) never returns, as it does while another process sits in a collective."""

    def __init__(self, live=None, gone: bool = False):
        self.live, self.gone = live, gone

    def get_live_nodes(self, everyone):
        if self.gone:
            raise RuntimeError("coordinator unreachable")
        if self.live is None:
            threading.Event().wait()
        return self.live


@pytest.mark.parametrize(("runtime", "lost"), [
    (_Runtime(live={0: 0}), []),
    (_Runtime(live={}), [0]),  # this one process is all the runtime counts, and it is not live
    (_Runtime(gone=True), []),  # the coordinator (process 0, this one) is gone
    (_Runtime(), []),  # never answers: the failing process must not wait for it
])
def test_a_failing_process_learns_who_is_gone_without_waiting_for_the_others(monkeypatch, runtime,
                                                                             lost):
    import jaxpar.distributed as distributed

    monkeypatch.setattr(distributed, "_client", lambda: runtime)
    assert distributed.lost_processes(wait_s=0.2) == lost
