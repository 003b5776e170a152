"""``jaxpar train``: join the processes, check the config everywhere, train; a failure under
several processes ends this one at once (no hang in a collective with it)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from jaxpar.cli.common import load_validated, multi_process, print_error
from jaxpar.config import Config, ConfigError


def run_train(args: argparse.Namespace) -> tuple[int, str]:
    """``jaxpar train``: the exit code and, if it failed, why (under several processes, also
    the start-up barrier and the watch for other processes' failures)."""
    from jaxpar.distributed import barrier, watch_for_failures  # noqa: PLC0415

    cfg = load_validated(args.config, list(args.overrides), join=True)
    watch_for_failures()
    # Every process checked the same config: none compiles while another already failed.
    barrier("config_checked", cfg.distributed.timeout_s)
    # Imported only now: a config error costs no import of the training stack.
    from jaxpar.train.loop import NonFiniteError, train  # noqa: PLC0415

    try:
        train(cfg, plan=plan_summary)
    except NonFiniteError as err:
        return 1, print_error(err)
    return 0, ""


def plan_summary(cfg: Config) -> dict[str, Any]:
    """What ``jaxpar plan`` predicts for this run on its devices (their kind's hardware profile;
    the nominal ``cpu`` one for kinds the table lacks), for the W&B run's summary, which asks
    for it once the run has started. A layout the plan cannot cost is noted, not an error."""
    import jax  # noqa: PLC0415

    from jaxpar.cost.estimate import estimate  # noqa: PLC0415
    from jaxpar.hardware import profile_of  # noqa: PLC0415

    try:
        return estimate(cfg, profile_of(jax.devices()[0].device_kind)).summary()
    except Exception as err:  # noqa: BLE001  (the plan is information: the run goes on)
        return {"plan/error": f"{type(err).__name__}: {(str(err).strip() or '-').splitlines()[0]}"}


def train_command(args: argparse.Namespace) -> int:
    """:func:`run_train`; a failure under several processes ends this process at once.

    A process that fails must not linger in the runtime's graceful shut-down: while it waits
    there, the others sit in a collective with it until ``distributed.timeout_s`` runs out.
    Leaving at once closes its connections, so their collectives fail within seconds."""
    import traceback  # noqa: PLC0415

    from jaxpar.distributed import (  # noqa: PLC0415
        DistributedError,
        announce_failure,
        lost_processes,
    )

    code, reason = 1, ""
    try:
        code, reason = run_train(args)
    except ConfigError as err:
        reason, code = print_error(err), 2
    except DistributedError as err:
        reason = print_error(err)
    except KeyboardInterrupt:
        reason = print_error("interrupted")
    except Exception as err:  # noqa: BLE001
        if not multi_process():
            raise
        traceback.print_exc()
        lost = lost_processes()
        cause = (f"process {', '.join(map(str, lost))} is gone; " if lost else "")
        reason = print_error(f"{cause}{type(err).__name__}: {err}")
    if code != 0 and multi_process():
        announce_failure(reason)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code
