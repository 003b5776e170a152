"""ZeRO: which device holds which part of the parameters and optimizer state.

Data parallelism and ZeRO-3 are the rules table's. Here: ZeRO-1's specs (``parallel.zero=1``:
optimizer state, and outside a pipeline gradients, split over ``data`` and ``fsdp``), and
:func:`token_shard_sum` (a per-token-shard weight gradient summed by reduce-scatter, then
all-reduce of the slice). Bytes: docs/cost-model.md, "Collectives per step"; layout:
docs/design.md, "Logical-axis rules".
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
from jax import lax
from jax.sharding import PartitionSpec

from jaxpar.config import Config
from jaxpar.parallel.optimizer_state import state_spec
from jaxpar.parallel.rules import is_axes_leaf, logical_rules, model_dim, resolve_spec
from jaxpar.platform import partitioner_sum_dtype

ZERO1_AXES = ("data", "fsdp")


def _with_embed_split(spec: PartitionSpec, names: tuple[str, ...],
                      mesh_shape: Mapping[str, int]) -> PartitionSpec:
    """Also split ``embed`` of one spec over the ZeRO-1 axes."""
    axes = tuple(a for a in ZERO1_AXES if mesh_shape[a] > 1)
    dim = model_dim(names)
    if not axes or dim is None:
        return spec
    entries = list(spec) + [None] * (len(names) - len(spec))
    existing = entries[dim] if isinstance(entries[dim], tuple) else (
        () if entries[dim] is None else (entries[dim],))
    merged = existing + tuple(a for a in axes if a not in existing)
    entries[dim] = merged[0] if len(merged) == 1 else merged
    return PartitionSpec(*entries)


def moment_specs(cfg: Config, param_specs: Any, logical_axes: Any) -> Any:
    """Adam's moments' specs: the parameters' (ZeRO-3), or ``embed`` also split over
    ``data``/``fsdp`` (ZeRO-1)."""
    if cfg.parallel.zero != 1:
        return param_specs
    return jax.tree.map(
        lambda spec, names: _with_embed_split(spec, names, cfg.mesh_shape), param_specs,
        logical_axes, is_leaf=lambda x: isinstance(x, PartitionSpec) or is_axes_leaf(x))


def gradient_specs(cfg: Config, param_specs: Any, logical_axes: Any) -> Any:
    """The summed gradients' specs: the moments' under ZeRO-1 without a pipeline (ZeRO-2: the
    sum ends in a reduce-scatter); otherwise, and in a pipeline, the parameters'."""
    if cfg.parallel.zero != 1 or cfg.mesh.pipe > 1:
        return param_specs
    return moment_specs(cfg, param_specs, logical_axes)


def optimizer_state_specs(cfg: Config, abstract_opt_state: Any, abstract_params: Any,
                          param_specs: Any, logical_axes: Any) -> Any:
    """Optimizer-state specs: a per-parameter array (path ending in the parameter's) gets
    :func:`moment_specs`' spec less its missing dims; scalars are replicated."""
    moments = moment_specs(cfg, param_specs, logical_axes)
    flat = jax.tree_util.tree_flatten_with_path(abstract_params)[0]
    specs = jax.tree_util.tree_flatten(moments, is_leaf=lambda x: isinstance(x, PartitionSpec))[0]
    by_path = {tuple(path): (leaf.shape, spec) for (path, leaf), spec in zip(flat, specs,
                                                                              strict=True)}

    def spec_of(path: tuple, leaf: Any) -> PartitionSpec:
        for start in range(len(path)):
            if start == 0 or not isinstance(path[start - 1], jax.tree_util.DictKey):
                found = by_path.get(path[start:])
                if found is not None:
                    return state_spec(found[0], found[1], tuple(leaf.shape))
        return PartitionSpec()

    return jax.tree_util.tree_map_with_path(spec_of, abstract_opt_state)


def data_summed_by_hand(cfg: Config, xla_cpu: bool) -> bool:
    """Whether a run without a pipeline sums gradients over ``data`` by hand once per step
    (:func:`jaxpar.parallel.manual.sum_over_data_once`): where the partitioner would not sum in
    ``parallel.reduce_dtype``, or under gradient accumulation. Never for MoE, or when ``data``
    splits no batch. Why: docs/design.md, "Gradient sums once per step"."""
    if cfg.model.moe.enabled or cfg.mesh_shape["data"] == 1:
        return False
    if "data" not in logical_rules(cfg)["batch"]:
        return False
    summed_in = partitioner_sum_dtype(xla_cpu, cfg.train.dtype)
    all_float32 = cfg.parallel.reduce_dtype == summed_in == "float32"
    return cfg.train.grad_accum > 1 or not all_float32


def token_shard_sum(mesh_shape: Mapping[str, int], rules: Mapping[str, tuple[str, ...]]):
    """The :func:`jaxpar.model.annotate.sum_over_token_shards` hook (None when no token axis
    splits): ``(partial_sums, used, stored) -> sum``, manual over the token and weight axes."""
    batch, seq = (tuple(a for a in rules[name] if mesh_shape[a] > 1) for name in ("batch", "seq"))
    token_axes = batch + seq
    if not token_axes:
        return None

    def axes_of(entry) -> tuple[str, ...]:
        return (entry,) if isinstance(entry, str) else tuple(entry or ())

    def spec(what: str, names: tuple, shape: tuple) -> list[tuple[str, ...]]:
        return [axes_of(e) for e in resolve_spec(what, names, shape, rules, mesh_shape)]

    def summed(partial_sums: jax.Array, used: tuple, stored: tuple) -> jax.Array:
        shape = partial_sums.shape[2:]
        held = spec("weight gradient (per token shard)", used, shape)
        kept = spec("weight gradient", stored, shape)
        # Per dimension, the token axes that split it as stored but not as held: scattered.
        scatter = [tuple(a for a in k if a not in h) for h, k in zip(held, kept, strict=True)]
        rest = tuple(a for a in token_axes if all(a not in axes for axes in kept))
        manual = frozenset(token_axes).union(*held, *kept)

        def local(x: jax.Array) -> jax.Array:
            x = x.reshape(x.shape[2:])
            for dim, axes in enumerate(scatter):
                if axes:
                    x = lax.psum_scatter(x, axes, scatter_dimension=dim, tiled=True)
            return lax.psum(x, rest) if rest else x

        def entries(dims: list[tuple[str, ...]]) -> list:
            return [d[0] if len(d) == 1 else d or None for d in dims]

        return jax.shard_map(local, in_specs=(PartitionSpec(*entries([batch, seq, *held])),),
                             out_specs=PartitionSpec(*entries(kept)),
                             axis_names=manual)(partial_sums)

    return summed
