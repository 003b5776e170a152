"""Several processes, one run: joining JAX's multi-controller runtime, barriers with timeouts, and
ending every process when one fails.

:func:`start_distributed` joins the processes before any jax backend starts, so that one mesh spans
all their devices. JAX's runtime ends the others when a process stops sending heartbeats. A process
that fails in Python says so first (:func:`announce_failure`), and every other process's
:func:`watch_for_failures` thread ends its own process within a second, with a line naming the
failed one. How each failure ends a run: docs/multi-host.md, "When a process fails".
"""

from __future__ import annotations

import os
import sys
import threading
import time

from jaxpar.config import DistributedConfig

FAILURE_KEY = "jaxpar/failed"
WATCH_POLL_S = 1.0  # how often the other processes read FAILURE_KEY
LIVENESS_WAIT_S = 5.0  # how long a failing process waits to learn which others are gone


class DistributedError(RuntimeError):
    """The multi-process runtime could not start, or processes disagree (exit code 1)."""


def cluster_process_count() -> int:
    """Processes in this job as JAX's own (private) cluster detection sees them; 1 outside a
    cluster, or if that detection moves."""
    try:
        from jax._src.clusters import ClusterEnv  # noqa: PLC0415
    except ImportError:
        return 1
    for env in ClusterEnv._cluster_types:
        if not env.opt_in_only_method and env.is_env_present():
            return int(env.get_process_count())
    return 1


def wants_distributed(d: DistributedConfig) -> bool:
    """``enabled=on``; or ``auto`` with a process field given or a multi-process cluster."""
    if d.enabled == "off":
        return False
    return d.enabled == "on" or d.fields_given() or cluster_process_count() > 1


def start_distributed(d: DistributedConfig) -> bool:
    """Join the multi-controller runtime if ``d`` asks for it, before any jax backend starts;
    True if it did. Unset fields come from JAX's cluster detection. ``timeout_s`` bounds the
    runtime's three waits: start-up, a silent process's heartbeats, and shut-down."""
    if not wants_distributed(d):
        return False
    import jax  # noqa: PLC0415

    ids = ([int(i) for i in d.local_device_ids.split(",")] if d.local_device_ids is not None
           else None)
    try:
        jax.distributed.initialize(
            coordinator_address=d.coordinator, num_processes=d.num_processes,
            process_id=d.process_id, local_device_ids=ids, initialization_timeout=d.timeout_s,
            heartbeat_timeout_seconds=d.timeout_s, shutdown_timeout_seconds=d.timeout_s)
    except (RuntimeError, ValueError) as err:
        who = f"process {d.process_id}" if d.process_id is not None else "this process"
        raise DistributedError(f"{who} could not join the multi-process runtime (distributed."
                               f"coordinator={d.coordinator}, timeout_s={d.timeout_s}): "
                               f"{_first_line(err)}") from None
    return True


def process_label() -> str:
    """``process 1 of 2`` (empty in a one-process run): the prefix of every error line."""
    import jax  # noqa: PLC0415

    count = jax.process_count()
    return f"process {jax.process_index()} of {count}" if count > 1 else ""


def barrier(name: str, timeout_s: int) -> None:
    """Wait until every process reached ``name``; a DistributedError after ``timeout_s``. (JAX's
    public barrier has no timeout.)"""
    import jax  # noqa: PLC0415
    client = _client()
    if jax.process_count() == 1 or client is None:
        return
    try:
        client.wait_at_barrier(f"jaxpar_{name}", timeout_in_ms=timeout_s * 1000)
    except Exception as err:  # noqa: BLE001  (the runtime raises its own error types)
        raise DistributedError(f"{process_label()}: not every process reached {name} within "
                               f"{timeout_s} s (distributed.timeout_s): {_first_line(err)}"
                               ) from None


def lost_processes(wait_s: float = LIVENESS_WAIT_S) -> list[int]:
    """Processes the runtime no longer hears from; empty when every process is alive or the
    runtime cannot be asked within ``wait_s``. The question runs in a thread this one stops
    waiting for (docs/jax-notes.md, "Multi-process on one host")."""
    import jax  # noqa: PLC0415
    client = _client()
    if client is None:
        return []
    everyone = list(range(jax.process_count()))
    answers: list = []

    def ask() -> None:
        try:
            answers.append(client.get_live_nodes(everyone))
        except Exception:  # noqa: BLE001  (the coordinator itself is gone)
            answers.append(None)

    asking = threading.Thread(target=ask, name="jaxpar-liveness", daemon=True)
    asking.start()
    asking.join(wait_s)
    if not answers:
        return []
    if answers[0] is None:
        return [0] if jax.process_index() != 0 else []
    return [p for p in everyone if p not in answers[0]]


def _first_line(err: BaseException) -> str:
    return (str(err).strip() or type(err).__name__).splitlines()[0][:300]


def _client():
    """The runtime's private client (None in a one-process run): its barrier, key-value store and
    liveness calls have no public equivalent with a timeout."""
    from jax._src import distributed  # noqa: PLC0415

    return distributed.global_state.client


def announce_failure(reason: str) -> None:
    """Tell the other processes that this one fails, and why (best effort), then give their
    watchers two polls before this one leaves: leaving at once could vanish mid-collective and
    make gloo abort the others before they read the reason."""
    client = _client()
    if client is None:
        return
    try:
        client.key_value_set(FAILURE_KEY, f"{process_label()}: {reason}")
    except Exception:  # noqa: BLE001  (the failure being reported may be the runtime's own)
        return
    time.sleep(2 * WATCH_POLL_S)


def watch_for_failures(poll_s: float = WATCH_POLL_S) -> None:
    """Start a daemon thread that ends this process (exit 1, one line) as soon as another
    announces a failure."""
    client = _client()
    if client is None:
        return

    def watch() -> None:
        while True:
            try:
                reason = client.key_value_try_get(FAILURE_KEY)
            except Exception:  # noqa: BLE001  (not set yet: the store answers NOT_FOUND)
                time.sleep(poll_s)
                continue
            if not reason.startswith(process_label() + ":"):
                print(f"jaxpar: error: {process_label()}: ending because {reason}",
                      file=sys.stderr, flush=True)
                os._exit(1)
            return

    threading.Thread(target=watch, name="jaxpar-failure-watch", daemon=True).start()
