"""Run P cooperating jaxpar processes on this machine, as P hosts would run them.

    python scripts/launch_local.py --processes 2 --devices-per-process 4 -- \
        jaxpar train tiny mesh.data=2 mesh.fsdp=2 mesh.tensor=2 run_dir=runs/two

Process i runs the command with these overrides appended (the command must take ``key=value``
overrides, as ``jaxpar train`` does):
``distributed.coordinator=127.0.0.1:PORT distributed.num_processes=P distributed.process_id=i
host_devices=D`` (a free PORT; D virtual CPU devices per process). Their output is streamed line
by line, prefixed ``[p0] ``, ``[p1] ``, ...

The exit code is the first non-zero exit code of a process (128 + N for a process ended by signal
N), else 0. After the first failure the others get ``--grace`` seconds to end by themselves (the
runtime ends them once it notices), then they are terminated. SIGTERM and SIGINT sent to the
launcher are passed on to every process (a jaxpar run saves and exits 0).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time


def free_port() -> int:
    """A TCP port on 127.0.0.1 nobody listens on now (the coordinator binds it moments later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def process_command(command: list[str], process: int, processes: int, devices: int,
                    port: int) -> list[str]:
    """The command of process ``process``: the user's command plus its distributed overrides."""
    return [*command, f"distributed.coordinator=127.0.0.1:{port}",
            f"distributed.num_processes={processes}", f"distributed.process_id={process}",
            f"host_devices={devices}"]


def exit_code(returncode: int) -> int:
    """A shell's exit code for a Popen return code (negative: ended by that signal)."""
    return 128 - returncode if returncode < 0 else returncode


def _stream(proc: subprocess.Popen, prefix: str, lock: threading.Lock) -> None:
    for line in proc.stdout:
        with lock:
            sys.stdout.write(prefix + line)
            sys.stdout.flush()


def _say(lock: threading.Lock, text: str) -> None:
    with lock:
        print(f"[launch] {text}", flush=True)


def _first_failure(procs: list[subprocess.Popen]) -> tuple[int, int] | None:
    """(process, exit code) of the first process found ended with a non-zero code."""
    for i, proc in enumerate(procs):
        if proc.poll() is not None and proc.returncode != 0:
            return i, exit_code(proc.returncode)
    return None


def _end_the_rest(procs: list[subprocess.Popen], failed: int, grace: float,
                  lock: threading.Lock) -> None:
    """Give the others ``grace`` seconds to end by themselves, then terminate, then kill."""
    start = time.monotonic()
    while time.monotonic() - start < grace and any(p.poll() is None for p in procs):
        time.sleep(0.1)
    for i, proc in enumerate(procs):
        if i != failed and proc.returncode is not None:
            _say(lock, f"process {i} ended by itself {time.monotonic() - start:.1f} s after "
                 f"process {failed} failed (exit code {exit_code(proc.returncode)})")
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = [i for i, p in enumerate(procs) if p.poll() is None]
        if not alive:
            return
        _say(lock, f"sending {signal.Signals(sig).name} to processes {alive}")
        for i in alive:
            procs[i].send_signal(sig)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(procs[i].poll() is None for i in alive):
            time.sleep(0.1)


def launch(command: list[str], processes: int, devices: int, grace: float) -> int:
    """Start the processes, stream their output, and return the launch's exit code."""
    port, lock = free_port(), threading.Lock()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    procs = [subprocess.Popen(process_command(command, i, processes, devices, port),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=env) for i in range(processes)]
    readers = [threading.Thread(target=_stream, args=(p, f"[p{i}] ", lock), daemon=True)
               for i, p in enumerate(procs)]
    for i, (proc, reader) in enumerate(zip(procs, readers, strict=True)):
        _say(lock, f"process {i}: pid {proc.pid}")
        reader.start()

    def forward(signum: int, frame: object) -> None:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    failure = None
    while failure is None and any(p.poll() is None for p in procs):
        time.sleep(0.1)
        failure = _first_failure(procs)
    failure = failure or _first_failure(procs)
    if failure is not None:
        _say(lock, f"process {failure[0]} exited with code {failure[1]}")
        _end_the_rest(procs, failure[0], grace, lock)
    for proc in procs:
        proc.wait()
    for reader in readers:
        reader.join(timeout=5)
    return failure[1] if failure is not None else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     usage="%(prog)s --processes P --devices-per-process D "
                                     "[--grace S] -- COMMAND ...")
    parser.add_argument("--processes", type=int, required=True, help="processes to start")
    parser.add_argument("--devices-per-process", type=int, required=True,
                        help="virtual CPU devices of each process (host_devices)")
    parser.add_argument("--grace", type=float, default=90.0, help="seconds the others get to "
                        "end by themselves after one fails, before they are terminated")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- and the command")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command or args.processes < 1 or args.devices_per_process < 1:
        parser.error("need --processes >= 1, --devices-per-process >= 1 and a command after --")
    return launch(command, args.processes, args.devices_per_process, args.grace)


if __name__ == "__main__":
    sys.exit(main())
