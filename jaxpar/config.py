"""Configuration: frozen dataclasses, YAML presets, ``key=value`` overrides, and all validation.

Everything a user can get wrong is caught here, before jax is imported or anything is compiled, and
reported as a one-line :class:`ConfigError` naming the field and the allowed values (the CLI turns
it into exit code 2). This module deliberately imports neither jax nor flax: the CLI must read the
config (``host_devices``) before jax initialises its backend.

The one exception is the device count, which only jax knows: :func:`validate` takes it as an
argument, so callers resolve it once (``host_devices`` or ``jax.device_count()``) and pass it in.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

MESH_AXES = ("pipe", "data", "fsdp", "expert", "context", "tensor")
"""Mesh axis names, outermost first; the innermost axis should get the fastest links."""

BATCH_AXES = ("data", "fsdp", "expert")
"""Mesh axes the global batch is split over (``expert`` is extra data parallelism outside MoE)."""

LOGICAL_AXES = (
    "batch", "seq", "residual_seq", "embed", "act_embed", "heads", "kv_heads", "head_dim",
    "mlp", "vocab", "experts", "layers", "stage",
)
"""Logical axis names the model annotates; :mod:`jaxpar.parallel.rules` maps them to mesh axes."""

PRESETS_DIR = Path(__file__).resolve().parent.parent / "configs"


class ConfigError(ValueError):
    """A one-line, user-facing configuration error (the CLI exits with code 2)."""


@dataclass(frozen=True)
class MoEConfig:
    """Mixture of experts (``jaxpar/model/moe.py``); ``num_experts: 0`` is a dense model."""

    num_experts: int = 0  # 0 = dense model
    top_k: int = 2  # experts each token is sent to
    every: int = 1  # the last block of every group of `every` blocks is a MoE block
    d_ff_expert: int | None = None  # hidden size of one expert; default model.d_ff
    num_shared_experts: int = 0  # experts every token always uses (DeepSeek), d_ff_expert each
    router: Literal["softmax", "sigmoid_bias"] = "softmax"
    dispatch: Literal["dropless", "dropping"] = "dropless"
    capacity_factor: float = 1.25  # dropping: slots per expert = factor x tokens x top_k / experts
    aux_loss_weight: float = 0.01  # Switch/GShard load-balancing loss
    z_loss_weight: float = 0.001  # router z-loss (ST-MoE)
    bias_update_rate: float = 0.001  # sigmoid_bias: step of the aux-loss-free bias update

    @property
    def enabled(self) -> bool:
        return self.num_experts > 0

    def capacity(self, tokens: int) -> int:
        """Slots per expert in dropping mode for a group of ``tokens`` tokens:
        ceil(capacity_factor x tokens x top_k / num_experts), within [1, tokens].

        An expert can never receive more than ``tokens`` slots (a token picks top_k *distinct*
        experts), so a larger buffer would only hold padding.
        """
        wanted = math.ceil(self.capacity_factor * tokens * self.top_k / self.num_experts)
        return max(1, min(tokens, wanted))


@dataclass(frozen=True)
class ModelConfig:
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int | None = None  # default d_model // n_heads
    d_ff: int = 128
    vocab_size: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02
    # auto: cuDNN on a GPU in 16-bit, else blockwise when the sequence spans several blocks
    attention: Literal["auto", "dense", "blockwise", "cudnn"] = "auto"
    attention_block: int = 512  # queries x keys per block of blockwise (and ring) attention
    moe: MoEConfig = field(default_factory=MoEConfig)

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.d_model // self.n_heads

    @property
    def resolved_d_ff_expert(self) -> int:
        return self.moe.d_ff_expert if self.moe.d_ff_expert is not None else self.d_ff

    @property
    def n_moe_layers(self) -> int:
        """MoE blocks in the stack: one per group of ``moe.every`` blocks (0 for a dense model)."""
        return self.n_layers // self.moe.every if self.moe.enabled else 0


@dataclass(frozen=True)
class MeshConfig:
    pipe: int = 1
    data: int = -1
    fsdp: int = 1
    expert: int = 1
    context: int = 1
    tensor: int = 1

    def sizes(self) -> dict[str, int]:
        return {axis: getattr(self, axis) for axis in MESH_AXES}


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 100
    batch_size: int = 8  # global sequences per optimizer step
    seq_len: int = 64
    seed: int = 0
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 10
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # global-norm clip; 0 disables
    microbatches: int = 1  # pipeline microbatches per micro-step
    grad_accum: int = 1  # micro-steps summed per optimizer step
    remat: Literal["none", "full", "dots"] = "none"
    dtype: Literal["float32", "bfloat16"] = "float32"
    # auto: continue from the newest complete checkpoint in run_dir/checkpoints, if any;
    # never: start fresh; N: run_dir/checkpoints/N; else a path (a step directory, or a
    # checkpoints/ or run directory whose newest checkpoint is taken). See train/checkpoint.py.
    resume: str = "auto"
    # A non-finite loss or gradient norm: skip drops that update (counted as skipped_steps in
    # metrics.jsonl); stop exits 1 naming the step, saving nothing after it.
    on_nonfinite: Literal["skip", "stop"] = "stop"


@dataclass(frozen=True)
class ParallelConfig:
    sequence_parallel: bool = False
    zero: Literal[1, 3] = 3
    context_impl: Literal["ring", "allgather"] = "ring"
    zigzag: bool = True  # load-balanced causal layout for context parallelism
    pipeline_schedule: Literal["gpipe", "1f1b", "interleaved", "zero_bubble"] = "gpipe"
    virtual_stages: int = 1
    # Overrides of the logical -> mesh axis table, e.g. {"mlp": ["tensor"], "embed": []}.
    rules: dict[str, tuple[str, ...]] = field(default_factory=dict)


@dataclass(frozen=True)
class DataConfig:
    source: str = "stdlib"  # 'stdlib' or a path/glob of .txt/.md/.py/.jsonl/.parquet files
    tokenizer: str = "byte"  # 'byte' or a path to a tokenizer.json
    val_fraction: float = 0.01
    max_bytes: int = 8_000_000  # cap on corpus text read (0 = no cap)
    shuffle: bool = True


@dataclass(frozen=True)
class CheckpointConfig:
    every: int = 100  # steps between checkpoints; 0 = only at the end (and on SIGTERM/SIGINT)
    keep: int = 3  # newest checkpoints kept in run_dir/checkpoints
    enabled: bool = True  # false: save nothing (train.resume still reads existing checkpoints)


@dataclass(frozen=True)
class LoggingConfig:
    every: int = 10  # steps between log lines / metrics.jsonl rows
    progress: bool = True  # rich progress bar


@dataclass(frozen=True)
class DistributedConfig:
    """Several processes (one per host or GPU) on JAX's multi-controller runtime; see
    ``jaxpar/mesh.py:start_distributed``. The four fields below ``enabled`` may all stay null
    where JAX detects the cluster itself (SLURM, Open MPI, TPU pods, Kubernetes)."""

    # auto: join when the cluster runs several processes of this job or a field below is set;
    # on: always join (cluster detection or the fields); off: one process, never join.
    enabled: Literal["auto", "on", "off"] = "auto"
    coordinator: str | None = None  # host:port of process 0, where the runtime's service listens
    num_processes: int | None = None
    process_id: int | None = None  # 0 .. num_processes-1
    local_device_ids: str | None = None  # comma-separated ids of this process's devices
    timeout_s: int = 30  # wait for every process at start-up and shut-down; a silent one is dead

    def fields_given(self) -> bool:
        return any(v is not None for v in (self.coordinator, self.num_processes, self.process_id,
                                           self.local_device_ids))


@dataclass(frozen=True)
class Config:
    host_devices: int | None = None  # N virtual CPU devices (forces the CPU platform)
    run_dir: str = "runs/default"
    model: ModelConfig = field(default_factory=ModelConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)

    @property
    def mesh_shape(self) -> dict[str, int]:
        """Axis sizes; only meaningful after :func:`validate` resolved any ``-1``."""
        return self.mesh.sizes()

    def batch_shards(self) -> int:
        return math.prod(getattr(self.mesh, a) for a in BATCH_AXES)


# --------------------------------------------------------------------------------------------
# Building a Config from nested dicts, with types checked against the dataclass schema.


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(str(a) for a in typing.get_args(tp))
    if _is_optional(tp):
        return _type_name(_strip_optional(tp)) + " or null"
    return getattr(tp, "__name__", str(tp))


# Plain-text fields whose allowed forms are worth naming in a type error.
_FORMS = {"train.resume": "auto, never, a step number or a checkpoint path"}


def _is_optional(tp: Any) -> bool:
    union = typing.get_origin(tp) in (typing.Union, types.UnionType)
    return union and type(None) in typing.get_args(tp)


def _strip_optional(tp: Any) -> Any:
    return next(a for a in typing.get_args(tp) if a is not type(None))


def _parse_scalar_text(text: str) -> Any:
    """Read an override's right-hand side as YAML would (``2`` -> int, ``true`` -> bool)."""
    try:
        return yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        return text


