"""The one table from logical axis names to mesh axes, and everything derived from it.

The model names its dimensions (``embed``, ``heads``, ``seq`` ...); :func:`logical_rules` says
which mesh axes split each, and ``parallel.rules`` overrides entries. A bad rule is a
:class:`~jaxpar.config.ConfigError` naming the array, never silently dropped. The table, with
why each entry: docs/design.md, "Logical-axis rules".
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.config import BATCH_AXES, VOCAB_AXES, Config, ConfigError
from jaxpar.parallel.point_to_point import ring_all_gather

Rules = Mapping[str, tuple[str, ...]]

# The logical names of a weight's model dimension: the one ZeRO splits (``expert_embed``: the
# routed experts', which ``expert`` does not split).
MODEL_DIMS = ("embed", "expert_embed")


def model_dim(names: Sequence[str | None]) -> int | None:
    """The index of a weight's model dimension (:data:`MODEL_DIMS`), or None."""
    return next((i for i, n in enumerate(names) if n in MODEL_DIMS), None)


def logical_rules(cfg: Config) -> dict[str, tuple[str, ...]]:
    """The default table for ``cfg`` (sequence parallelism, ZeRO level), then user overrides."""
    sp = cfg.parallel.sequence_parallel
    rows = sp and sequence_parallel_splits_rows(cfg)
    # ZeRO-1 keeps parameters whole; only the optimizer state is split (parallel/zero.py).
    # Outside the experts, expert is one more data axis: the weights are split over it as
    # over fsdp (FSDP over fsdp x expert), as MaxText does. Not in a pipeline, whose executor
    # gathers by hand over fsdp only (parallel/manual.py: expert is each device's own there).
    fsdp = (("fsdp",) + (("expert",) if cfg.mesh.pipe == 1 else ())
            if cfg.parallel.zero == 3 else ())
    rules: dict[str, tuple[str, ...]] = {
        "batch": BATCH_AXES,
        "residual_batch": BATCH_AXES + (("tensor",) if rows else ()),
        "seq": ("context",),
        "residual_seq": ("context", "tensor") if sp and not rows else ("context",),
        "embed": fsdp,
        # The routed experts' model dimension: their experts dimension takes expert already.
        "expert_embed": tuple(a for a in fsdp if a != "expert"),
        "act_embed": (),
        "heads": ("tensor",),
        "kv_heads": ("tensor",),
        "head_dim": (),
        # MLA's low-rank latents (jaxpar/model/mla.py): every head's up-projection reads the
        # whole latent, so splitting it over tensor would add a reduction per projection.
        "q_lora": (),
        "kv_lora": (),
        # MLA's up-projections [latent, heads, head_dim] have no model dimension; under ZeRO-3
        # their latent dimension is split over fsdp instead, gathered per layer when used.
        "q_lora_in": fsdp,
        "kv_lora_in": fsdp,
        "act_q_lora_in": (),
        "act_kv_lora_in": (),
        "mlp": ("tensor",),
        # LoRA adapters' rank (jaxpar/model/lora.py): small, never split; the adapters' other
        # axis is the adapted weight's, so they split like it.
        "lora_rank": (),
        # Config.vocab_rows pads the vocabulary for these axes (and a pipeline's stages).
        "vocab": VOCAB_AXES,
        "experts": ("expert",),
        "layers": ("pipe",),  # the stacked layers are split into pipeline stages
        "stage": ("pipe",),
    }
    rules.update(cfg.parallel.rules)
    return rules


def sequence_parallel_splits_rows(cfg: Config) -> bool:
    """Whether sequence parallelism splits the residual stream's batch rows over ``tensor``
    rather than its sequence (Megatron-SP's layout).

    Rows gather as contiguous pieces; a sequence split costs one more copy per gather
    (docs/design.md, "Logical-axis rules"). Rows only where each device's rows of a micro-batch
    divide by ``tensor``.
    """
    shape = cfg.mesh_shape
    rows = cfg.train.batch_size // (cfg.train.grad_accum * cfg.train.microbatches
                                    * math.prod(shape[a] for a in BATCH_AXES))
    return rows > 0 and rows % shape["tensor"] == 0


def resolve_spec(what: str, names: Sequence[str | None], shape: Sequence[int] | None,
                 rules: Rules, mesh_shape: Mapping[str, int]) -> PartitionSpec:
    """PartitionSpec for one array with logical ``names``; ``what`` names it in errors."""
    used: dict[str, str] = {}
    entries: list[Any] = []
    for dim, name in enumerate(names):
        if name is None:
            entries.append(None)
            continue
        if name not in rules:
            raise ConfigError(f"{what}: no rule for logical axis {name!r}; rules exist for "
                              + ", ".join(sorted(rules)))
        axes = rules[name]
        for axis in axes:
            if axis not in mesh_shape:
                raise ConfigError(f"{what}: rule {name!r} -> {axis!r} names an axis the mesh "
                                  f"lacks; mesh axes: {', '.join(mesh_shape)}")
            if axis in used:
                raise ConfigError(f"{what}: mesh axis {axis!r} is used for two dimensions "
                                  f"({used[axis]!r} and {name!r}) of one array")
            used[axis] = name
        # Size-1 axes split nothing; leaving them out keeps specs (and the golden file) readable.
        axes = tuple(a for a in axes if mesh_shape[a] > 1)
        if shape is not None:
            parts = math.prod(mesh_shape[a] for a in axes)
            if shape[dim] % parts:
                raise ConfigError(f"{what}: dimension {name!r} of size {shape[dim]} does not "
                                  f"divide over mesh axes {axes} ({parts} parts)")
        entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*entries)


