"""The config schema: frozen dataclasses, one per section, with their defaults, and the mesh and
logical axis names. No jax import (see :mod:`jaxpar.config`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

MESH_AXES = ("pipe", "data", "fsdp", "expert", "context", "tensor")
"""Mesh axis names, outermost first; the innermost axis should get the fastest links."""

BATCH_AXES = ("data", "fsdp", "expert")
"""Mesh axes the global batch is split over (``expert`` is extra data parallelism outside MoE)."""

LOGICAL_AXES = (
    "batch", "residual_batch", "seq", "residual_seq", "embed", "expert_embed", "act_embed", "heads",
    "kv_heads", "head_dim", "mlp", "vocab", "experts", "layers", "stage", "q_lora", "kv_lora",
    "q_lora_in", "kv_lora_in", "act_q_lora_in", "act_kv_lora_in", "lora_rank",
)
"""Logical axis names the model annotates; :mod:`jaxpar.parallel.rules` maps them to mesh axes."""

VOCAB_AXES = ("tensor",)
"""Mesh axes the vocabulary's rows are split over by default (the rules table's ``vocab``,
:mod:`jaxpar.parallel.rules`; ``parallel.rules.vocab`` overrides it): what
:meth:`Config.vocab_rows` pads the vocabulary for."""

LOSS_PIECE_BYTES = 64 * 2**20  # train.loss_pieces=0: a piece's float32 logits per device

PRESETS_DIR = Path(__file__).resolve().parent.parent.parent / "configs"


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
    # Divide the k chosen gates by their sum (Mixtral, Qwen3-MoE, DeepSeek-V3); false keeps the
    # probabilities themselves as gates (Switch/GShard). null: false for the softmax router,
    # true for sigmoid_bias (whose sigmoid scores do not sum to 1 over the experts).
    norm_topk: bool | None = None
    # DeepSeek-V3's group-limited routing: the experts form n_group groups of equal size, each
    # token keeps the topk_group groups whose two best (bias-corrected) scores sum highest and
    # picks its top_k experts among theirs. 1 and 1: no limit.
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0  # the routed experts' gates are multiplied by this
    # The first this many blocks are dense (a SwiGLU of model.d_ff), the rest mixtures
    # (DeepSeek-V3's first_k_dense_replace); they are a stack of their own (dense_layers).
    first_dense: int = 0

    @property
    def enabled(self) -> bool:
        return self.num_experts > 0

    @property
    def normalise_gates(self) -> bool:
        """``norm_topk`` with null resolved by the router (see the field)."""
        return self.norm_topk if self.norm_topk is not None else self.router == "sigmoid_bias"

    def capacity(self, tokens: int) -> int:
        """Slots per expert in dropping mode for a group of ``tokens`` tokens:
        ceil(capacity_factor x tokens x top_k / num_experts), within [1, tokens].

        An expert can never receive more than ``tokens`` slots (a token picks top_k *distinct*
        experts), so a larger buffer would only hold padding.
        """
        wanted = math.ceil(self.capacity_factor * tokens * self.top_k / self.num_experts)
        return max(1, min(tokens, wanted))


@dataclass(frozen=True)
class RopeScalingConfig:
    """Rescaled rotary frequencies for contexts longer than pre-training's (Llama 3.1's
    ``llama3`` rule, or ``linear``: every frequency divided by ``factor``, as Gemma 3's global
    layers; ``jaxpar/model/layers.py:rope_frequencies``; YaRN's ``yarn``, for multi-head latent
    attention only: ``jaxpar/model/mla.py:yarn_frequencies``); ``type: none`` is plain RoPE."""

    type: Literal["none", "llama3", "linear", "yarn"] = "none"
    factor: float = 8.0  # long wavelengths (linear: all) are divided by this
    low_freq_factor: float = 1.0  # wavelengths above original / low_freq_factor: divided
    high_freq_factor: float = 4.0  # wavelengths below original / high_freq_factor: unchanged
    original_max_position_embeddings: int = 8192  # the pre-training context
    # yarn: dims turning fewer than beta_slow times over the original context are
    # interpolated (divided by factor), more than beta_fast times kept, a ramp between;
    # mscale / mscale_all_dim: the attention temperature 0.1 m ln(factor) + 1 of the rotary
    # dims (their ratio) and of the softmax scale (squared; DeepSeek-V3)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0

    @property
    def enabled(self) -> bool:
        return self.type != "none"


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3, ``jaxpar/model/mla.py``), on when
    ``kv_lora_rank > 0``; then ``model.head_dim`` is unused, and ``model.n_kv_heads`` is read
    only by the cost model (set it to ``n_heads``: the keys and values are expanded per head)."""

    q_lora_rank: int = 0  # rank of the query's low-rank projection; 0: a full-rank query
    kv_lora_rank: int = 0  # width of the cached latent the keys and values are expanded from
    qk_nope_head_dim: int = 0  # per-head query/key dims without rotary embedding
    qk_rope_head_dim: int = 0  # per-head query dims with rotary embedding (one key shared)
    v_head_dim: int = 0  # per-head value dim
    # Rotate interleaved pairs (x0, x1), (x2, x3)... (DeepSeek's checkpoints) rather than the
    # two halves of the rope dims.
    rope_interleave: bool = False

    @property
    def enabled(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class ModelConfig:
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int | None = None  # default d_model // n_heads
    d_ff: int = 128
    vocab_size: int = 256  # the true vocabulary: token ids 0 .. vocab_size - 1
    # The embedding's rows and the head's columns are padded to a multiple of this and of the
    # devices that split the vocabulary (Config.vocab_rows; the padded logits are masked):
    # 128 suits the TPU's and the GPU's matmul tiles (Megatron's make-vocab-size-divisible-by).
    vocab_multiple: int = 128
    rope_theta: float = 10000.0
    rope_scaling: RopeScalingConfig = field(default_factory=RopeScalingConfig)
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    qkv_bias: bool = False  # biases on the q, k and v projections (Qwen2)
    qk_norm: bool = False  # RMSNorm of each query and key head before RoPE (Qwen3)
    mlp_activation: Literal["silu", "gelu_tanh"] = "silu"  # SwiGLU, or GeGLU (Gemma)
    post_norms: bool = False  # RMSNorm of attention and MLP outputs before the add (Gemma 2/3)
    embed_scale: bool = False  # embeddings times sqrt(d_model), in the compute dtype (Gemma)
    final_softcap: float = 0.0  # logits -> cap * tanh(logits / cap) (Gemma 2); 0: off
    query_scale: float | None = None  # scores times query_scale**-0.5 (Gemma); None: head_dim
    init_std: float = 0.02
    # auto: cuDNN on a GPU in 16-bit, splash on a TPU, else blockwise when the sequence spans
    # several blocks
    attention: Literal["auto", "dense", "blockwise", "cudnn", "splash"] = "auto"
    attention_block: int = 512  # queries x keys per block of blockwise (and ring) attention
    # Sliding-window attention: a query sees the `sliding_window` most recent keys, itself
    # included (None: the whole sequence); with global_every=k, layers k, 2k, ... (from 1)
    # attend globally and the rest locally (0: every layer local; Gemma 2: 2, Gemma 3: 6).
    sliding_window: int | None = None
    global_every: int = 0
    attn_softcap: float = 0.0  # scores -> cap * tanh(scores / cap) (Gemma 2); 0: off
    rope_local_theta: float | None = None  # RoPE base of the local layers (None: rope_theta)
    moe: MoEConfig = field(default_factory=MoEConfig)
    mla: MLAConfig = field(default_factory=MLAConfig)

    @property
    def resolved_head_dim(self) -> int:
        """The attention kernels' head width: ``head_dim`` (default d_model / n_heads), or with
        ``mla`` the wider of its q/k and value widths (the narrower is padded to it)."""
        if self.mla.enabled:
            return max(self.mla.qk_head_dim, self.mla.v_head_dim)
        return self.head_dim if self.head_dim is not None else self.d_model // self.n_heads

    @property
    def resolved_d_ff_expert(self) -> int:
        return self.moe.d_ff_expert if self.moe.d_ff_expert is not None else self.d_ff

    @property
    def n_moe_layers(self) -> int:
        """MoE blocks in the stack: one per group of ``moe.every`` blocks after the first
        ``moe.first_dense`` (0 for a dense model)."""
        if not self.moe.enabled:
            return 0
        return (self.n_layers - self.moe.first_dense) // self.moe.every


@dataclass(frozen=True)
class DcnConfig:
    """How many slices (or hosts) each mesh axis spans over the data-center network
    (docs/multi-host.md#several-slices): ``mesh.dcn.data=2`` puts ``data``'s outer factor of 2
    across two slices and the rest of every axis inside a slice. The product is the number of
    slices; 1 everywhere (the default) is one slice."""

    pipe: int = 1
    data: int = 1
    fsdp: int = 1
    expert: int = 1
    context: int = 1
    tensor: int = 1

    def sizes(self) -> dict[str, int]:
        return {axis: getattr(self, axis) for axis in MESH_AXES}

    @property
    def slices(self) -> int:
        return math.prod(self.sizes().values())

    def crossing(self, axes: str | tuple[str, ...]) -> bool:
        """Whether a collective over ``axes`` has members in different slices."""
        return any(getattr(self, a) > 1 for a in ((axes,) if isinstance(axes, str) else axes))


@dataclass(frozen=True)
class MeshConfig:
    pipe: int = 1
    data: int = -1
    fsdp: int = 1
    expert: int = 1
    context: int = 1
    tensor: int = 1
    dcn: DcnConfig = field(default_factory=DcnConfig)  # the axes' share over slices

    def sizes(self) -> dict[str, int]:
        return {axis: getattr(self, axis) for axis in MESH_AXES}


@dataclass(frozen=True)
class ProfileConfig:
    """A ``jax.profiler`` trace of steps ``start_step`` .. ``start_step + steps - 1`` in
    ``run_dir/profile`` (``jaxpar/train/observe.py``); ``start_step: null`` traces nothing."""

    start_step: int | None = None
    steps: int = 1

    @property
    def enabled(self) -> bool:
        return self.start_step is not None


LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
# Latent attention's projections (model.mla): W_qa, W_qb, W_kva, W_kvb (docs/lora.md)
MLA_LORA_TARGETS = ("q_a", "q_b", "kv_a", "kv_b")


@dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters (docs/lora.md): rank 0 trains every weight; rank r > 0 trains only
    A [in, r] and B [r, out] beside each targeted weight, the base weights frozen."""

    rank: int = 0
    alpha: float = 16.0  # the adapter's output is scaled by alpha / rank
    targets: tuple[str, ...] = LORA_TARGETS  # any of LORA_TARGETS (+ MLA_LORA_TARGETS)
    dropout: float = 0.0  # on the adapters' input, train step only; in [0, 1)


@dataclass(frozen=True)
class OffloadConfig:
    """Train state kept in host memory (docs/memory.md#host-offload)."""

    # The optimizer's state (Adam's moments, ...) in pinned host memory between steps; each
    # step brings it to the device for the update and sends the new state back.
    optimizer: bool = False


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 100
    batch_size: int = 8  # global sequences per optimizer step
    seq_len: int = 64
    seed: int = 0
    # adamw; adafactor (factored second moment); lion (one moment); muon (orthogonalised
    # momentum on the stacked layer matrices, AdamW on the rest). See train/optimizers.py.
    optimizer: Literal["adamw", "adafactor", "lion", "muon"] = "adamw"
    lr: float = 3e-3
    # After warmup_steps of linear warm-up: cosine decay to lr * min_lr_ratio at `steps`; wsd:
    # lr, then linear decay to lr * min_lr_ratio over the last decay_fraction of the steps;
    # constant: lr.
    lr_schedule: Literal["cosine", "wsd", "constant"] = "cosine"
    min_lr_ratio: float = 0.1  # cosine and wsd decay to lr * min_lr_ratio
    decay_fraction: float = 0.2  # wsd: the share of the steps that decays, in (0, 1]
    warmup_steps: int = 10
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # global-norm clip; 0 disables
    microbatches: int = 1  # pipeline microbatches per micro-step
    grad_accum: int = 1  # micro-steps summed per optimizer step
    # The loss over this many pieces of the sequence, one piece's float32 logits alive at a time
    # (recomputed in the backward pass); 0: the fewest that keep a piece's logits within
    # LOSS_PIECE_BYTES per device (Config.loss_pieces).
    loss_pieces: int = 0
    # What a layer keeps for its backward pass (docs/memory.md#remat-policies): none
    # (everything), full (its input), dots (the weight matmuls' outputs), attention (q, k, v,
    # the attention output and the attention branch's output; the MLP is recomputed),
    # offload_dots (dots, kept in host memory). remat_every=k applies the policy to one layer
    # in k, the others keep everything.
    remat: Literal["none", "full", "dots", "attention", "offload_dots"] = "none"
    remat_every: int = 1
    dtype: Literal["float32", "bfloat16"] = "float32"  # compute dtype of the matmuls
    # Storage dtype of the parameters (norm scales and the router stay float32); the update is
    # float32 either way (train/optimizers.py: in_float32).
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    # Storage dtype of the optimizer's per-parameter state (moments, factors); each update
    # widens it to float32, computes in float32 and rounds it back (optimizers.stored_state).
    opt_state_dtype: Literal["float32", "bfloat16"] = "float32"
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    # Start from these weights (a checkpoint step, run or checkpoints directory, or the output
    # of `jaxpar import-hf`) with a fresh optimizer at step 0; a checkpoint that train.resume
    # finds wins (so a rerun continues), see checkpoint/weights.py.
    init_from: str | None = None
    # auto: continue from the newest complete checkpoint in run_dir/checkpoints, if any;
    # never: start fresh; N: run_dir/checkpoints/N; else a path (a step directory, or a
    # checkpoints/ or run directory whose newest checkpoint is taken). See checkpoint/state.py.
    resume: str = "auto"
    # A non-finite loss or gradient norm: skip drops that update (counted as skipped_steps in
    # metrics.jsonl); stop exits 1 naming the step, saving nothing after it.
    on_nonfinite: Literal["skip", "stop"] = "stop"
    # The held-out loss (val_loss in metrics.jsonl) every this many steps and at the last step,
    # over the first eval_batches global batches of the validation split; 0: never.
    eval_every: int = 0
    eval_batches: int = 4
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass(frozen=True)
class ParallelConfig:
    sequence_parallel: bool = False
    zero: Literal[1, 3] = 3
    # How attention reaches the other devices' tokens under mesh.context > 1: ring
    # (ppermute K/V blocks), allgather (K/V), ulysses (all-to-alls to a head split) or hybrid
    # (ulysses inside groups of ulysses_size consecutive context devices, the ring between the
    # groups): jaxpar/parallel/context.py and ulysses.py.
    context_impl: Literal["ring", "allgather", "ulysses", "hybrid"] = "ring"
    ulysses_size: int = 0  # the hybrid's inner (all-to-all) factor of mesh.context; 0 otherwise
    zigzag: bool = True  # load-balanced causal layout for context parallelism
    pipeline_schedule: Literal["gpipe", "1f1b", "interleaved", "zero_bubble",
                               "dualpipe_v"] = "gpipe"
    virtual_stages: int = 1
    # FSDP inside pipeline stages: "per_step" gathers a stage's weights once per step and sums
    # its gradients whole; "per_layer" gathers each layer as a slot runs it and reduce-scatters
    # its gradient at once (less memory, more bytes: parallel/pipeline/executor.py).
    pipeline_fsdp: Literal["per_step", "per_layer"] = "per_step"
    # A pipeline round's forward and backward slots in one layer loop, so the compiler can
    # overlap one's collectives with the other's matmuls (DualPipe's F&B overlap;
    # parallel/pipeline/layerwise.py); the last chunk then turns back one round later.
    pipeline_overlap: bool = False
    # What a pipeline stage keeps of a microbatch between a chunk's forward and its backward:
    # "residuals" (the chunk's VJP residuals, what train.remat saves of each layer) or
    # "inputs" (the chunk's input alone; its backward slot runs the chunk's forward again
    # first: parallel/pipeline/recompute.py).
    pipeline_stash: Literal["residuals", "inputs"] = "residuals"
    # Dtype of the gradient sums jaxpar takes by hand (over data, and over data/fsdp in the
    # pipeline executor); see validation._check_reduce_dtype for where it applies.
    reduce_dtype: Literal["float32", "bfloat16"] = "float32"
    # Route each device's tokens through a MoE layer's experts in this many pieces, so one
    # piece's all-to-alls can overlap another's expert matmuls (parallel/expert.py).
    expert_pieces: int = 1
    # How FSDP gathers the weights whose gathers the TPU compiler keeps synchronous (the routed
    # experts', and weights split over tensor too): "ring" (n - 1 ppermutes, which the compiler
    # runs beside other matmuls), "all_gather" (one collective), "auto": the ring on TPU
    # (jaxpar/platform.py: RING_GATHER_PLATFORMS; parallel/point_to_point.py).
    fsdp_gather: Literal["auto", "ring", "all_gather"] = "auto"
    # Overrides of the logical -> mesh axis table, e.g. {"mlp": ["tensor"], "embed": []}.
    rules: dict[str, tuple[str, ...]] = field(default_factory=dict)


@dataclass(frozen=True)
class SourceConfig:
    """One source of a mixture (``data.sources``)."""

    path: str = ""  # a directory written by `jaxpar tokenize`
    weight: float = 1.0  # share of the rows, relative to the other sources' weights


@dataclass(frozen=True)
class DataConfig:
    # 'stdlib', a path/glob of .txt/.md/.py/.jsonl/.parquet files, a Hugging Face datasets
    # directory, or a directory written by `jaxpar tokenize` (it has an index.json)
    source: str = "stdlib"
    tokenizer: str = "byte"  # 'byte' or a path to a tokenizer.json
    val_fraction: float = 0.01
    max_bytes: int = 8_000_000  # cap on corpus text read (0 = no cap)
    shuffle: bool = True
    text_field: str = "text"  # the JSON field / Parquet or datasets column with the text
    verify: bool = False  # a tokenized source: check every shard's sha256 at start-up
    # A mixture of tokenized directories, rows drawn by weight (data.source then stays stdlib,
    # its default: both at once is an error). See docs/data.md#mixtures.
    sources: tuple[SourceConfig, ...] = ()
    # Packed rows carry document ids: attention stays inside each document and rotary positions
    # restart at each (docs/data.md#document-masks). null: true for tokenized directories and
    # mixtures, false for corpora packed in memory (the stdlib demo's figures stay as they are).
    document_mask: bool | None = None
    # all: the loss on every token; assistant: data.source is chat .jsonl (messages, or
    # prompt/completion), rendered with the chat_template of the tokenizer_config.json beside
    # data.tokenizer, the loss on the assistant's tokens only (docs/data.md#chat-data).
    loss_on: Literal["all", "assistant"] = "all"


@dataclass(frozen=True)
class GenerationConfig:
    """How ``jaxpar generate`` and lm-eval's model ``jaxpar`` turn a prompt into token ids, and
    which ids end a generated sequence (docs/generation.md#prompts-and-stopping)."""

    # eos_prefix: the end-of-text token, then the text without special tokens, as every
    # document but the first was in jaxpar's packed pre-training; tokenizer: the text as
    # data.tokenizer encodes it, its special tokens (BOS) included, as the model was trained
    # elsewhere (what `jaxpar import-hf` writes).
    prompt: Literal["eos_prefix", "tokenizer"] = "eos_prefix"
    # Ids that end a sequence (an imported model's generation_config.json or config.json);
    # empty: data.tokenizer's end-of-text token.
    eos_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class CheckpointConfig:
    every: int = 100  # steps between checkpoints; 0 = only at the end (and on SIGTERM/SIGINT)
    keep: int = 3  # newest checkpoints kept in run_dir/checkpoints
    enabled: bool = True  # false: save nothing (train.resume still reads existing checkpoints)


@dataclass(frozen=True)
class WandbConfig:
    """A Weights & Biases run beside ``metrics.jsonl`` (``jaxpar/train/tracking.py``). The keys
    are ``wandb.init``'s own; ``mode: disabled`` (the default) never imports wandb."""

    mode: Literal["disabled", "online", "offline"] = "disabled"
    project: str | None = None  # null: WANDB_PROJECT, else W&B's default project
    entity: str | None = None  # user or team (null: WANDB_ENTITY, else the login's default)
    name: str | None = None  # display name (null: W&B makes one up)
    group: str | None = None
    tags: tuple[str, ...] = ()
    # How long wandb.init may try to reach the server before the run goes on untracked.
    init_timeout_s: float = 30.0


@dataclass(frozen=True)
class LoggingConfig:
    every: int = 10  # steps between log lines / metrics.jsonl rows
    progress: bool = True  # rich progress bar
    tensorboard: bool = False  # metrics.jsonl's rows also as TensorBoard scalars (tensorboardX)
    wandb: WandbConfig = field(default_factory=WandbConfig)  # ... and as a W&B run


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
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)

    @property
    def mesh_shape(self) -> dict[str, int]:
        """Axis sizes; only meaningful after :func:`validate` resolved any ``-1``."""
        return self.mesh.sizes()

    def loss_pieces(self) -> int:
        """Pieces of the sequence the loss is computed in (``train.loss_pieces``, or for 0 the
        fewest dividing the device's S/c tokens whose float32 logits [b, S/(c n), V/t] fit in
        LOSS_PIECE_BYTES). Validated configs only."""
        t, mesh = self.train, self.mesh
        local_seq = t.seq_len // mesh.context
        if t.loss_pieces:
            return t.loss_pieces
        rows = t.batch_size // (t.grad_accum * t.microbatches * self.batch_shards())
        logits = rows * local_seq * (self.vocab_rows() // mesh.tensor) * 4
        return next(n for n in range(1, local_seq + 1)
                    if local_seq % n == 0 and (logits // n <= LOSS_PIECE_BYTES or n == local_seq))

    def embedding_grad_pieces(self) -> int:
        """Slices of the vocabulary the embedding's gradient is built in
        (``model.projection.one_hot_weight_grad``): the fewest whose one-hot [V/(t p n), b,
        S/c] in the compute dtype fits in LOSS_PIECE_BYTES per device; with the vocab split
        over ``tensor`` or into a pipeline's pieces, the fewest dividing each device's V/(t p)
        rows. Validated configs only."""
        t, v = self.train, self.vocab_rows()
        rows = t.batch_size // (t.grad_accum * t.microbatches * self.batch_shards())
        split = self.vocab_splits()
        local_vocab = v // split
        one_hot = (local_vocab * rows * (t.seq_len // self.mesh.context)
                   * (2 if t.dtype == "bfloat16" else 4))
        if split == 1:
            return min(v, -(-one_hot // LOSS_PIECE_BYTES))
        return next(n for n in range(1, local_vocab + 1)
                    if local_vocab % n == 0
                    and (one_hot // n <= LOSS_PIECE_BYTES or n == local_vocab))

    def vocab_splits(self) -> int:
        """Devices the vocabulary's rows are split over: the mesh axes of the rules table's
        ``vocab`` (:data:`VOCAB_AXES` unless ``parallel.rules.vocab`` says otherwise), and in a
        pipeline the stages too (each embeds and scores its piece of the vocabulary)."""
        axes = set(self.parallel.rules.get("vocab", VOCAB_AXES))
        if self.mesh.pipe > 1:
            axes.add("pipe")
        return math.prod(self.mesh_shape[a] for a in axes)

    def vocab_rows(self) -> int:
        """The embedding's rows and the head's columns: ``model.vocab_size`` rounded up to a
        multiple of ``model.vocab_multiple`` and of :meth:`vocab_splits` (the one place the
        padded size is derived; ids from ``model.vocab_size`` on are padding, masked out of
        every softmax and greedy pick by the model). Validated configs only."""
        multiple = math.lcm(self.model.vocab_multiple, self.vocab_splits())
        return -(-self.model.vocab_size // multiple) * multiple

    def batch_shards(self) -> int:
        return math.prod(getattr(self.mesh, a) for a in BATCH_AXES)
