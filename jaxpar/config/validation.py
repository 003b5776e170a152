"""Semantic validation: every cross-field rule, in the order a user would fix them, each a
one-line :class:`~jaxpar.config.schema.ConfigError` naming the field and what is allowed."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from jaxpar.config.model_checks import check_model, require
from jaxpar.config.schema import (
    BATCH_AXES,
    LOGICAL_AXES,
    LORA_TARGETS,
    MESH_AXES,
    MLA_LORA_TARGETS,
    Config,
    ConfigError,
    DcnConfig,
    DistributedConfig,
    MeshConfig,
    ModelConfig,
    MoEConfig,
    TrainConfig,
)
from jaxpar.platform import splash_possible

# --------------------------------------------------------------------------------------------
# Semantic validation: one function, every rule, in the order a user would fix them.


def _resolve_mesh(mesh: MeshConfig, device_count: int) -> MeshConfig:
    sizes = mesh.sizes()
    for axis, size in sizes.items():
        if size != -1 and size < 1:
            raise ConfigError(f"mesh.{axis}={size}: axis sizes must be >= 1, or -1 for the rest")
    wild = [a for a, s in sizes.items() if s == -1]
    if len(wild) > 1:
        raise ConfigError(f"mesh: more than one axis is -1 ({', '.join(wild)}); at most one may be")
    fixed = math.prod(s for s in sizes.values() if s != -1)
    shown = " ".join(f"{a}={s}" for a, s in sizes.items() if s != 1)
    if wild:
        if device_count % fixed:
            raise ConfigError(f"mesh: {shown} cannot fill {device_count} devices "
                              f"({device_count} is not divisible by {fixed})")
        sizes[wild[0]] = device_count // fixed
    elif fixed != device_count:
        raise ConfigError(f"mesh: product of axis sizes ({shown or 'all 1'}) is {fixed}, "
                          f"but there are {device_count} devices")
    _check_dcn(sizes, mesh.dcn)
    return MeshConfig(**sizes, dcn=mesh.dcn)


def _check_dcn(sizes: dict[str, int], dcn: DcnConfig) -> None:
    """``mesh.dcn``: each axis's slices divide its size (the rest of it lies inside a slice)."""
    for axis, slices in dcn.sizes().items():
        require(slices >= 1, f"mesh.dcn.{axis}={slices}: must be >= 1 (1: inside one slice)")
        require(sizes[axis] % slices == 0, f"mesh.dcn.{axis}={slices} does not divide "
                f"mesh.{axis}={sizes[axis]} (the axis is split into {slices} slices of equal "
                "size)")


# Axes whose collectives run every layer (forward and backward) and sit on the critical path:
# over the data-center network they are the step's bottleneck.
_LAYER_AXES = ("tensor", "context", "expert")


def slices_line(cfg: Config) -> str | None:
    """What a mesh over several slices puts on the data-center network, for the start-up lines
    of train, plan and inspect (None for one slice): a warning when an axis that communicates
    in every layer spans slices."""
    dcn = cfg.mesh.dcn
    if dcn.slices == 1:
        return None
    over = ", ".join(f"{a}={n}" for a, n in dcn.sizes().items() if n > 1)
    slow = [a for a in _LAYER_AXES if getattr(dcn, a) > 1]
    if not slow:
        return (f"{dcn.slices} slices (mesh.dcn {over}): only those axes' collectives cross the "
                "data-center network")
    return (f"warning: mesh.dcn puts {', '.join(slow)} over the data-center network ({over}): "
            f"{'its' if len(slow) == 1 else 'their'} collectives run in every layer, forward and "
            "backward, at DCN bandwidth (tens of times below ICI); put data, fsdp or pipe over "
            "slices instead")


def validate(cfg: Config, device_count: int) -> Config:
    """Check every cross-field rule; return the config with the mesh's ``-1`` axis resolved.

    The checks run in a fixed order (model, pipeline, mixture of experts, batch and sequence,
    optimiser, parameter sharding, run settings) and the first broken rule is the error."""
    if cfg.host_devices is not None:
        require(cfg.host_devices >= 1, f"host_devices={cfg.host_devices}: must be >= 1")
    mesh = _resolve_mesh(cfg.mesh, device_count)
    cfg = _resolve_chunks(cfg)
    check_model(cfg.model, mesh)
    _check_pipeline(cfg, mesh)
    _check_remat(cfg, mesh)
    _check_moe(cfg, mesh)
    _check_batch(cfg, mesh)
    _check_context(cfg, mesh)
    _check_optimizer(cfg.train)
    _check_lora(cfg)
    _check_sharding(cfg, mesh)
    _check_reduce_dtype(cfg, mesh)
    _check_run(cfg)
    return dataclasses.replace(cfg, mesh=mesh)


