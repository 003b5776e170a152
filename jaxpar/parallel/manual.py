"""Splitting mesh axes by hand: a ``shard_map`` manual over an axis gives each device its own
rows (or sequence piece), so the step sums gradients over that axis once per step, not after
every micro-step as the partitioner would.

One rule (:func:`sum_in`: cast to ``parallel.reduce_dtype``, sum, cast back), two users:

- the plain step under gradient accumulation (:func:`sum_over_data_once`): ``data`` manual;
- the pipeline executor (:class:`ByHand`): ``data``, ``fsdp``, ``expert``, ``context`` and
  ``pipe`` manual. It gathers a stage's weights over ``fsdp`` once per step, then
  reduce-scatters their gradients over ``fsdp`` and all-reduces them over their replica axes.
  ``tensor`` stays automatic.

Why, and what each device holds: docs/pipelines.md, "One reduction per step".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

from jaxpar.config import Config
from jaxpar.model.annotate import installed
from jaxpar.model.transformer import DTYPES
from jaxpar.parallel.hooks import model_hooks, model_layout
from jaxpar.parallel.rules import logical_rules


def sum_in(dtype: Any, x: jax.Array, axes: tuple[str, ...] | str) -> jax.Array:
    """``psum`` of a gradient over manual ``axes`` in ``dtype``, returned in its own dtype."""
    return lax.psum(x.astype(dtype), axes).astype(x.dtype)


def sum_over_data_once(cfg: Config, accumulated: Callable, platform: str) -> Callable:
    """``accumulated`` (summed gradients, loss, MoE statistics) run manual over ``data``: each
    shard sums its micro-steps locally, then one all-reduce. The hooks see ``data`` as 1."""
    inner = {**cfg.mesh_shape, "data": 1}
    reduce_dtype = DTYPES[cfg.parallel.reduce_dtype]

    def per_shard(params: dict, buffers: dict, batch: dict, valid: jax.Array) -> tuple:
        with model_hooks(cfg, inner, platform):
            grads, (loss_sum, aux) = accumulated(params, buffers, batch, valid)
        grads = jax.tree.map(lambda g: sum_in(reduce_dtype, g, "data"), grads)
        # The loss and the MoE statistics are sums of float32 counts: summed as they are.
        return grads, jax.tree.map(lambda a: lax.psum(a, "data"), (loss_sum, aux))

    def run(params: dict, buffers: dict, batch: dict, valid: jax.Array) -> tuple:
        rows = PartitionSpec("data")
        return jax.shard_map(
            per_shard, in_specs=(PartitionSpec(), PartitionSpec(), rows, PartitionSpec()),
            out_specs=PartitionSpec(), axis_names=frozenset({"data"}), check_vma=False,
        )(params, buffers, batch, valid)

    return run


@dataclass(frozen=True)
class ByHand:
    """The axes the executor's ``shard_map`` splits by hand besides ``pipe``, and the parameters'
    splits over them (with ``pipe``). ``hooks()`` installs the hooks for the automatic rest;
    ``auto_shared_specs``/``auto_layer_specs`` are the splits over those axes. Gathers and sums run
    on the device's own shard (:func:`_per_shard`)."""

    axes: tuple[str, ...]
    shared_specs: Any
    layer_specs: Any
    auto_shared_specs: Any
    auto_layer_specs: Any
    hooks: Callable
    reduce_dtype: Any = jnp.float32  # parallel.reduce_dtype: the dtype gradients are summed in
    # Axes of ``axes`` whose split of a parameter is the device's own part of the model (the
    # experts over ``expert``), not a shard of a replicated weight: never gathered, and the
    # gradient of a parameter split over them is not summed over them.
    owned: tuple[str, ...] = ()

    def gather(self, tree: Any, specs: Any, auto_specs: Any) -> Any:
        """Each parameter whole over the manual axes (FSDP's gather, once per step)."""
        def leaf(x: jax.Array, spec: PartitionSpec, auto: PartitionSpec) -> jax.Array:
            split = self._split(spec)

            def gather_shard(a: jax.Array) -> jax.Array:
                for dim, axes in split:
                    a = lax.all_gather(a, axes, axis=dim, tiled=True)
                return a
            return _per_shard(gather_shard, x, auto) if split else x
        return jax.tree.map(leaf, tree, specs, auto_specs)

    def reduce(self, tree: Any, specs: Any, auto_specs: Any, *, scatter: bool = True,
               replicas: bool = True) -> Any:
        """Gradient sums over the manual axes: reduce-scatter to the stored split (FSDP), all-reduce
        where replicated. ``scatter=False``: already the stored split (``pipeline_fsdp=per_layer``);
        ``replicas=False``: the reduce-scatter alone."""
        def leaf(g: jax.Array, spec: PartitionSpec, auto: PartitionSpec) -> jax.Array:
            split = self._split(spec) if scatter else []
            rest = tuple(a for a in self.axes if a not in _axes_of(spec)) if replicas else ()
            if not (split or rest or (scatter and replicas)):
                return g  # (the one-pass default keeps its cast to reduce_dtype and back)

            def sum_shard(a: jax.Array) -> jax.Array:
                dtype = a.dtype
                a = a.astype(self.reduce_dtype)
                for dim, axes in split:
                    a = lax.psum_scatter(a, axes, scatter_dimension=dim, tiled=True)
                return (sum_in(self.reduce_dtype, a, rest) if rest else a).astype(dtype)
            return _per_shard(sum_shard, g, auto) if self.axes else g
        return jax.tree.map(leaf, tree, specs, auto_specs)

    @property
    def microbatch_spec(self) -> PartitionSpec:
        """The microbatches' split: rows over the batch axes, the sequence over ``context``."""
        rows = tuple(a for a in self.axes if a != "context")
        return PartitionSpec(None, rows or None,
                             "context" if "context" in self.axes else None)

    def total(self, x: Any) -> Any:
        """Sums of per-device statistics (loss, MoE counts) over the manual axes."""
        return jax.tree.map(lambda a: lax.psum(a, self.axes), x) if self.axes else x

    def _split(self, spec: PartitionSpec) -> list[tuple[int, tuple[str, ...]]]:
        out = []
        for dim, entry in enumerate(spec):
            names = entry if isinstance(entry, tuple) else (entry,) if entry else ()
            axes = tuple(a for a in names if a in self.axes and a not in self.owned)
            if axes:
                out.append((dim, axes))
        return out