def param_logical_axes(abstract_model: nnx.Module, *, buffers: bool = False) -> dict:
    """Nested dict (as ``nnx.State.to_pure_dict``) of each parameter's logical axis names;
    ``buffers=True``: of the non-trainable variables' (MoE router biases)."""
    _, params, others = nnx.split(abstract_model, nnx.Param, ...)
    flat = {}
    for path, var in nnx.to_flat_state(others if buffers else params):
        names = var.get_metadata().get("out_sharding")
        if names is None or len(names) != var.get_value().ndim:
            raise ConfigError(f"variable {'/'.join(map(str, path))}: logical axis names "
                              f"{names} do not match its shape {var.get_value().shape}")
        flat[path] = tuple(names)
    return _unflatten(flat)


def _unflatten(flat: Mapping[tuple, Any]) -> dict:
    out: dict = {}
    for path, value in flat.items():
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return out


def param_name(path: Sequence[Any]) -> str:
    """``('layers', 'attn', 'wq')`` -> ``'layers/attn/wq'`` (the name in errors, JSON, golden)."""
    return "/".join(str(getattr(k, "key", k)) for k in path)


def is_axes_leaf(x: Any) -> bool:
    return isinstance(x, tuple) and all(isinstance(n, str) or n is None for n in x)


def split_names(name: str, names: tuple) -> tuple:
    """A parameter's logical names, except that the ``dense_layers`` stack (DeepSeek's dense
    first blocks) is not cut into pipeline stages: a pipeline runs it first, whole on every
    stage."""
    if name.startswith("dense_layers/") and names[:1] == ("layers",):
        return (None, *names[1:])
    return names


def param_specs(abstract_params: dict, logical_axes: dict, rules: Rules,
                mesh_shape: Mapping[str, int]) -> dict:
    """PartitionSpec for every parameter (same nesting as the params)."""
    def spec(path: tuple, names: tuple, arr: Any) -> PartitionSpec:
        name = param_name(path)
        return resolve_spec(name, split_names(name, names), arr.shape, rules, mesh_shape)

    return jax.tree_util.tree_map_with_path(spec, logical_axes, abstract_params,
                                            is_leaf=is_axes_leaf)


def model_specs(abstract_model: nnx.Module, params: dict, buffers: dict, rules: Rules,
                mesh_shape: Mapping[str, int]) -> tuple[dict, dict]:
    """PartitionSpecs of a model's parameters and buffers (MoE router biases), from their logical
    axes and the rules table."""
    return (param_specs(params, param_logical_axes(abstract_model), rules, mesh_shape),
            param_specs(buffers, param_logical_axes(abstract_model, buffers=True), rules,
                        mesh_shape))


def named_shardings(mesh: jax.sharding.Mesh, specs: Any) -> Any:
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs,
                        is_leaf=lambda x: isinstance(x, PartitionSpec))


def activation_constrainer(rules: Rules, mesh_shape: Mapping[str, int], ring: bool = False):
    """The function :func:`jaxpar.model.annotate.constrain` applies in the train step, and the
    ``gather`` :func:`jaxpar.model.annotate.gather_weight` applies (FSDP's; a ring of sends where
    ``ring`` and the weight is split over ``tensor`` too)."""

    def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
        spec = resolve_spec(f"activation {tuple(names)}", names, x.shape, rules, mesh_shape)
        return jax.lax.with_sharding_constraint(x, spec)

    def gather(w: jax.Array, stored: Sequence[str | None], used: Sequence[str | None]
               ) -> jax.Array:
        src = _axes_per_dim(resolve_spec("weight", stored, w.shape, rules, mesh_shape), w.ndim)
        dst = _axes_per_dim(resolve_spec("weight", used, w.shape, rules, mesh_shape), w.ndim)
        moved = [(d, tuple(a for a in s if a not in t))
                 for d, (s, t) in enumerate(zip(src, dst, strict=True)) if s != t]
        # The TPU compiler makes the other gathers collective matmuls (jaxpar/platform.py); it
        # keeps the gather of a weight split over tensor too synchronous.
        if not (ring and len(moved) == 1 and moved[0][1] and "tensor" in sum(src, ())
                and not set(dst[moved[0][0]]) & set(src[moved[0][0]])):
            return jax.lax.with_sharding_constraint(w, _spec(dst))
        dim, axes = moved[0]
        return jax.shard_map(lambda a: ring_all_gather(a, axes, dim), in_specs=_spec(src),
                             out_specs=_spec(dst), axis_names=frozenset(sum(src, ())),
                             check_vma=False)(w)

    constrain.gather = gather
    return constrain


def _axes_per_dim(spec: PartitionSpec, ndim: int) -> list[tuple[str, ...]]:
    """A spec's mesh axes per dimension, ``ndim`` of them."""
    entries = [() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in spec]
    return entries + [()] * (ndim - len(entries))


def _spec(axes: list[tuple[str, ...]]) -> PartitionSpec:
    return PartitionSpec(*(None if not a else a[0] if len(a) == 1 else a for a in axes))