def _resolve_chunks(cfg: Config) -> Config:
    """DualPipe-V runs two chunks per stage (its V): ``parallel.virtual_stages`` left at 1
    becomes 2; any other value is an error."""
    p = cfg.parallel
    if p.pipeline_schedule != "dualpipe_v":
        return cfg
    require(p.virtual_stages in (1, 2), f"parallel.virtual_stages={p.virtual_stages}: "
            "dualpipe_v runs two chunks per stage (its V); leave it at 1 or set 2")
    return dataclasses.replace(cfg, parallel=dataclasses.replace(p, virtual_stages=2))


def _check_pipeline(cfg: Config, mesh: MeshConfig) -> None:
    """Pipeline: chunks of whole layers, microbatches only with stages, schedule constraints."""
    m, t, p = cfg.model, cfg.train, cfg.parallel
    v, schedule = p.virtual_stages, p.pipeline_schedule
    require(v >= 1, f"parallel.virtual_stages={v}: must be >= 1")
    require(v == 1 or schedule in ("interleaved", "zero_bubble", "dualpipe_v"),
            f"parallel.virtual_stages={v} needs parallel.pipeline_schedule=interleaved or "
            f"zero_bubble (got {schedule})")
    dense = m.moe.first_dense if m.moe.enabled else 0  # run before the stages, not in them
    less = f" (less model.moe.first_dense={dense})" if dense else ""
    require((m.n_layers - dense) % (mesh.pipe * v) == 0, f"model.n_layers={m.n_layers}{less} "
            f"is not divisible by mesh.pipe x parallel.virtual_stages = {mesh.pipe} x {v} "
            "(layers per chunk)")
    if p.pipeline_fsdp == "per_layer":
        require(mesh.pipe > 1 and mesh.fsdp > 1, "parallel.pipeline_fsdp=per_layer needs "
                f"mesh.pipe > 1 and mesh.fsdp > 1 (got pipe={mesh.pipe}, fsdp={mesh.fsdp}); "
                "use per_step")
        require(t.lora.rank == 0, "parallel.pipeline_fsdp=per_layer: not with train.lora "
                "(the frozen base weights are gathered once per step); use per_step")
    if p.pipeline_overlap:
        require(mesh.pipe > 1, "parallel.pipeline_overlap=true needs mesh.pipe > 1 (it runs a "
                "pipeline round's forward and backward in one layer loop)")
        require(schedule != "gpipe", "parallel.pipeline_overlap=true: gpipe never runs a "
                "forward and a backward in one round; use 1f1b, interleaved, zero_bubble or "
                "dualpipe_v")
        require(t.lora.rank == 0, "parallel.pipeline_overlap=true: not with train.lora (the "
                "layer-by-layer slots take no frozen base weights); set it false")
    _check_pipeline_stash(cfg, mesh)
    require(t.microbatches == 1 or mesh.pipe > 1, f"train.microbatches={t.microbatches} needs "
            "mesh.pipe > 1 (without a pipeline, split a step with train.grad_accum)")
    if schedule == "dualpipe_v" and mesh.pipe > 1:
        require(t.microbatches >= 2 * mesh.pipe, f"train.microbatches={t.microbatches}: "
                f"dualpipe_v needs at least 2 x mesh.pipe = {2 * mesh.pipe} (DualPipe's m >= 2p)")
    elif (schedule == "interleaved" or v > 1) and mesh.pipe > 1:
        require(t.microbatches % mesh.pipe == 0, f"train.microbatches={t.microbatches} is not "
                f"divisible by mesh.pipe={mesh.pipe}, which the {schedule} schedule needs "
                f"with parallel.virtual_stages={v}")


