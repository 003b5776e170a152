"""The parallel layout as the model sees it: one :class:`~jaxpar.model.annotate.Layout` per trace.

The model names logical axes and reads the active layout (:mod:`jaxpar.model.annotate`); this
module builds it for a mesh shape: activation constraints, attention, the experts' dispatch, the
sums of by-hand split gradients and loads, and ``parallel.reduce_dtype``. The train step installs
one for the whole mesh; the pipeline executor its own inside its ``shard_map``, with the axes it
handles by hand counted as 1 (``by_hand``). A ``shard_map`` nested there is a config error on
the platforms in :data:`jaxpar.platform.NO_SHARD_MAP_IN_STAGES` (docs/jax-notes.md, "A
`shard_map` nested in a pipeline stage aborts libtpu").
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping
from functools import partial
from types import MappingProxyType

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxpar import platform as workarounds
from jaxpar.config import BATCH_AXES, Config, ConfigError, documents_masked
from jaxpar.model.annotate import Layout, installed
from jaxpar.model.fused import attention_fn, resolve
from jaxpar.parallel.context import context_attention, local_context_attention, local_tokens
from jaxpar.parallel.expert import expert_parallel
from jaxpar.parallel.point_to_point import fsdp_gather_ring
from jaxpar.parallel.rules import activation_constrainer, logical_rules
from jaxpar.parallel.ulysses import local_ulysses_attention, ulysses_attention
from jaxpar.parallel.zero import token_shard_sum
from jaxpar.platform import splash_possible

ULYSSES = ("ulysses", "hybrid")  # the context_impls of parallel/ulysses.py


def model_layout(cfg: Config, mesh_shape: Mapping[str, int], platform: str, *,
                 in_stage: bool = False, by_hand: Mapping[str, int] = MappingProxyType({}),
                 ) -> Layout:
    """The :class:`~jaxpar.model.annotate.Layout` the model runs under on a mesh of
    ``mesh_shape``. ``in_stage``: for a pipeline stage's layers, inside the executor's
    ``shard_map``; ``by_hand``: the axes (and sizes) that split the tokens by hand there:
    attention runs on the device's own piece, and the MoE layers' statistics are summed over
    them. A layout that cannot run raises :class:`~jaxpar.config.ConfigError` here."""
    rules = logical_rules(cfg)
    hand_context = by_hand.get("context", 1)
    batch_axes = tuple(a for a in rules["batch"] if mesh_shape[a] > 1)
    head_axes = {name: tuple(a for a in rules[name] if mesh_shape[a] > 1)
                 for name in ("heads", "kv_heads")}
    if hand_context > 1:
        attention = _stage_context_attention(cfg, hand_context, mesh_shape, batch_axes,
                                             head_axes, platform)
    else:
        attention = _attention(cfg, mesh_shape, batch_axes, head_axes, platform)
    # MoE layers route each device's own tokens (and exchange them over `expert`): without the
    # hook, sorting tokens by expert across a sharded batch would gather the whole batch.
    split_axes = [a for a in (*BATCH_AXES, "context", "tensor") if mesh_shape[a] > 1]
    hand_groups = by_hand.get("expert", 1)
    experts = (expert_parallel(mesh_shape, rules, platform=platform, hand_groups=hand_groups,
                               chunks=cfg.parallel.expert_pieces,
                               ring=fsdp_gather_ring(cfg, platform))
               if cfg.model.moe.enabled and (split_axes or hand_groups > 1) else None)
    if in_stage and platform in workarounds.NO_SHARD_MAP_IN_STAGES:
        _refuse_nested_shard_maps(cfg, split_axes if experts else [], mesh_shape)
    if (in_stage and platform in workarounds.NO_RAGGED_IN_STAGES and hand_groups > 1
            and cfg.model.moe.dispatch == "dropless"):
        raise ConfigError(f"mesh.pipe={cfg.mesh.pipe} with mesh.expert={hand_groups} and "
                          f"model.moe.dispatch=dropless: the TPU compiler "
                          f"({workarounds.CHECKED_LIBTPU}) "
                          f"fails on the ragged all-to-all inside a pipeline stage; use "
                          f"model.moe.dispatch=dropping there (or mesh.pipe=1)")
    hand_devices = math.prod(by_hand.values())
    return Layout(
        constrain=activation_constrainer(rules, mesh_shape, ring=fsdp_gather_ring(cfg, platform)),
        attention=attention,
        experts=experts,
        split_counts=MappingProxyType({name: math.prod(mesh_shape[a] for a in axes)
                                       for name, axes in rules.items()}),
        # (A pipeline stage's loss sums its head gradient itself: no shard_map nested there.)
        token_shard_sum=None if in_stage else token_shard_sum(mesh_shape, rules),
        hand_split=((partial(lax.psum, axis_name=tuple(by_hand)), hand_devices)
                    if hand_devices > 1 else None),
        # bf16 matmuls would otherwise hand the compiler bf16 weight gradients to sum.
        weight_grad_dtype=jnp.dtype(cfg.parallel.reduce_dtype))


def model_hooks(cfg: Config, mesh_shape: Mapping[str, int], platform: str, *,
                in_stage: bool = False, by_hand: Mapping[str, int] = MappingProxyType({}),
                ) -> contextlib.AbstractContextManager[Layout]:
    """A context manager installing :func:`model_layout` (built, and checked, at the call)."""
    return installed(model_layout(cfg, mesh_shape, platform, in_stage=in_stage,
                                  by_hand=by_hand))


def _refuse_nested_shard_maps(cfg: Config, nested: list[str],
                              mesh_shape: Mapping[str, int]) -> None:
    """The one-line error for a pipeline stage that would open a ``shard_map`` over the axes
    ``nested`` (:data:`jaxpar.platform.NO_SHARD_MAP_IN_STAGES`). That is the experts' dispatch
    where ``tensor`` splits the experts; the batch, ``expert`` and the sequence open none."""
    if not nested:
        return
    axes = " ".join(f"mesh.{a}={mesh_shape[a]}" for a in nested)
    raise ConfigError(f"mesh.pipe={cfg.mesh.pipe} with a mixture of experts and {axes}: the TPU "
                      f"compiler ({workarounds.CHECKED_LIBTPU}) aborts on the experts' dispatch "
                      f"shard_map inside a pipeline stage; on TPU a pipelined MoE model needs "
                      f"mesh.tensor=1 (or mesh.pipe=1)")


def _attention(cfg: Config, mesh_shape: Mapping[str, int], batch_axes: tuple[str, ...],
               head_axes: Mapping[str, tuple[str, ...]], platform: str):
    """Attention over ``context`` when the sequence is split (``parallel.context_impl``), else
    the implementation ``model.attention`` resolves to here."""
    m, seq_len, n_context = cfg.model, cfg.train.seq_len, mesh_shape["context"]
    if n_context > 1:
        p, block = cfg.parallel, _context_block(cfg, n_context)
        if p.context_impl in ULYSSES:
            return ulysses_attention(n_context, _ulysses_group(cfg, n_context), p.zigzag,
                                     batch_axes, block,
                                     **_ulysses_options(cfg, head_axes, platform))
        return context_attention(p.context_impl, n_context, p.zigzag, batch_axes, block)
    name = resolve(m.attention, platform, seq_len, m.attention_block, cfg.train.dtype,
                   splash_possible(cfg.mesh.pipe, cfg.mesh.tensor), documents_masked(cfg),
                   model=m)
    attend = attention_fn(name, min(m.attention_block, seq_len), m)
    return per_device(attend, batch_axes, head_axes) if name == "splash" else attend


def _ulysses_group(cfg: Config, n_context: int) -> int:
    """The all-to-all's group: all of ``context`` for ``ulysses``, the hybrid's inner size."""
    return n_context if cfg.parallel.context_impl == "ulysses" else cfg.parallel.ulysses_size


def _ulysses_options(cfg: Config, head_axes: Mapping[str, tuple[str, ...]], platform: str
                     ) -> dict:
    """What ``ulysses`` and ``hybrid`` take besides the ring's arguments: the head axes and, for
    ``ulysses``, the kernel ``model.attention`` resolves to on one device."""
    p, m, seq_len = cfg.parallel, cfg.model, cfg.train.seq_len
    if head_axes["heads"] != head_axes["kv_heads"]:
        raise ConfigError(f"parallel.context_impl={p.context_impl} needs the query and kv heads "
                          f"split over the same axes (parallel.rules: heads="
                          f"{list(head_axes['heads'])}, kv_heads={list(head_axes['kv_heads'])})")
    options = {"head_axes": head_axes["heads"]}
    if p.context_impl == "ulysses":
        name = resolve(m.attention, platform, seq_len, m.attention_block, cfg.train.dtype,
                       splash_possible(cfg.mesh.pipe, cfg.mesh.tensor), documents_masked(cfg),
                       model=m)
        options["kernel"] = attention_fn(name, min(m.attention_block, seq_len), m)
        # A Pallas kernel must see no automatic axis at all (per_device's reason).
        options["one_device_kernel"] = name == "splash"
    return options


def _stage_context_attention(cfg: Config, n: int, mesh_shape: Mapping[str, int],
                             batch_axes: tuple[str, ...],
                             head_axes: Mapping[str, tuple[str, ...]], platform: str):
    """Context attention on a pipeline stage's piece of the sequence (``context`` manual
    already). Ulysses' head axes get a ``shard_map`` of their own, except where nested ones abort
    the compiler (:data:`jaxpar.platform.NO_SHARD_MAP_IN_STAGES`): there the head axis is
    reshaped instead."""
    p, block = cfg.parallel, _context_block(cfg, n)
    if p.context_impl not in ULYSSES:
        return local_context_attention(p.context_impl, n, p.zigzag, block)
    options = _ulysses_options(cfg, head_axes, platform)
    heads, kernel = options["head_axes"], options.get("kernel")
    split = math.prod(mesh_shape[a] for a in heads)
    # (splash is refused there by validation)
    if heads and platform in workarounds.NO_SHARD_MAP_IN_STAGES:
        return local_ulysses_attention(n, _ulysses_group(cfg, n), p.zigzag, split, block, kernel)
    local = local_ulysses_attention(n, _ulysses_group(cfg, n), p.zigzag, 1, block, kernel)
    # (per_device: every automatic axis manual, for the heads and for a Pallas kernel.)
    return (per_device(local, batch_axes, head_axes)
            if heads or options.get("one_device_kernel") else local)


def _context_block(cfg: Config, n_context: int) -> int:
    """Context attention's tile: ``model.attention_block``, at most one piece of the device's
    sequence (one zigzag chunk)."""
    return min(cfg.model.attention_block,
               local_tokens(cfg.train.seq_len, n_context, cfg.parallel.zigzag))


def per_device(attend, batch_axes: tuple[str, ...], head_axes: Mapping[str, tuple[str, ...]]):
    """``attend`` on each device's own sequences and heads. A Pallas kernel is one device's
    program, which the compiler can neither split nor replicate, so every automatic mesh axis
    becomes manual here."""
    rows = batch_axes or None
    q_spec = P(rows, None, head_axes["heads"] or None, None)
    kv_spec = P(rows, None, head_axes["kv_heads"] or None, None)

    def call(q, k, v, positions):
        mesh = jax.sharding.get_abstract_mesh()
        automatic = frozenset(name for name, kind in zip(mesh.axis_names, mesh.axis_types,
                                                         strict=True)
                              if kind != jax.sharding.AxisType.Manual)
        if not automatic:
            return attend(q, k, v, positions)
        # check_vma=False: the kernel's pallas_call cannot say how its outputs vary over the
        # manual axes (they vary over all of them, as q does).
        return jax.shard_map(attend, in_specs=(q_spec, kv_spec, kv_spec, P(rows, None)),
                             out_specs=q_spec, axis_names=automatic, check_vma=False
                             )(q, k, v, positions)
    return call
