"""A checkpoint read into a layout that pads the vocabulary differently.

Vocabulary-shaped arrays (embedding, head, their optimizer state) have
:meth:`jaxpar.config.Config.vocab_rows` rows, which depend on the layout. A train state is read as
saved, verified, then cut or zero-padded into the run's shapes (:func:`repadded`). Only padding is
cut or added. Weights alone are repadded by orbax as it reads them
(:mod:`jaxpar.checkpoint.weights`). Details: docs/checkpoints.md, "Another layout".
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.checkpoint.integrity import leaf_name
from jaxpar.model.vocab import resized

EMBEDDING = "params/embedding"  # the array whose first dimension is the padded vocabulary


def vocab_rows(shapes: Mapping[str, tuple]) -> int | None:
    """The vocabulary rows of a tree of ``name -> (shape, dtype)``; None without an embedding."""
    entry = shapes.get(EMBEDDING)
    return None if entry is None else entry[0][0]


def repadded_axes(saved: tuple[int, ...], wanted: tuple[int, ...],
                  rows: tuple[int, int] | None) -> tuple[int, ...] | None:
    """The axes where ``saved`` becomes ``wanted`` as the rows go from ``rows[0]`` to ``rows[1]``.

    None when the shapes differ otherwise (another model).
    """
    if rows is None or len(saved) != len(wanted):
        return None
    axes = tuple(i for i, (a, b) in enumerate(zip(saved, wanted, strict=True)) if a != b)
    if not all((saved[i], wanted[i]) == rows for i in axes):
        return None
    return axes


def as_saved(abstract_state: Any, saved: Mapping[str, tuple]) -> Any:
    """``abstract_state`` with each differently padded array in its saved shape, unsplit there.

    Its saved size need not divide over this layout's devices.
    """
    def leaf(path: tuple, a: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        shape = tuple(saved[leaf_name(path)][0])
        if shape == tuple(a.shape):
            return a
        sharding = a.sharding
        spec = list(sharding.spec) + [None] * (len(shape) - len(sharding.spec))
        for i, (have, want) in enumerate(zip(shape, a.shape, strict=True)):
            if have != want:
                spec[i] = None
        sharding = NamedSharding(sharding.mesh, PartitionSpec(*spec),
                                 memory_kind=sharding.memory_kind)
        return jax.ShapeDtypeStruct(shape, a.dtype, sharding=sharding)

    return jax.tree_util.tree_map_with_path(leaf, abstract_state)


def repadded(state: Any, abstract_state: Any) -> Any:
    """``state`` (read by :func:`as_saved`'s tree) cut or zero-padded into ``abstract_state``.

    Arrays already so pass through untouched.
    """
    leaves, treedef = jax.tree.flatten(state)
    wanted = jax.tree.leaves(abstract_state)
    changed = [i for i, (a, w) in enumerate(zip(leaves, wanted, strict=True))
               if a.shape != w.shape]

    def fit(arrays: list) -> list:
        out = []
        for a, i in zip(arrays, changed, strict=True):
            for axis, rows in enumerate(wanted[i].shape):
                a = resized(a, rows, axis) if a.shape[axis] != rows else a
            out.append(a)
        return out

    fitted = jax.jit(fit, out_shardings=[wanted[i].sharding for i in changed])(
        [leaves[i] for i in changed])
    for i, a in zip(changed, fitted, strict=True):
        leaves[i] = a
    return jax.tree.unflatten(treedef, leaves)