def _check_pipeline_stash(cfg: Config, mesh: MeshConfig) -> None:
    """``parallel.pipeline_stash=inputs`` reruns a chunk in its backward slot: refused where
    the backward is cut into I and W (the W would rerun it again, long after the I)."""
    p = cfg.parallel
    if p.pipeline_stash == "residuals":
        return
    require(mesh.pipe > 1, f"parallel.pipeline_stash={p.pipeline_stash} needs mesh.pipe > 1 "
            "(it is what a pipeline stage keeps between a chunk's forward and backward)")
    require(p.pipeline_schedule in ("gpipe", "1f1b", "interleaved"),
            f"parallel.pipeline_stash={p.pipeline_stash}: not with parallel.pipeline_schedule="
            f"{p.pipeline_schedule}, whose I and W apart would run the chunk again for each; "
            "use gpipe, 1f1b or interleaved, or pipeline_stash=residuals")
    require(not p.pipeline_overlap, f"parallel.pipeline_stash={p.pipeline_stash}: not with "
            "parallel.pipeline_overlap=true (its one layer loop runs a chunk's forward beside "
            "another's backward, not again); set pipeline_stash=residuals")


def _check_remat(cfg: Config, mesh: MeshConfig) -> None:
    """``train.remat_every``: the policy applies to one scanned unit in every k, so k must
    divide the units each layer loop runs (a pipeline chunk's, and the dense first blocks')."""
    k, m = cfg.train.remat_every, cfg.model
    require(k >= 1, f"train.remat_every={k}: must be >= 1")
    if k == 1:
        return
    require(cfg.train.remat != "none", f"train.remat_every={k} needs a train.remat policy "
            "(full, dots, attention or offload_dots): with none every layer keeps everything")
    require(mesh.pipe == 1 or cfg.parallel.pipeline_fsdp == "per_step", f"train.remat_every={k}"
            " with parallel.pipeline_fsdp=per_layer: a stage runs each layer alone there, so the "
            "policy applies to every layer; set train.remat_every=1")
    units = m.n_layers if not m.moe.enabled else (m.n_layers - m.moe.first_dense) // m.moe.every
    chunk = units // (mesh.pipe * cfg.parallel.virtual_stages)
    require(chunk % k == 0, f"train.remat_every={k} does not divide the {chunk} scanned "
            "layers " + ("of a pipeline chunk " if mesh.pipe > 1 else "")
            + "(model.n_layers, in groups of model.moe.every)")
    dense = m.moe.first_dense if m.moe.enabled else 0
    require(dense % k == 0, f"train.remat_every={k} does not divide model.moe.first_dense="
            f"{dense} (the dense first blocks are a layer loop of their own)")