def _axes_of(spec: PartitionSpec) -> set[str]:
    return {a for e in spec for a in (e if isinstance(e, tuple) else (e,) if e else ())}


def _per_shard(fn: Callable, x: jax.Array, auto: PartitionSpec) -> jax.Array:
    """``fn`` on the device's own shard of ``x``: the automatic axes in ``auto`` go manual."""
    axes = frozenset(_axes_of(auto))
    if not axes:
        return fn(x)
    return jax.shard_map(fn, in_specs=auto, out_specs=auto, axis_names=axes,
                         check_vma=False)(x)


class Frozen(NamedTuple):
    """LoRA's stacked base weights' splits for the executor, as ``ByHand``'s. They and the shared
    parameters are constants to the stages' VJPs: gathered once per step, never differentiated."""

    layer_specs: Any
    auto_layer_specs: Any


def _keep_axes(spec: PartitionSpec, axes: set[str]) -> PartitionSpec:
    """``spec`` with only the mesh axes in ``axes`` left."""
    def entry(e: Any) -> Any:
        names = tuple(a for a in (e if isinstance(e, tuple) else (e,) if e else ()) if a in axes)
        return names[0] if len(names) == 1 else (names or None)
    return PartitionSpec(*(entry(e) for e in spec))


def specs_of(tree: Any, axes: set[str], lead: tuple = ()) -> Any:
    """Every PartitionSpec of ``tree`` with only ``axes`` left, after ``lead`` entries."""
    return jax.tree.map(lambda spec: PartitionSpec(*lead, *_keep_axes(spec, axes)), tree,
                        is_leaf=lambda x: isinstance(x, PartitionSpec))


def split_by_hand(cfg: Config, platform: str) -> tuple[tuple[str, ...], dict, Callable]:
    """The executor's manual axes, the mesh as a stage sees it, and the stages' hooks.

    Inside, ``data``, ``fsdp``, ``expert`` and ``context`` look like size-1 axes: gradients are
    summed over them once per step, context attention runs on each piece, and MoE layers sum
    statistics and exchange tokens over them directly.
    """
    mesh_shape = cfg.mesh_shape
    hand = tuple(a for a in (*logical_rules(cfg)["batch"], "context")
                 if a in ("data", "fsdp", "expert", "context") and mesh_shape[a] > 1)
    inner = {**mesh_shape, **{a: 1 for a in hand}}

    # Built here, so a layout that cannot run fails before any trace.
    layout = model_layout(cfg, inner, platform, in_stage=True,
                          by_hand={a: mesh_shape[a] for a in hand})

    def hooks() -> Any:
        return installed(layout)

    return hand, inner, hooks
