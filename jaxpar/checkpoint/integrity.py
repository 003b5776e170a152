"""Checksums of a checkpoint's arrays: recorded at save, verified after every restore.

Orbax keeps no checksum, so flipped bytes would resume a run from damaged parameters. Each array
gets a 32-bit sum of its values mixed with their global positions: it verifies bit for bit under any
mesh. Why this sum, its price, several processes: docs/checkpoints.md, "Integrity".
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax import lax

ALGORITHM = "sum32-murmur3-fmix-v1"  # recorded with the checksums; a new formula gets a new name
_SPREAD = 0x9E3779B1  # odd: index -> index * _SPREAD is a bijection modulo 2**32


def _fmix32(h: jax.Array) -> jax.Array:
    """MurmurHash3's finalizer: a bijection on uint32 that spreads every input bit."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _words(x: jax.Array) -> jax.Array:
    """The bit pattern of ``x`` as uint32 words (8-byte elements: two words on a new last axis)."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    size = np.dtype(x.dtype).itemsize
    if size not in (1, 2, 4, 8):
        raise TypeError(f"no checksum for dtype {x.dtype}")
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[size]
    return lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


def _flat_index(shape: tuple[int, ...]) -> jax.Array:
    """Each element's row-major position in the global array, modulo 2**32."""
    index = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(len(shape))):
        index = index + lax.broadcasted_iota(jnp.uint32, shape, axis) * jnp.uint32(stride)
        stride = (stride * shape[axis]) % 2**32
    return index


def array_checksum(x: jax.Array) -> jax.Array:
    """The uint32 checksum of ``x``; traceable, any sharding."""
    words = _words(x)
    spread = _flat_index(words.shape) * jnp.uint32(_SPREAD)
    return jnp.sum(_fmix32(words ^ spread), dtype=jnp.uint32)


@jax.jit
def _checksum_leaves(leaves: list[jax.Array]) -> list[jax.Array]:
    # Host-resident leaves (train.offload) are summed on the device: XLA computes on device
    # memory only.
    return [array_checksum(jax.device_put(leaf, jax.memory.Space.Device)) for leaf in leaves]


def leaf_name(path: tuple) -> str:
    """A key path as a slash name (``params/layers/attn/wq``), for live and orbax metadata trees.

    Orbax's metadata stores named tuples as dicts and tuples as lists; the name is the same.
    """
    parts = []
    for key in path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
        else:
            parts.append(str(key))
    return "/".join(parts)


def warm_up(abstract_tree: Any) -> None:
    """Compile the checksums of trees laid out as ``abstract_tree`` now, not at the first save."""
    _checksum_leaves.lower(jax.tree.leaves(abstract_tree)).compile()


def start(tree: Any) -> dict[str, Any]:
    """A save's ``checksums`` item, still on device: dispatched, not waited for.

    Collective over processes, as a save is.
    """
    named = jax.tree_util.tree_flatten_with_path(tree)[0]
    sums = _checksum_leaves([leaf for _, leaf in named])
    return {"algorithm": ALGORITHM,
            "arrays": {leaf_name(path): s for (path, _), s in zip(named, sums, strict=True)}}


def resolve(record: Mapping[str, Any]) -> dict[str, Any]:
    """``record`` with its device scalars as ints (waits for them)."""
    # A scalar output is replicated: any addressable copy holds the value, on every process.
    return dict(record, arrays={name: int(np.asarray(s.addressable_data(0)))
                                for name, s in record["arrays"].items()})


def checksums(tree: Any) -> dict[str, int]:
    """Checksum of every array in ``tree`` by slash name (waits for them)."""
    return resolve(start(tree))["arrays"]


class ChecksumHandler(ocp.JsonCheckpointHandler):
    """The ``checksums`` item: JSON fetched from :func:`start`'s scalars in orbax's thread.

    The primary process writes it; orbax commits it with the arrays.
    """

    async def async_save(self, directory: Any, item: Any = None,
                         args: Any = None) -> list[ocp.future.Future]:
        pending = args.item if args is not None else item

        async def write() -> None:
            if jax.process_index() == 0:  # orbax's primary: the one that writes JSON items
                (directory / self._filename).write_text(json.dumps(resolve(pending)))

        return [ocp.future.CommitFutureAwaitingContractedSignals(write(),
                                                                 name="jaxpar_checksums")]


# Orbax picks an item's handler by the type of its arguments, so the handler needs its own.
@ocp.args.register_with_handler(ChecksumHandler, for_save=True)
@dataclasses.dataclass
class ChecksumSave(ocp.args.CheckpointArgs):
    item: Mapping[str, Any]  # start()'s record


@ocp.args.register_with_handler(ChecksumHandler, for_restore=True)
@dataclasses.dataclass
class ChecksumRestore(ocp.args.CheckpointArgs):
    pass


def restore_args(step_dir: Path) -> dict[str, Any]:
    """The ``checksums`` item to restore from ``step_dir``; None for old checkpoints without one."""
    return {"checksums": ChecksumRestore()} if (step_dir / "checksums").is_dir() else {}


def problem(recorded: Mapping[str, Any], tree: Any) -> str | None:
    """One phrase naming the first array of ``tree`` that fails ``recorded``; None if all match."""
    try:
        name = first_mismatch(recorded, tree)
    except (ValueError, KeyError, TypeError, AttributeError) as err:  # a damaged record
        return f"its checksums are unreadable ({str(err).splitlines()[0][:200]})"
    return None if name is None else (f"array '{name}' does not match its checksum (damaged "
                                      "file?)")


def first_mismatch(recorded: Mapping[str, Any], tree: Any) -> str | None:
    """The name of the first array of ``tree`` whose checksum differs from ``recorded``, or None."""
    if recorded.get("algorithm") != ALGORITHM:
        raise ValueError(f"checksums of an unknown kind ({recorded.get('algorithm')!r})")
    saved = recorded["arrays"]
    for name, value in checksums(tree).items():
        if saved.get(name) != value:
            return name
    return None