def _check_moe(cfg: Config, mesh: MeshConfig) -> None:
    """Mixture of experts: routing settings, and experts and groups that split evenly."""
    m, p = cfg.model, cfg.parallel
    moe = m.moe
    require(moe.num_experts >= 0, f"model.moe.num_experts={moe.num_experts}: must be >= 0 "
            "(0 = dense)")
    if moe.enabled:
        require(1 <= moe.top_k <= moe.num_experts, f"model.moe.top_k={moe.top_k}: must be in "
                f"[1, model.moe.num_experts={moe.num_experts}]")
        require(moe.every >= 1, f"model.moe.every={moe.every}: must be >= 1")
        _check_first_dense(m, mesh)
        require((m.n_layers - moe.first_dense) % moe.every == 0, f"model.n_layers="
                f"{m.n_layers} (less model.moe.first_dense={moe.first_dense}) is not divisible "
                f"by model.moe.every={moe.every} (the layer stack is scanned in groups of "
                "`every` blocks, the last of each a MoE block)")
        require(m.resolved_d_ff_expert >= 1, f"model.moe.d_ff_expert={moe.d_ff_expert}: must "
                "be >= 1 (or null for model.d_ff)")
        require(moe.num_shared_experts >= 0, f"model.moe.num_shared_experts="
                f"{moe.num_shared_experts}: must be >= 0")
        require(math.isfinite(moe.capacity_factor) and moe.capacity_factor > 0,
                f"model.moe.capacity_factor={moe.capacity_factor}: must be a finite number > 0")
        for name in ("aux_loss_weight", "z_loss_weight", "bias_update_rate"):
            value = getattr(moe, name)
            require(math.isfinite(value) and value >= 0, f"model.moe.{name}={value}: must be a "
                    "finite number >= 0")
        require(moe.num_experts % mesh.expert == 0, f"model.moe.num_experts={moe.num_experts} "
                f"is not divisible by mesh.expert={mesh.expert}")
        require(m.resolved_d_ff_expert % mesh.tensor == 0, f"model.moe.d_ff_expert="
                f"{m.resolved_d_ff_expert} is not divisible by mesh.tensor={mesh.tensor}")
        _check_moe_groups(moe)
        require(p.expert_pieces >= 1, f"parallel.expert_pieces={p.expert_pieces}: must be >= 1")
        require(p.expert_pieces == 1 or moe.dispatch == "dropless", f"parallel.expert_pieces="
                f"{p.expert_pieces} needs model.moe.dispatch=dropless (a dropping layer's "
                "capacity is per routed group: chunks would change which tokens drop)")
        t = cfg.train
        rows = t.batch_size // (t.grad_accum * t.microbatches
                                * math.prod(getattr(mesh, a) for a in BATCH_AXES))
        tokens = rows * (t.seq_len // mesh.context)
        require(tokens % p.expert_pieces == 0, f"parallel.expert_pieces={p.expert_pieces} does "
                f"not divide the {tokens} tokens a device routes in a MoE layer")
        units, chunks = (m.n_layers - moe.first_dense) // moe.every, mesh.pipe * p.virtual_stages
        layers = "(model.n_layers - model.moe.first_dense)" if moe.first_dense else "model.n_layers"
        require(units % chunks == 0, f"{layers} / model.moe.every = {units} groups is "
                f"not divisible by mesh.pipe x parallel.virtual_stages = {chunks} (pipeline "
                "stages take whole groups)")


def _check_moe_groups(moe: MoEConfig) -> None:
    """Group-limited routing (DeepSeek-V3): groups of equal size, enough experts in the kept
    groups for top_k, and a group score (its two best experts) that exists."""
    require(moe.n_group >= 1 and moe.num_experts % moe.n_group == 0, f"model.moe.n_group="
            f"{moe.n_group}: must be >= 1 and divide model.moe.num_experts={moe.num_experts}")
    per_group = moe.num_experts // moe.n_group
    require(1 <= moe.topk_group <= moe.n_group, f"model.moe.topk_group={moe.topk_group}: "
            f"must be in [1, model.moe.n_group={moe.n_group}]")
    require(moe.n_group == 1 or per_group >= 2, f"model.moe.n_group={moe.n_group}: a group "
            f"is scored by its two best experts, so it needs >= 2 (has {per_group})")
    require(moe.top_k <= moe.topk_group * per_group, f"model.moe.top_k={moe.top_k}: more "
            f"than the {moe.topk_group * per_group} experts of the topk_group kept groups")
    require(math.isfinite(moe.routed_scaling_factor) and moe.routed_scaling_factor > 0,
            f"model.moe.routed_scaling_factor={moe.routed_scaling_factor}: must be a finite "
            "number > 0")


def _check_first_dense(m: ModelConfig, mesh: MeshConfig) -> None:
    """Dense blocks before the mixtures: a stack of their own, which a pipeline runs before its
    stages (beside the embedding, with the batch rows split over ``pipe`` too)."""
    first = m.moe.first_dense
    require(0 <= first < m.n_layers, f"model.moe.first_dense={first}: must be in [0, "
            f"model.n_layers={m.n_layers})")
    require(first == 0 or mesh.pipe == 1 or m.sliding_window is None,
            f"model.moe.first_dense={first} with mesh.pipe={mesh.pipe} and "
            f"model.sliding_window={m.sliding_window}: not supported yet (the dense blocks "
            "before the stages carry no window flags)")


def _check_batch(cfg: Config, mesh: MeshConfig) -> None:
    """Batch and sequence: rows for every batch shard, tokens for every sequence shard."""
    t, p = cfg.train, cfg.parallel
    require(t.steps >= 1, f"train.steps={t.steps}: must be >= 1")
    require(t.grad_accum >= 1, f"train.grad_accum={t.grad_accum}: must be >= 1")
    require(t.microbatches >= 1, f"train.microbatches={t.microbatches}: must be >= 1")
    require(t.batch_size >= 1, f"train.batch_size={t.batch_size}: must be >= 1")
    require(t.seq_len >= 2, f"train.seq_len={t.seq_len}: must be >= 2")
    batch_shards = math.prod(getattr(mesh, a) for a in BATCH_AXES)
    per_step = t.grad_accum * t.microbatches * batch_shards
    require(t.batch_size % per_step == 0,
            f"train.batch_size={t.batch_size} is not divisible by grad_accum x microbatches x "
            f"batch shards (data*fsdp*expert) = {t.grad_accum} x {t.microbatches} x "
            f"{batch_shards} = {per_step}")
    seq_shards = mesh.context * 2 if mesh.context > 1 else 1  # load-balanced causal: 2 chunks each
    if p.sequence_parallel:
        seq_shards = math.lcm(seq_shards, mesh.context * mesh.tensor)
    require(t.seq_len % seq_shards == 0,
            f"train.seq_len={t.seq_len} is not divisible by {seq_shards}, which "
            + ("sequence parallelism (context*tensor)" if p.sequence_parallel else
                "context parallelism (2*context)") + " needs")
    _check_attention_blocks(cfg, mesh)
    local_seq = t.seq_len // mesh.context
    require(t.loss_pieces >= 0 and (t.loss_pieces == 0 or local_seq % t.loss_pieces == 0),
            f"train.loss_pieces={t.loss_pieces}: must be 0 (auto) or divide the {local_seq} "
            "tokens of a device's sequence (train.seq_len / mesh.context)")


def _check_context(cfg: Config, mesh: MeshConfig) -> None:
    """``parallel.context_impl=ulysses|hybrid``: the all-to-all splits each tensor shard's
    query heads over its group, which must divide ``context`` (parallel/ulysses.py)."""
    p, m = cfg.parallel, cfg.model
    require(p.ulysses_size == 0 or p.context_impl == "hybrid", f"parallel.ulysses_size="
            f"{p.ulysses_size} is read only by parallel.context_impl=hybrid (got "
            f"{p.context_impl}); leave it 0")
    if mesh.context == 1 or p.context_impl not in ("ulysses", "hybrid"):
        return
    if p.context_impl == "hybrid":
        require(1 < p.ulysses_size < mesh.context and mesh.context % p.ulysses_size == 0,
                f"parallel.ulysses_size={p.ulysses_size}: parallel.context_impl=hybrid needs a "
                f"divisor of mesh.context={mesh.context} between 1 and {mesh.context} "
                f"(exclusive); allowed: "
                + (", ".join(str(d) for d in range(2, mesh.context) if mesh.context % d == 0)
                   or "none (use parallel.context_impl=ulysses or ring)"))
        # (dense is the blockwise kernel's arithmetic; the fused kernels cannot run a ring.)
        require(m.attention not in ("splash", "cudnn"), f"model.attention={m.attention} with "
                "parallel.context_impl=hybrid: its ring runs the blockwise kernels; use auto, "
                "dense or blockwise (or parallel.context_impl=ulysses)")
    size = mesh.context if p.context_impl == "ulysses" else p.ulysses_size
    require(m.n_heads % (mesh.tensor * size) == 0, f"model.n_heads={m.n_heads} is not "
            f"divisible by mesh.tensor x the all-to-all group ({mesh.tensor} x {size}), which "
            f"parallel.context_impl={p.context_impl} splits the heads over; use ring or "
            "allgather" + (", or a smaller parallel.ulysses_size" if p.context_impl == "hybrid"
                          else ", or hybrid"))


def _check_attention_blocks(cfg: Config, mesh: MeshConfig) -> None:
    """Blockwise attention tiles the sequence a device attends with (each chunk of it, under
    context parallelism) into blocks of ``model.attention_block``, or one block if shorter."""
    m, t = cfg.model, cfg.train
    require(m.attention_block >= 1, f"model.attention_block={m.attention_block}: must be >= 1")
    tiled = t.seq_len // (mesh.context * (2 if cfg.parallel.zigzag else 1)
                          if mesh.context > 1 else 1)
    if cfg.parallel.context_impl == "ulysses":  # attends the whole sequence, in natural order
        tiled = t.seq_len
    # cfg.mesh, as before the move to jaxpar/platform.py (a -1 axis counts as unsplit here).
    require(m.attention != "splash" or splash_possible(cfg.mesh.pipe, cfg.mesh.tensor),
            f"model.attention=splash cannot run in pipeline stages split over tensor "
            f"(mesh.pipe={mesh.pipe} mesh.tensor={mesh.tensor}): the TPU compiler aborts; "
            "use auto (blockwise there) or blockwise")
    ulysses = mesh.context > 1 and cfg.parallel.context_impl == "ulysses"
    if m.attention in ("auto", "blockwise") or (mesh.context > 1 and not ulysses):
        require(tiled <= m.attention_block or tiled % m.attention_block == 0,
                f"model.attention_block={m.attention_block} does not divide the {tiled} tokens "
                "blockwise attention tiles (train.seq_len" + (" / context chunks" if
                                                               mesh.context > 1 else "")
                + "); pick a divisor, or a block at least that long")


