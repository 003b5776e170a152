"""``jaxpar inspect --hlo-file DUMP --mesh AXES``: the collectives and memory of any HLO dump.

From jaxpar or another trainer, tallied as ``jaxpar inspect`` tallies its own step. ``--mesh``
(``data=2,fsdp=16``) says which axes each replica group spans; its product must be the device count.
Memory comes from XLA's buffer assignment beside the module, when present. Details: docs/inspect.md,
"Any HLO dump".
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from jaxpar.config import ConfigError
from jaxpar.inspect.hlo.collectives import parse_collectives, summarize_collectives
from jaxpar.inspect.hlo.overlap import add_overlap
from jaxpar.inspect.hlo.text import parse_module

_AXIS_RE = re.compile(r"^([A-Za-z_][\w]*)=(\d+)$")
_ALLOCATION_RE = re.compile(r"^allocation \d+: size (\d+)(.*)$", re.M)
BUFFER_SUFFIX = "-buffer-assignment.txt"


def parse_mesh(text: str) -> list[tuple[str, int]]:
    """``"data=2,fsdp=16"`` -> ``[("data", 2), ("fsdp", 16)]``; a one-line error otherwise."""
    axes: list[tuple[str, int]] = []
    for item in text.split(","):
        m = _AXIS_RE.match(item.strip())
        if not m or int(m.group(2)) < 1:
            raise ConfigError(f"--mesh {text}: expected NAME=SIZE[,NAME=SIZE...] with sizes "
                              f">= 1, e.g. data=2,fsdp=16; got {item.strip()!r}")
        if m.group(1) in dict(axes):
            raise ConfigError(f"--mesh {text}: axis {m.group(1)!r} is named twice")
        axes.append((m.group(1), int(m.group(2))))
    return axes


def buffer_assignment_beside(dump: Path) -> Path | None:
    """XLA's buffer assignment file written beside the module text, if there is one."""
    candidate = dump.with_name(dump.name.removesuffix(".txt") + BUFFER_SUFFIX)
    return candidate if candidate.is_file() else None


def memory_from_buffers(text: str) -> dict[str, Any]:
    """Per-device argument, output, alias and temp bytes of a buffer assignment, and their peak."""
    argument = output = alias = temp = 0
    for size_text, flags in _ALLOCATION_RE.findall(text):
        size = int(size_text)
        parameter = re.search(r"\bparameter \d+", flags) is not None
        live_out = "maybe-live-out" in flags
        if parameter:
            argument += size
        if live_out:
            output += size
        if parameter and live_out:
            alias += size
        if not (parameter or live_out or "constant" in flags or "thread-local" in flags):
            temp += size
    return {"argument_bytes": argument, "output_bytes": output, "alias_bytes": alias,
            "temp_bytes": temp, "peak_bytes": argument + output - alias + temp,
            "peak_source": "buffers"}


def dump_report(hlo_text: str, mesh: list[tuple[str, int]],
                buffers_text: str | None = None) -> dict[str, Any]:
    """``{"devices", "mesh", "collectives", "memory"}`` of a dump.

    The rows carry hidden and exposed bytes (:func:`jaxpar.inspect.hlo.overlap.add_overlap`).
    ``memory`` is None without a buffer assignment.
    """
    module = parse_module(hlo_text)
    devices = math.prod(size for _, size in mesh)
    declared = (module.replica_count or 1) * (module.num_partitions or 1)
    if (module.replica_count or module.num_partitions) and declared != devices:
        raise ConfigError(f"--mesh: {devices} devices, but the dump's module runs on {declared} "
                          f"({module.replica_count or 1} replicas x "
                          f"{module.num_partitions or 1} partitions)")
    found = parse_collectives(hlo_text, mesh)
    rows = summarize_collectives(found)
    add_overlap(rows, found, hlo_text)
    memory = memory_from_buffers(buffers_text) if buffers_text is not None else None
    return {"devices": devices, "mesh": dict(mesh), "collectives": rows, "memory": memory}