def _coerce(key: str, tp: Any, value: Any) -> Any:
    """Check ``value`` against the schema type ``tp``; return it converted, or raise ConfigError."""
    if _is_optional(tp):
        if value is None or (isinstance(value, str) and value.lower() in ("null", "none")):
            return None
        tp = _strip_optional(tp)
    origin = typing.get_origin(tp)
    bad = ConfigError(f"{key}: expected {_FORMS.get(key, _type_name(tp))}, got {value!r}")
    if origin is Literal:
        allowed = typing.get_args(tp)
        if isinstance(value, bool) and {"on", "off"} <= set(allowed):  # YAML 1.1 reads on/off
            value = "on" if value else "off"
        if not any(value == a and type(value) is type(a) for a in allowed):
            raise ConfigError(f"{key}: {value!r} is not allowed; allowed values: "
                              + ", ".join(str(a) for a in allowed))
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise bad
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise bad
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise bad
    if origin is dict:  # parallel.rules: logical axis -> tuple of mesh axes
        if not isinstance(value, Mapping):
            raise bad
        return {str(k): _coerce_axes(f"{key}.{k}", v) for k, v in value.items()}
    raise bad


def _coerce_axes(key: str, value: Any) -> tuple[str, ...]:
    if value is None or value == "" or (isinstance(value, str) and value.lower() == "none"):
        return ()
    if isinstance(value, str):
        value = [v.strip() for v in value.split(",") if v.strip()]
    if not isinstance(value, Sequence) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{key}: expected a list of mesh axes ({', '.join(MESH_AXES)}), "
                          f"got {value!r}")
    return tuple(value)