def _check_optimizer(t: TrainConfig) -> None:
    """Optimiser and schedule."""
    require(math.isfinite(t.lr) and t.lr > 0, f"train.lr={t.lr}: must be a finite number > 0")
    require(0 <= t.min_lr_ratio <= 1, f"train.min_lr_ratio={t.min_lr_ratio}: must be in [0, 1]")
    require(0 <= t.warmup_steps, f"train.warmup_steps={t.warmup_steps}: must be >= 0")
    require(math.isfinite(t.decay_fraction) and 0 < t.decay_fraction <= 1,
            f"train.decay_fraction={t.decay_fraction}: must be in (0, 1] (the share of "
            "train.steps that lr_schedule=wsd decays over)")
    require(t.grad_clip >= 0, f"train.grad_clip={t.grad_clip}: must be >= 0 (0 disables)")


def _check_lora(cfg: Config) -> None:
    """``train.lora``: targets the model has, a positive rank, the dropout, and the layouts
    the adapters run on (not yet: dense first blocks or dropout in a pipeline)."""
    lora, m = cfg.train.lora, cfg.model
    require(lora.rank >= 0, f"train.lora.rank={lora.rank}: must be >= 0 (0: no adapters)")
    if lora.rank == 0:
        return
    for target in lora.targets:
        require(target in LORA_TARGETS + MLA_LORA_TARGETS, f"train.lora.targets: {target!r} "
                 f"is not a LoRA target (allowed: {', '.join(LORA_TARGETS + MLA_LORA_TARGETS)})")
        _check_lora_attention_target(m, target)
    require(len(lora.targets) > 0, "train.lora.targets: empty; name one or more of "
            + ", ".join(LORA_TARGETS))
    _check_lora_dropout(cfg)
    require(math.isfinite(lora.alpha) and lora.alpha > 0,
            f"train.lora.alpha={lora.alpha}: must be a finite number > 0")
    # They run before the stages, differentiated by hand as a whole (pipeline/dense_first.py).
    require(cfg.mesh.pipe == 1 or not (m.moe.enabled and m.moe.first_dense),
            "train.lora: dense first blocks (model.moe.first_dense > 0) in a pipeline "
            "(mesh.pipe > 1) are not supported yet")


