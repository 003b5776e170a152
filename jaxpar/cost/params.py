"""The cost model's parameters: read from the model itself, split by the rules table.

Names, shapes and logical axes come from :func:`jaxpar.model.transformer.abstract_model`
(shapes only, nothing allocated or compiled), so the cost model cannot drift from the model;
:func:`jaxpar.parallel.rules.resolve_spec` splits each as training does. Optimizer state
(:func:`jaxpar.parallel.optimizer_state.state_shapes`) is in ``train.opt_state_dtype``;
parameters and gradients in ``train.param_dtype`` (norm scales and router: float32).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import jax
from flax import nnx

from jaxpar.config import Config, LoraConfig, ModelConfig
from jaxpar.model.lora import is_adapter
from jaxpar.model.transformer import abstract_model
from jaxpar.parallel.optimizer_state import STATE_BYTES, state_shapes, state_spec
from jaxpar.parallel.rules import (
    is_axes_leaf,
    logical_rules,
    model_dim,
    param_logical_axes,
    param_name,
    resolve_spec,
    split_names,
)
from jaxpar.parallel.zero import ZERO1_AXES

PARAM_BYTES = 4  # float32: the update; parameters, gradients and optimizer state by default
STORED_BYTES = {"float32": 4, "bfloat16": 2}  # train.param_dtype, parallel.reduce_dtype


@dataclass(frozen=True)
class ParamShape:
    """One model variable (``layers/...`` stacked over the scanned units)."""

    name: str
    shape: tuple[int, ...]
    names: tuple[str | None, ...]  # logical axis names, one per dimension

    @property
    def stacked(self) -> bool:
        return self.name.startswith("layers/")


@functools.cache
def _variables(m: ModelConfig, buffers: bool, lora: LoraConfig | None = None,
               vocab_rows: int | None = None) -> tuple[ParamShape, ...]:
    """The abstract model's parameters (``buffers``: its other variables) by name, with
    ``lora``'s adapters, vocabulary padded to ``vocab_rows``. Cached for ``plan --search``."""
    model = abstract_model(m, lora, vocab_rows=vocab_rows)
    _, params, others = nnx.split(model, nnx.Param, ...)
    flat = jax.tree_util.tree_flatten_with_path
    shapes = dict(flat(nnx.to_pure_dict(others if buffers else params))[0])
    axes = flat(param_logical_axes(model, buffers=buffers), is_leaf=is_axes_leaf)[0]
    table = [ParamShape(param_name(path), tuple(shapes[path].shape), names)
             for path, names in axes]
    return tuple(sorted(table, key=lambda p: p.name))


def model_params(m: ModelConfig, lora: LoraConfig | None = None,
                 vocab_rows: int | None = None) -> list[ParamShape]:
    """Every parameter, sorted by name (with ``lora``'s adapters; vocabulary padded to
    ``vocab_rows``, a layout's ``Config.vocab_rows()``)."""
    return list(_variables(m, False, lora, vocab_rows))


def model_buffers(m: ModelConfig) -> list[ParamShape]:
    """Non-trainable variables (``TrainState.buffers``): aux-loss-free router biases, float32,
    replicated."""
    return list(_variables(m, buffers=True))


def unit_blocks(m: ModelConfig) -> list[bool]:
    """Whether each block of the scanned unit is MoE, from parameter names: a unit is one block
    (``layers/attn/...``) or ``moe.every`` blocks (``layers/block_<i>/...``, MoE last)."""
    blocks: dict[int, bool] = {}
    for p in model_params(m):
        if p.stacked:
            parts = p.name.split("/")
            index = int(parts[1].removeprefix("block_")) if parts[1].startswith("block_") else 0
            blocks[index] = blocks.get(index, False) or "moe" in parts
    return [blocks[i] for i in sorted(blocks)]


# --------------------------------------------------------------------------------------------
# Split by the rules table


SpecEntry = str | tuple[str, ...] | None


def entry_axes(entry: SpecEntry) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _parts(spec: Sequence[SpecEntry], mesh: Mapping[str, int]) -> int:
    """Pieces a spec cuts an array into."""
    return math.prod(mesh[a] for entry in spec for a in entry_axes(entry))