def _build(cls: type, data: Mapping[str, Any], prefix: str) -> Any:
    if not isinstance(data, Mapping):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        if key not in names:
            raise ConfigError(f"unknown key {prefix}{key}; allowed keys: {', '.join(names)}")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = _build(tp, value, f"{prefix}{key}.")
        else:
            kwargs[key] = _coerce(f"{prefix}{key}", tp, value)
    return cls(**kwargs)


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    """Insert ``value`` at ``a.b.c`` in nested dicts (schema checks happen later, in _build)."""
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{dotted}: {part} is a value, not a section")
        node = child
    node[parts[-1]] = value


def _to_dict(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {f.name: _to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {k: _to_dict(v) for k, v in obj.items()}
    if isinstance(obj, tuple):
        return [_to_dict(v) for v in obj]
    return obj


def to_dict(cfg: Config) -> dict[str, Any]:
    """Plain nested dict of the config (what ``run_dir/config.yaml`` holds)."""
    return _to_dict(cfg)


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def resolve_config_path(name_or_path: str) -> Path:
    """A YAML path, or the name of a preset in ``configs/`` (``tiny`` or ``tiny.yaml``)."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    for candidate in (PRESETS_DIR / name_or_path, PRESETS_DIR / f"{name_or_path}.yaml"):
        if candidate.is_file():
            return candidate
    presets = sorted(p.stem for p in PRESETS_DIR.glob("*.yaml")) if PRESETS_DIR.is_dir() else []
    raise ConfigError(f"config {name_or_path!r} is neither a YAML file nor a preset; presets: "
                      + (", ".join(presets) or "(none found)"))


def parse_overrides(overrides: Sequence[str]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key=value, e.g. mesh.tensor=2")
        key, text = item.split("=", 1)
        key = key.strip()
        if not key:
            raise ConfigError(f"override {item!r} has an empty key")
        if key.startswith("parallel.rules."):
            value: Any = _coerce_axes(key, text)
        else:
            value = _parse_scalar_text(text)
        _set_dotted(tree, key, value)
    return tree


def _merge(base: dict, extra: Mapping) -> dict:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def load_config(name_or_path: str | None = None, overrides: Sequence[str] = ()) -> Config:
    """Read a preset/YAML file and apply ``key=value`` overrides; types are checked, the device
    count is not (call :func:`validate` once it is known)."""
    data: dict[str, Any] = {}
    if name_or_path is not None:
        path = resolve_config_path(name_or_path)
        try:
            loaded = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            raise ConfigError(f"{path}: not valid YAML{where} "
                              f"({str(err).splitlines()[0]})") from None
        except (OSError, UnicodeDecodeError) as err:
            raise ConfigError(f"{path}: cannot read the config file ({err})") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: expected a mapping at the top level")
        data = loaded
    data = _merge(data, parse_overrides(overrides))
    cfg = _build(Config, data, "")
    # Checked here, not in validate(): the device count that validate() needs comes from it.
    if cfg.host_devices is not None and cfg.host_devices < 1:
        raise ConfigError(f"host_devices={cfg.host_devices}: must be >= 1 (or null for the "
                          "devices jax finds)")
    _check_distributed(cfg.distributed)
    return cfg


def _check_distributed(d: DistributedConfig) -> None:
    """Before jax starts (joining the runtime comes first): the process fields make sense."""
    _require(d.timeout_s >= 1, f"distributed.timeout_s={d.timeout_s}: must be >= 1")
    host, _, port = (d.coordinator or "h:1").rpartition(":")
    _require(bool(host) and port.isdigit(), f"distributed.coordinator={d.coordinator}: expected "
             "host:port, e.g. 10.0.0.1:1234")
    _require(d.num_processes is None or d.num_processes >= 1, f"distributed.num_processes="
             f"{d.num_processes}: must be >= 1")
    if d.process_id is not None:
        _require(0 <= d.process_id < (d.num_processes or d.process_id + 1), f"distributed."
                 f"process_id={d.process_id}: must be in [0, distributed.num_processes)")
    ids = (d.local_device_ids or "0").split(",")
    _require(all(i.strip().isdigit() for i in ids), f"distributed.local_device_ids="
             f"{d.local_device_ids}: expected comma-separated device ids, e.g. 0,1,2,3")


def config_from_dict(data: Mapping[str, Any]) -> Config:
    return _build(Config, data, "")


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
    return MeshConfig(**sizes)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def validate(cfg: Config, device_count: int) -> Config:
    """Check every cross-field rule; return the config with the mesh's ``-1`` axis resolved.

    The checks run in a fixed order (model, pipeline, mixture of experts, batch and sequence,
    optimiser, parameter sharding, run settings) and the first broken rule is the error."""
    if cfg.host_devices is not None:
        _require(cfg.host_devices >= 1, f"host_devices={cfg.host_devices}: must be >= 1")
    mesh = _resolve_mesh(cfg.mesh, device_count)
    _check_model(cfg.model, mesh)
    _check_pipeline(cfg, mesh)
    _check_moe(cfg, mesh)
    _check_batch(cfg, mesh)
    _check_optimizer(cfg.train)
    _check_sharding(cfg, mesh)
    _check_run(cfg)
    return dataclasses.replace(cfg, mesh=mesh)


def _check_model(m: ModelConfig, mesh: MeshConfig) -> None:
    """Model shape: positive sizes, grouped-query heads, rotary's even head_dim, tensor splits."""
    for name in ("d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "vocab_size"):
        value = getattr(m, name)
        _require(value >= 1, f"model.{name}={value}: must be >= 1")
    _require(m.n_heads % m.n_kv_heads == 0, f"model.n_heads={m.n_heads} must be a multiple of "
             f"model.n_kv_heads={m.n_kv_heads} (grouped-query attention)")
    if m.head_dim is None:
        _require(m.d_model % m.n_heads == 0, f"model.d_model={m.d_model} must be divisible by "
                 f"model.n_heads={m.n_heads} (or set model.head_dim)")
    _require(m.resolved_head_dim % 2 == 0, f"model.head_dim={m.resolved_head_dim}: rotary "
             "embeddings need an even head_dim")
    for name in ("n_heads", "n_kv_heads", "d_ff", "vocab_size"):
        value = getattr(m, name)
        _require(value % mesh.tensor == 0, f"model.{name}={value} is not divisible by "
                 f"mesh.tensor={mesh.tensor}")


def _check_pipeline(cfg: Config, mesh: MeshConfig) -> None:
    """Pipeline: chunks of whole layers, microbatches only with stages, schedule constraints."""
    m, t, p = cfg.model, cfg.train, cfg.parallel
    v, schedule = p.virtual_stages, p.pipeline_schedule
    _require(v >= 1, f"parallel.virtual_stages={v}: must be >= 1")
    _require(v == 1 or schedule == "interleaved", f"parallel.virtual_stages={v} needs "
             f"parallel.pipeline_schedule=interleaved (got {schedule})")
    _require(m.n_layers % (mesh.pipe * v) == 0, f"model.n_layers={m.n_layers} is not divisible "
             f"by mesh.pipe x parallel.virtual_stages = {mesh.pipe} x {v} (layers per chunk)")
    _require(t.microbatches == 1 or mesh.pipe > 1, f"train.microbatches={t.microbatches} needs "
             "mesh.pipe > 1 (without a pipeline, split a step with train.grad_accum)")
    if schedule == "interleaved" and mesh.pipe > 1:
        _require(t.microbatches % mesh.pipe == 0, f"train.microbatches={t.microbatches} is not "
                 f"divisible by mesh.pipe={mesh.pipe}, which the interleaved schedule needs")
    # The pipeline splits the vocabulary (embedding, head, loss) into one piece per stage,
    # each split again over tensor.
    _require(mesh.pipe == 1 or m.vocab_size % (mesh.pipe * mesh.tensor) == 0,
             f"model.vocab_size={m.vocab_size} is not divisible by mesh.pipe x mesh.tensor = "
             f"{mesh.pipe * mesh.tensor} (the pipeline splits the vocabulary over both)")


def _check_moe(cfg: Config, mesh: MeshConfig) -> None:
    """Mixture of experts: routing settings, and experts and groups that split evenly."""
    m, p = cfg.model, cfg.parallel
    moe = m.moe
    _require(moe.num_experts >= 0, f"model.moe.num_experts={moe.num_experts}: must be >= 0 "
             "(0 = dense)")
    if moe.enabled:
        _require(1 <= moe.top_k <= moe.num_experts, f"model.moe.top_k={moe.top_k}: must be in "
                 f"[1, model.moe.num_experts={moe.num_experts}]")
        _require(moe.every >= 1, f"model.moe.every={moe.every}: must be >= 1")
        _require(m.n_layers % moe.every == 0, f"model.n_layers={m.n_layers} is not divisible "
                 f"by model.moe.every={moe.every} (the layer stack is scanned in groups of "
                 "`every` blocks, the last of each a MoE block)")
        _require(m.resolved_d_ff_expert >= 1, f"model.moe.d_ff_expert={moe.d_ff_expert}: must "
                 "be >= 1 (or null for model.d_ff)")
        _require(moe.num_shared_experts >= 0, f"model.moe.num_shared_experts="
                 f"{moe.num_shared_experts}: must be >= 0")
        _require(math.isfinite(moe.capacity_factor) and moe.capacity_factor > 0,
                 f"model.moe.capacity_factor={moe.capacity_factor}: must be a finite number > 0")
        for name in ("aux_loss_weight", "z_loss_weight", "bias_update_rate"):
            value = getattr(moe, name)
            _require(math.isfinite(value) and value >= 0, f"model.moe.{name}={value}: must be a "
                     "finite number >= 0")
        _require(moe.num_experts % mesh.expert == 0, f"model.moe.num_experts={moe.num_experts} "
                 f"is not divisible by mesh.expert={mesh.expert}")
        _require(m.resolved_d_ff_expert % mesh.tensor == 0, f"model.moe.d_ff_expert="
                 f"{m.resolved_d_ff_expert} is not divisible by mesh.tensor={mesh.tensor}")
        units, chunks = m.n_layers // moe.every, mesh.pipe * p.virtual_stages
        _require(units % chunks == 0, f"model.n_layers / model.moe.every = {units} groups is "
                 f"not divisible by mesh.pipe x parallel.virtual_stages = {chunks} (pipeline "
                 "stages take whole groups)")


def _check_batch(cfg: Config, mesh: MeshConfig) -> None:
    """Batch and sequence: rows for every batch shard, tokens for every sequence shard."""
    t, p = cfg.train, cfg.parallel
    _require(t.steps >= 1, f"train.steps={t.steps}: must be >= 1")
    _require(t.grad_accum >= 1, f"train.grad_accum={t.grad_accum}: must be >= 1")
    _require(t.microbatches >= 1, f"train.microbatches={t.microbatches}: must be >= 1")
    _require(t.batch_size >= 1, f"train.batch_size={t.batch_size}: must be >= 1")
    _require(t.seq_len >= 2, f"train.seq_len={t.seq_len}: must be >= 2")
    batch_shards = math.prod(getattr(mesh, a) for a in BATCH_AXES)
    per_step = t.grad_accum * t.microbatches * batch_shards
    _require(t.batch_size % per_step == 0,
             f"train.batch_size={t.batch_size} is not divisible by grad_accum x microbatches x "
             f"batch shards (data*fsdp*expert) = {t.grad_accum} x {t.microbatches} x "
             f"{batch_shards} = {per_step}")
    seq_shards = mesh.context * 2 if mesh.context > 1 else 1  # load-balanced causal: 2 chunks each
    if p.sequence_parallel:
        seq_shards = math.lcm(seq_shards, mesh.context * mesh.tensor)
    _require(t.seq_len % seq_shards == 0,
             f"train.seq_len={t.seq_len} is not divisible by {seq_shards}, which "
             + ("sequence parallelism (context*tensor)" if p.sequence_parallel else
                "context parallelism (2*context)") + " needs")
    _check_attention_blocks(cfg, mesh)


def _check_attention_blocks(cfg: Config, mesh: MeshConfig) -> None:
    """Blockwise attention tiles the sequence a device attends with (each chunk of it, under
    context parallelism) into blocks of ``model.attention_block``, or one block if shorter."""
    m, t = cfg.model, cfg.train
    _require(m.attention_block >= 1, f"model.attention_block={m.attention_block}: must be >= 1")
    tiled = t.seq_len // (mesh.context * (2 if cfg.parallel.zigzag else 1)
                          if mesh.context > 1 else 1)
    if m.attention in ("auto", "blockwise") or mesh.context > 1:
        _require(tiled <= m.attention_block or tiled % m.attention_block == 0,
                 f"model.attention_block={m.attention_block} does not divide the {tiled} tokens "
                 "blockwise attention tiles (train.seq_len" + (" / context chunks" if
                                                               mesh.context > 1 else "")
                 + "); pick a divisor, or a block at least that long")


def _check_optimizer(t: TrainConfig) -> None:
    """Optimiser and schedule."""
    _require(math.isfinite(t.lr) and t.lr > 0, f"train.lr={t.lr}: must be a finite number > 0")
    _require(0 <= t.min_lr_ratio <= 1, f"train.min_lr_ratio={t.min_lr_ratio}: must be in [0, 1]")
    _require(0 <= t.warmup_steps, f"train.warmup_steps={t.warmup_steps}: must be >= 0")
    _require(t.grad_clip >= 0, f"train.grad_clip={t.grad_clip}: must be >= 0 (0 disables)")


def _check_sharding(cfg: Config, mesh: MeshConfig) -> None:
    """Sharding of parameters: ZeRO-3 splits the embed dim over fsdp; ZeRO-1 splits the
    optimizer state's embed dim over every batch axis. Rule overrides name known axes."""
    m, p = cfg.model, cfg.parallel
    zero_shards = mesh.fsdp if p.zero == 3 else mesh.data * mesh.fsdp
    _require(m.d_model % zero_shards == 0, f"model.d_model={m.d_model} is not divisible by "
             f"{zero_shards}, the " + ("fsdp axis (ZeRO-3)" if p.zero == 3 else
                                      "data*fsdp axes that ZeRO-1 shards optimizer state over"))
    for logical, axes in p.rules.items():
        _require(logical in LOGICAL_AXES, f"parallel.rules.{logical}: unknown logical axis; "
                 f"allowed: {', '.join(LOGICAL_AXES)}")
        for axis in axes:
            _require(axis in MESH_AXES, f"parallel.rules.{logical}: unknown mesh axis {axis!r}; "
                     f"allowed: {', '.join(MESH_AXES)}")


def _check_run(cfg: Config) -> None:
    """Data, checkpoints, logging."""
    t = cfg.train
    _require(0 <= cfg.data.val_fraction < 1, f"data.val_fraction={cfg.data.val_fraction}: must "
             "be in [0, 1)")
    _require(cfg.data.max_bytes >= 0, f"data.max_bytes={cfg.data.max_bytes}: must be >= 0")
    _require(cfg.checkpoint.every >= 0, f"checkpoint.every={cfg.checkpoint.every}: must be >= 0")
    _require(cfg.checkpoint.keep >= 1, f"checkpoint.keep={cfg.checkpoint.keep}: must be >= 1")
    _require(t.resume.strip() != "", "train.resume is empty; allowed: auto, never, a step number "
             "or a checkpoint path")
    _require(cfg.logging.every >= 1, f"logging.every={cfg.logging.every}: must be >= 1")