def _check_lora_attention_target(m: ModelConfig, target: str) -> None:
    """An attention target the model has: q, k, v without latent attention; with it (model.mla)
    q_a, q_b (or q where model.mla.q_lora_rank is 0), kv_a, kv_b."""
    if not m.mla.enabled:
        require(target not in MLA_LORA_TARGETS, f"train.lora.targets: {target!r} is a latent "
                 "attention projection and this model has none (model.mla is off); allowed "
                 "here: " + ", ".join(LORA_TARGETS))
        return
    queries = ("q_a", "q_b") if m.mla.q_lora_rank else ("q",)
    allowed = (*queries, "kv_a", "kv_b", "o", "gate", "up", "down")
    require(target in allowed, f"train.lora.targets: {target!r}: this model has no {target} "
            "projection (model.mla: its attention is latent); allowed here: "
            + ", ".join(allowed))


def _check_lora_dropout(cfg: Config) -> None:
    """``train.lora.dropout``: a probability in [0, 1), not on the routed experts' adapters
    (whose rows carry no token numbers for the masks yet: jaxpar/model/lora.py, dropped_out)."""
    lora, m, p = cfg.train.lora, cfg.model, cfg.train.lora.dropout
    require(math.isfinite(p) and 0 <= p < 1, f"train.lora.dropout={p}: must be in [0, 1)")
    if p == 0:
        return
    require(not (m.moe.enabled and set(lora.targets) & {"gate", "up", "down"}),
            "train.lora.dropout > 0: not with the routed experts' adapters (gate, up, down "
            "of a mixture-of-experts model) yet; allowed targets here: q, k, v, o")
    # The pipeline executor does not carry the batch's token numbers the masks are drawn from.
    require(cfg.mesh.pipe == 1, f"train.lora.dropout={p}: not in pipelines (mesh.pipe > 1) "
            "yet; 0 runs there")


def _check_sharding(cfg: Config, mesh: MeshConfig) -> None:
    """Sharding of parameters: ZeRO-3 splits the embed dim over fsdp; ZeRO-1 splits the
    optimizer state's embed dim over every batch axis. Rule overrides name known axes."""
    m, p = cfg.model, cfg.parallel
    zero_shards = mesh.fsdp if p.zero == 3 else mesh.data * mesh.fsdp
    require(m.d_model % zero_shards == 0, f"model.d_model={m.d_model} is not divisible by "
            f"{zero_shards}, the " + ("fsdp axis (ZeRO-3)" if p.zero == 3 else
                                      "data*fsdp axes that ZeRO-1 shards optimizer state over"))
    for logical, axes in p.rules.items():
        require(logical in LOGICAL_AXES, f"parallel.rules.{logical}: unknown logical axis; "
                f"allowed: {', '.join(LOGICAL_AXES)}")
        for axis in axes:
            require(axis in MESH_AXES, f"parallel.rules.{logical}: unknown mesh axis {axis!r}; "
                    f"allowed: {', '.join(MESH_AXES)}")