@dataclass(frozen=True)
class ParamCost:
    """One parameter's split: global shape, PartitionSpec entries, bytes per device."""

    name: str
    shape: tuple[int, ...]
    spec: tuple[SpecEntry, ...]
    bytes_per_device: int  # the parameter (and its gradient) shard
    moment_bytes_per_device: int  # one Adam moment's shard
    gathered_bytes: int  # what an FSDP all-gather of it produces (the shard times fsdp)
    stacked: bool  # has a leading layers dimension
    # The shard as stored (train.param_dtype; norm scales and the router stay float32), and
    # its gradient. The other byte counts are float32 sizes that the collectives scale.
    stored_bytes_per_device: int = 0
    # The optimizer state this parameter adds, per device (train.optimizer's arrays in
    # train.opt_state_dtype, split like the moments: optimizer_state.state_shapes, state_spec).
    state_bytes_per_device: int = 0
    # Whether the optimizer updates it: all but the frozen base weights of a LoRA run, which
    # have no gradient and no optimizer state.
    trained: bool = True
    # How its optimizer moments are split: the spec, or under ZeRO-1 with embed also over
    # data x fsdp.
    moment_spec: tuple[SpecEntry, ...] = ()
    # The mesh axes FSDP gathers it over (and reduce-scatters its gradient over): those of
    # fsdp and expert that split it, but expert where it splits the routed experts themselves.
    gather_axes: tuple[str, ...] = ()

    @property
    def dense_stack(self) -> bool:
        """A ``dense_layers`` weight (DeepSeek's dense first blocks), gathered layer by layer like
        ``layers`` but not in :attr:`stacked`."""
        return self.name.startswith("dense_layers/")

    @property
    def resharded(self) -> bool:
        """Whether a layer without remat gathers it again backward rather than keep it
        (``model/projection.py: project_all``): all layer weights but router and routed experts."""
        return self.stacked and not (self.expert or self.name.endswith("/moe/router"))

    @property
    def projected(self) -> bool:
        """A weight through ``projection.project_all`` (embedding, attention and MLP matrices): its
        gradient is in ``parallel.reduce_dtype`` when wider than the compute dtype."""
        return self.name == "embedding" or (self.resharded and self.matmul
                                            and not self.name.endswith("_bias"))

    @property
    def matmul(self) -> bool:
        """A weight cast to the compute dtype (all but norm scales and the float32 router)."""
        return not self.name.endswith(("/scale", "/router"))

    @property
    def expert(self) -> bool:
        """A routed expert's weight (split over ``expert``, used in the expert shard_map)."""
        return "/moe/w_" in self.name


def param_costs(cfg: Config) -> list[ParamCost]:
    """Split every parameter by the config's rules (a ConfigError names a bad rule)."""
    mesh = cfg.mesh_shape
    rules = logical_rules(cfg)
    lora = cfg.train.lora if cfg.train.lora.rank > 0 else None
    out = []
    for p in model_params(cfg.model, lora, cfg.vocab_rows()):  # the padded bytes
        spec = tuple(resolve_spec(p.name, split_names(p.name, p.names), p.shape, rules, mesh))
        spec = spec + (None,) * (len(p.shape) - len(spec))
        size = math.prod(p.shape) * PARAM_BYTES
        moment_spec = _zero1_spec(spec, p.names, mesh) if cfg.parallel.zero == 1 else spec
        gather_axes = fsdp_gather_axes(spec, split_names(p.name, p.names), mesh)
        cost = ParamCost(
            name=p.name, shape=p.shape, spec=spec,
            bytes_per_device=size // _parts(spec, mesh),
            moment_bytes_per_device=size // _parts(moment_spec, mesh),
            gathered_bytes=size // _parts(spec, mesh) * math.prod(mesh[a] for a in gather_axes),
            stacked=p.stacked, gather_axes=gather_axes)
        stored = STORED_BYTES[cfg.train.param_dtype] if cost.matmul else PARAM_BYTES
        trained = lora is None or is_adapter(p.name)
        out.append(dataclasses.replace(
            cost, stored_bytes_per_device=cost.bytes_per_device * stored // PARAM_BYTES,
            state_bytes_per_device=_state_bytes(cfg, p, moment_spec) if trained else 0,
            trained=trained, moment_spec=moment_spec))
    return out


def fsdp_gather_axes(spec: Sequence[SpecEntry], names: Sequence[str | None],
                     mesh: Mapping[str, int]) -> tuple[str, ...]:
    """Axes (size > 1) FSDP gathers a parameter over: ``fsdp`` and ``expert`` where they split
    ``embed``, not ``experts`` (each device's own experts)."""
    split = {a for entry, name in zip(spec, names, strict=False) if name != "experts"
             for a in entry_axes(entry)}
    return tuple(a for a in ("fsdp", "expert") if a in split and mesh[a] > 1)


def _state_bytes(cfg: Config, p: ParamShape, moment_spec: tuple[SpecEntry, ...]) -> int:
    """Per-device bytes of one parameter's optimizer state, each array split by its moment spec
    less missing dims, as the step lays it out."""
    mesh, total = cfg.mesh_shape, 0
    width = STATE_BYTES[cfg.train.opt_state_dtype]
    for shape in state_shapes(cfg.train.optimizer, p.name, p.shape, p.names):
        spec = tuple(state_spec(p.shape, moment_spec, shape))
        total += math.prod(shape) * width // _parts(spec, mesh)
    return total


def _zero1_spec(spec: tuple[SpecEntry, ...], names: tuple[str | None, ...],
                mesh: Mapping[str, int]) -> tuple[SpecEntry, ...]:
    """ZeRO-1's moment spec: ``embed`` also split over data and fsdp."""
    extra = tuple(a for a in ZERO1_AXES if mesh[a] > 1)
    dim = model_dim(names)
    if not extra or dim is None:
        return spec
    existing = entry_axes(spec[dim])
    merged = existing + tuple(a for a in extra if a not in existing)
    return spec[:dim] + (merged,) + spec[dim + 1:]


def in_compute_dtype(p: ParamCost, nbytes: int, a: int) -> int:
    """Bytes of a weight (or gradient) on the wire: compute dtype, norm scales float32."""
    return nbytes * a // PARAM_BYTES if p.matmul else nbytes