def _check_reduce_dtype(cfg: Config, mesh: MeshConfig) -> None:
    """``parallel.reduce_dtype=bfloat16`` where the partitioner sums in float32 matmuls' dtype.
    jaxpar's own sums (parallel/zero.py: data_summed_by_hand) take any dtype; the partitioner's
    run in the matmul's dtype, which ``project_all`` widens but never narrows."""
    if cfg.parallel.reduce_dtype == "float32" or mesh.pipe > 1 or cfg.train.dtype == "bfloat16":
        return
    require(mesh.fsdp == 1 and not (cfg.model.moe.enabled and mesh.data > 1),
            "parallel.reduce_dtype=bfloat16 with mesh.fsdp > 1 or a mixture of experts needs "
            "train.dtype=bfloat16 (the partitioner reduces those gradients in train.dtype)")


def _check_run(cfg: Config) -> None:
    """Data, checkpoints, logging."""
    t = cfg.train
    require(0 <= cfg.data.val_fraction < 1, f"data.val_fraction={cfg.data.val_fraction}: must "
            "be in [0, 1)")
    require(cfg.data.max_bytes >= 0, f"data.max_bytes={cfg.data.max_bytes}: must be >= 0")
    require(cfg.data.text_field.strip() != "", "data.text_field is empty; allowed: the name of "
            "the JSON field or column that holds the text")
    _check_sources(cfg)
    _check_loss_on(cfg)
    check_generation(cfg)
    require(cfg.checkpoint.every >= 0, f"checkpoint.every={cfg.checkpoint.every}: must be >= 0")
    require(cfg.checkpoint.keep >= 1, f"checkpoint.keep={cfg.checkpoint.keep}: must be >= 1")
    require(t.resume.strip() != "", "train.resume is empty; allowed: auto, never, a step number "
            "or a checkpoint path")
    if t.init_from is not None:
        require(t.init_from.strip() != "", "train.init_from is empty; allowed: null or a "
                "checkpoint path")
        # auto and never leave room for init_from (auto: a rerun resumes its own checkpoint);
        # a named checkpoint to resume and weights to start from contradict each other.
        require(t.resume.strip() in ("auto", "never"), f"train.init_from={t.init_from} and "
                f"train.resume={t.resume} both name where to start; set one (train.resume=auto "
                "resumes run_dir's own checkpoints before init_from applies)")
    require(cfg.logging.every >= 1, f"logging.every={cfg.logging.every}: must be >= 1")
    require(t.eval_every >= 0, f"train.eval_every={t.eval_every}: must be >= 0 (0: no "
            "validation)")
    require(t.eval_batches >= 1, f"train.eval_batches={t.eval_batches}: must be >= 1")
    _check_profile(cfg)
    _check_wandb(cfg)


def check_generation(cfg: Config) -> None:
    """``generation.eos_ids``: token ids of the model's vocabulary (also checked by the commands
    that generate, which do not validate the whole config)."""
    vocab = cfg.model.vocab_size
    bad = [i for i in cfg.generation.eos_ids if not 0 <= i < vocab]
    require(not bad, f"generation.eos_ids={list(cfg.generation.eos_ids)}: {bad[0] if bad else 0} "
            f"is not a token id; allowed: ids in [0, {vocab}) (model.vocab_size), or [] for "
             "the tokenizer's end-of-text token")


def _check_sources(cfg: Config) -> None:
    """``data.sources``: a mixture instead of ``data.source``, positive weights. Whether each
    path is a tokenized directory is the data's check (jaxpar/data/mixture.py), at start-up."""
    d = cfg.data
    # data.source's default is stdlib, which a preset may also spell out: only another value
    # counts as "set", so `jaxpar train tiny data.sources=[...]` works on any preset.
    require(not d.sources or d.source == "stdlib", f"data.source={d.source} and data.sources "
            "are both set; a run reads one source or a mixture: drop one of them")
    for i, s in enumerate(d.sources):
        require(s.path.strip() != "", f"data.sources[{i}].path is empty; allowed: a directory "
                "written by jaxpar tokenize")
        require(math.isfinite(s.weight) and s.weight > 0, f"data.sources[{i}].weight="
                f"{s.weight}: must be a finite number > 0")


def tokenized_directory(source: str) -> bool:
    """Whether ``data.source`` is a directory ``jaxpar tokenize`` wrote (it has the index)."""
    return (Path(source).expanduser() / "index.json").is_file()


def documents_masked(cfg: Config) -> bool:
    """``data.document_mask``, null resolved: true for a mixture, chat or a tokenized directory."""
    d = cfg.data
    if d.document_mask is not None:
        return d.document_mask
    return bool(d.sources) or d.loss_on == "assistant" or tokenized_directory(d.source)


def _check_loss_on(cfg: Config) -> None:
    """``data.loss_on``: assistant reads chat .jsonl with a tokenizer.json's chat template."""
    d = cfg.data
    require(d.loss_on in ("all", "assistant"), f"data.loss_on={d.loss_on}; allowed: all, "
            "assistant")
    if d.loss_on != "assistant":
        return
    require(d.tokenizer != "byte", "data.loss_on=assistant with data.tokenizer=byte: the chat "
            "template comes from the tokenizer_config.json beside a tokenizer.json; set "
            "data.tokenizer to one")
    require(not d.sources and not tokenized_directory(d.source),
            f"data.loss_on=assistant reads chat .jsonl, not a tokenized directory or mixture "
            f"(data.source={d.source}); use a .jsonl file, directory or glob")
    require(d.source != "stdlib", "data.loss_on=assistant with data.source=stdlib: allowed: "
            "chat .jsonl (a file, directory or glob)")


def _check_profile(cfg: Config) -> None:
    """``train.profile``: whole steps inside the run."""
    p, steps = cfg.train.profile, cfg.train.steps
    require(p.steps >= 1, f"train.profile.steps={p.steps}: must be >= 1")
    if not p.enabled:
        return
    require(p.start_step >= 1, f"train.profile.start_step={p.start_step}: must be >= 1 (steps "
            "count from 1), or null for no trace")
    last = p.start_step + p.steps - 1
    require(last <= steps, f"train.profile.start_step={p.start_step} + train.profile.steps="
            f"{p.steps} traces up to step {last}, beyond train.steps={steps}")


# W&B refuses these in a project name, and tags longer than 64 characters.
_PROJECT_FORBIDDEN = "/\\#?%:"
_TAG_CHARS = 64


def _check_wandb(cfg: Config) -> None:
    """``logging.wandb``: names W&B accepts (its mode is a Literal: the loader checks it)."""
    w = cfg.logging.wandb
    for key in ("project", "entity", "name", "group"):
        value = getattr(w, key)
        require(value is None or value.strip() != "", f"logging.wandb.{key} is empty; allowed: "
                "null or a name")
    require(w.project is None or not any(c in w.project for c in _PROJECT_FORBIDDEN),
            f"logging.wandb.project={w.project}: W&B project names cannot hold any of "
            f"{' '.join(_PROJECT_FORBIDDEN)}")
    for tag in w.tags:
        require(0 < len(tag.strip()) and len(tag) <= _TAG_CHARS, f"logging.wandb.tags: {tag!r}"
                f" is not allowed; allowed: 1 to {_TAG_CHARS} characters")
    require(w.init_timeout_s > 0 and math.isfinite(w.init_timeout_s), f"logging.wandb."
            f"init_timeout_s={w.init_timeout_s}: must be a finite number > 0 (seconds)")


def check_distributed(d: DistributedConfig) -> None:
    """Before jax starts (joining the runtime comes first): the process fields make sense."""
    require(d.timeout_s >= 1, f"distributed.timeout_s={d.timeout_s}: must be >= 1")
    host, _, port = (d.coordinator or "h:1").rpartition(":")
    require(bool(host) and port.isdigit(), f"distributed.coordinator={d.coordinator}: expected "
            "host:port, e.g. 10.0.0.1:1234")
    require(d.num_processes is None or d.num_processes >= 1, f"distributed.num_processes="
            f"{d.num_processes}: must be >= 1")
    if d.process_id is not None:
        require(0 <= d.process_id < (d.num_processes or d.process_id + 1), f"distributed."
                f"process_id={d.process_id}: must be in [0, distributed.num_processes)")
    ids = (d.local_device_ids or "0").split(",")
    require(all(i.strip().isdigit() for i in ids), f"distributed.local_device_ids="
            f"{d.local_device_ids}: expected comma-separated device ids, e.g. 0,1,2,3")
