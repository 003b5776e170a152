"""The analytic cost of one train step, per device: memory, collectives, flops and time.

:func:`estimate` reads a validated :class:`~jaxpar.config.Config` and predicts, without compiling
anything, what ``jaxpar inspect`` would measure from the compiled step, plus how long the step
would take on a :mod:`~jaxpar.inspect.hardware` profile. It is plain arithmetic; the only jaxpar
code it runs is the rules table (:func:`jaxpar.parallel.rules.resolve_spec`), so each parameter is
split exactly as training splits it. (That module imports jax, but no backend is started and
nothing is traced or compiled.)

Which compiler: the collectives differ a little between XLA:CPU and the accelerators' compilers,
so the estimate follows the platform asked about. Without a hardware profile (or with ``cpu``)
it predicts XLA:CPU's program, what ``jaxpar inspect`` compiles on this machine; the tests check
it against that. With a GPU or TPU profile it predicts the accelerator compiler's, checked by
hand against the TPU compiler (``jaxpar inspect --target tpu-v5e:2x4``, libtpu 0.0.42.1) and
assumed for GPUs. Where XLA does something other than the textbook schedule, the formulas follow
XLA and say so.

Notation (all per device unless "global"): B global batch (sequences per optimizer step), S
``seq_len``, E ``d_model``, H/K query/kv heads, D ``head_dim``, F ``d_ff``, V vocab, L layers;
d, f, c, t the ``data``, ``fsdp``, ``context``, ``tensor`` axis sizes, G ``expert``; X experts,
k ``top_k``; g ``grad_accum``; a the bytes of the compute dtype (4 float32, 2 bfloat16). Each
device runs g micro-batches of
``b = B / (g * d * f * expert)`` sequences of ``S/c`` tokens. One activation of the residual
stream is ``A = b * S/c * E * a`` bytes.

Memory
------
Parameters are float32 and split by the rules table: ``embed`` over ``fsdp`` (ZeRO-3), ``heads``,
``kv_heads``, ``mlp``, ``vocab`` over ``tensor``. Gradients are float32 and live where their
parameters live (one more copy, the accumulator, when g > 1). AdamW keeps two float32 moments
per parameter, split like the parameters (ZeRO-3) or with ``embed`` also split over ``data`` and
``fsdp`` (ZeRO-1). Saved activations per layer and micro-batch, with ``r = A/t`` under sequence
parallelism (else ``r = A``: the residual stream is replicated over ``tensor``):

- ``remat=none``: what autodiff keeps. Per RMSNorm (2) its input (r), its float32 normalised
  values (r x 4/a) and its output gathered to the full sequence (A); q, k, v after rotary
  (b S/c (H+2K)/t D a); the attention output (b S/c H/t D a); gate, sigmoid(gate), silu(gate), up
  and their product (5 b S/c F/t a); and two float32 score-sized tensors per head,
  b (H/t) S/c S_k x 8 bytes (XLA keeps the masked scores alive next to the softmax output; S_k is
  S, the keys each query sees), plus a compute-dtype copy of the probabilities under bfloat16.
- ``remat=dots`` (``dots_with_no_batch_dims_saveable``): the block input (r) and the outputs of
  the weight matmuls that the recomputation needs: q, k, v before rotary, the attention output
  projection (A), gate and up (2 b S/c F/t a). Attention scores/probabilities (batched dots),
  norms and the SwiGLU product are recomputed.
- ``remat=full``: only the block input (r); the whole block is recomputed in the backward pass.
- Weights: ``remat=none`` also keeps each layer's weights as its matmuls read them (cast to the
  compute dtype and, under FSDP, gathered whole) for the backward pass: one more copy of all
  layer weights per device, which FSDP does not split. The remat policies recompute them.
- Ring attention (``context > 1``) never holds scores: its custom VJP keeps the float32 output
  and log-sum-exp (b S/c H/t (D+1) x 4) under every policy, and works one block of
  (S/c/2)^2 scores (zigzag) at a time.
- A MoE layer keeps, instead of the SwiGLU's tensors, the router's float32 logits, probabilities
  and choices, the k copies of each token and their outputs, the rows sent, received and
  returned by its all-to-alls and the experts' five hidden-sized tensors per row (see
  ``_moe_activations``); with ``every = n`` a "layer" in these sums is a group of n blocks.
- Parameters include every expert of every MoE layer (1/G of them per device); the router
  biases of ``router=sigmoid_bias`` are float32 buffers outside the optimizer.

During the backward pass one layer's ``remat=none`` set exists at a time (recomputed, or its
gradients); the head adds float32 logits and their gradient and the one-hot input (b S/c V/t
each). Under FSDP one layer's weights are gathered (and its gradient unscattered) at a time, and
the embedding and lm_head stay gathered for the whole step. Peak = parameters + optimizer state +
gradients + batch + max(activations + that working set, the optimizer update's temporaries).

Collectives
-----------
Per step (= per micro-step x g, as :func:`jaxpar.inspect.hlo.summarize_collectives` counts them);
``bytes`` is the logical payload per device (all-gather: the gathered result, reduce-scatter: the
unscattered input), ``wire_bytes`` what a ring sends over an axis of N devices: all-reduce
2(N-1)/N, all-gather and reduce-scatter (N-1)/N of it, collective-permute all of it.

- ``data`` and ``context``: parameters are replicated over both, so each device's gradient shard
  is all-reduced over both together, every micro-step (XLA reduces inside the accumulation loop
  rather than once after it; XLA:CPU sometimes splits the reduction into one all-reduce per
  axis, which doubles these bytes, while the TPU compiler keeps one).
- ``fsdp`` (ZeRO-3): all-gather of each layer's weights in the forward pass, and with remat
  (``dots``, ``full``) again in the backward pass (L g or 2 L g gathers per weight; the
  embedding, lm_head and final norm once per step), reduce-scatter of the gradients every
  micro-step.
- ZeRO-1 (``zero=1``): all-reduce of the whole (tensor-split) gradient over ``data`` x ``fsdp``
  (x ``context``) every micro-step, then one float32 all-gather of the updated parameters over
  ``data`` x ``fsdp``.
- ``context`` attention: ring attention passes K and V blocks (b S/c K/t D a each) around the
  ring: 2(c-1) collective-permutes per layer forward, 2(c-1) backward plus 2c dK/dV blocks
  travelling home (float32, but the last hop: XLA casts to the compute dtype before sending);
  ``context_impl=allgather`` instead all-gathers K and V (2 per layer, b S K/t D a gathered) and
  reduce-scatters their gradients.
- ``tensor`` without sequence parallelism: all-reduce (payload A) of the attention and MLP outputs
  (2 per layer forward; +1 with ``remat=full``, which recomputes the attention output), and of
  the input gradients of the column-parallel matmuls in the backward pass: 5 per layer on
  XLA:CPU (q, k, v, gate and up each reduced before they are summed), 2 on the TPU compiler
  (q+k+v and gate+up, as Megatron); plus the vocab-parallel embedding (forward, A) and the
  lm_head input gradient (backward, float32 like the logits), and two tiny all-reduces of b S/c
  floats for the vocab-parallel loss (max, sum of exponentials).
- ``tensor`` with sequence parallelism: each forward all-reduce becomes reduce-scatter (leaving a
  block) + all-gather (entering), payload A each: per layer 2 all-gathers + 2 reduce-scatters
  forward, 2 all-gathers + 5 (XLA:CPU) or 2 reduce-scatters backward; ``remat=dots`` and ``full``
  gather the inputs again (+2 all-gathers), ``full`` also redoes the attention reduce-scatter;
  embedding and head add 2 of each; the norm scales' gradients are all-reduced over ``tensor``
  (tiny).
- ``pipe`` (``parallel/pipeline.py``): the executor's loop issues two collective-permutes per
  tick of the schedule table (activation forward, gradient backward, b/m x S/c x E each, /t
  under sequence parallelism, zeros when a stage has nothing to send): 2 T g of them for a
  T-tick table. The shared parameters' gradients (embedding, final norm, head: replicated over
  ``pipe``) are all-reduced over ``pipe`` once per micro-step. Inside the stages, every formula
  above runs on the stage's L/p layers once per microbatch (b is then the microbatch), with the
  forward-side collectives repeated by the executor's recomputation (x2 with B, x3 with a split
  I + W), the backward ones once (twice split), and the gradient reductions over ``data`` /
  ``fsdp`` after every microbatch's backward (its chunk's layers; the shared parameters on the
  first and last stage only, 1/p of the runs on average, since the compiled counts are averaged
  over stages by :mod:`jaxpar.inspect.report`). Checked against XLA:CPU on tiny with pipe=2 and
  tensor=2, data=2 or fsdp=2: within 2% (tests/test_cost.py). Stash memory: the table's slots
  (``describe``) x one message. Time: compute / (1 - bubble).
- ``expert`` (mixture of experts, :mod:`jaxpar.parallel.expert`): the routed experts' weights
  are split over ``expert``, so their gradient shards are all-reduced over ``data`` and
  ``context`` only, while every other parameter's are all-reduced over ``expert`` too (it is
  data parallelism outside the experts). Each MoE layer moves its slots with all-to-alls over
  ``expert``: dispatch and combine forward, the same two backward, and under remat the forward
  pair again. A device routes T = b S/c tokens, k slots each; the ideal payload per all-to-all is
  T k E a (the textbook ``tokens x top_k x d_model x 2 passes x 2 directions``, of which
  (G-1)/G crosses the wire for G = ``mesh.expert``). What travels has static shapes: with
  ``dispatch=dropping`` the [X, C, E] capacity buffer (C = ceil(capacity_factor T k / X)); with
  ``dropless`` on XLA:CPU a worst-case block of T min(k, X/G) rows per destination (G T min(k,
  X/G) rows, plus an int32 expert id per row forward); with ``dropless`` on GPU/TPU a
  ``ragged-all-to-all`` of the T k real rows (``jaxpar inspect`` counts a ragged op's whole
  input buffer, some of which is sized for the worst case, so it reports more; not checked
  beyond compiling for TPU). Blocking: the experts wait for their rows. Under
  ``tensor`` a MoE layer reduces its summed expert outputs forward and its tokens' gradient
  backward once each ([T, E]), plus the shared experts' like a SwiGLU.

Dtypes: activations travel in the compute dtype, and so do weights and weight gradients: each
layer casts a float32 weight to the compute dtype and lays it out whole before its matmul
(``jaxpar.model.layers.weight``), so FSDP gathers the cast copy, and XLA reduces a matmul's weight
gradient before casting it back to float32 (seen in the TPU compiler's HLO via ``jaxpar inspect
--target``; GPU is expected to match, not checked). Norm scales stay float32, as do lm_head's
gradient (its matmul returns float32 logits) and ZeRO-1's gather of the updated parameters.
XLA:CPU computes bfloat16 dots in float32 and so moves float32 everywhere, which the estimate
for XLA:CPU does too. Scalars (loss, token counts, gradient-norm partial sums) are left out: a
few bytes each.

Flops and time
--------------
Useful flops are :func:`jaxpar.model.flops.train_flops_per_token` x B S / devices (what MFU
counts; attention as the full S x S square). Executed flops add the one-hot embedding matmul
(2VE forward + 2VE weight gradient per token), the recomputation (``dots`` redoes attention's
forward, 4 L H D S per token; ``full`` also each layer's matmuls, 2 x their parameters) and, under
ring attention, the difference between the blocks the busiest device computes -- (2c+1)/(4c) of
the square with the zigzag layout, all of it without -- with a flash-style backward (5 block
matmuls against dense attention's 4; ring attention is never recomputed) and the dense count.

Given a hardware profile: compute time = executed flops / peak (dense bf16 peak: a lower bound,
as no kernel reaches it and memory-bound work and latency are ignored); each collective takes
``wire_bytes / bandwidth`` of the link its axes use. Overlap rule: collectives over ``data``,
``fsdp`` and ``context`` (weight gathers, gradient reductions, ring steps sent while the previous
block is computed) hide behind compute; ``tensor`` collectives and allgather attention sit between
dependent ops, and ZeRO-1's parameter gather comes after all compute, so those add to the step::

    step = compute + blocking + max(0, overlappable - compute)
    MFU  = useful flops / (step * peak)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from jaxpar.config import BATCH_AXES, Config, ConfigError, ModelConfig
from jaxpar.inspect.hardware import HardwareProfile, get_profile
from jaxpar.model.flops import matmul_params, train_flops_per_token
from jaxpar.parallel.pipeline import describe
from jaxpar.parallel.rules import logical_rules, resolve_spec
from jaxpar.parallel.zero import ZERO1_AXES

PARAM_BYTES = 4  # parameters, gradients and Adam moments are float32
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
COLUMN_PARALLEL_MATMULS = 5  # q, k, v, gate, up: each input gradient is reduced on its own
ROW_PARALLEL_MATMULS = 2  # attention output, down projection


# --------------------------------------------------------------------------------------------
# Parameters: the model's shapes and logical names, split by the rules table.


@dataclass(frozen=True)
class ParamShape:
    """One parameter as :mod:`jaxpar.model` creates it (``layers/...`` are stacked over L)."""

    name: str
    shape: tuple[int, ...]
    names: tuple[str, ...]  # logical axis names, one per dimension

    @property
    def stacked(self) -> bool:
        return self.name.startswith("layers/")


def _block_params(prefix: str, m: ModelConfig, n: int, moe: bool) -> list[ParamShape]:
    """One (stacked) block's parameters: ``n`` copies on the leading ``layers`` dimension."""
    e, h, k, d, f = m.d_model, m.n_heads, m.n_kv_heads, m.resolved_head_dim, m.d_ff
    params = [
        ParamShape(f"{prefix}attn/wk", (n, e, k, d), ("layers", "embed", "kv_heads", "head_dim")),
        ParamShape(f"{prefix}attn/wo", (n, h, d, e), ("layers", "heads", "head_dim", "embed")),
        ParamShape(f"{prefix}attn/wq", (n, e, h, d), ("layers", "embed", "heads", "head_dim")),
        ParamShape(f"{prefix}attn/wv", (n, e, k, d), ("layers", "embed", "kv_heads", "head_dim")),
        ParamShape(f"{prefix}attn_norm/scale", (n, e), ("layers", "embed")),
        ParamShape(f"{prefix}mlp_norm/scale", (n, e), ("layers", "embed")),
    ]

    def swiglu(name: str, hidden: int) -> list[ParamShape]:
        return [ParamShape(f"{name}/w_down", (n, hidden, e), ("layers", "mlp", "embed")),
                ParamShape(f"{name}/w_gate", (n, e, hidden), ("layers", "embed", "mlp")),
                ParamShape(f"{name}/w_up", (n, e, hidden), ("layers", "embed", "mlp"))]

    if not moe:
        return params + swiglu(f"{prefix}mlp", f)
    x, fe = m.moe.num_experts, m.resolved_d_ff_expert
    params += [
        ParamShape(f"{prefix}moe/router", (n, e, x), ("layers", "embed", None)),
        ParamShape(f"{prefix}moe/w_down", (n, x, fe, e), ("layers", "experts", "mlp", "embed")),
        ParamShape(f"{prefix}moe/w_gate", (n, x, e, fe), ("layers", "experts", "embed", "mlp")),
        ParamShape(f"{prefix}moe/w_up", (n, x, e, fe), ("layers", "experts", "embed", "mlp")),
    ]
    if m.moe.num_shared_experts:
        params += swiglu(f"{prefix}moe/shared", m.moe.num_shared_experts * fe)
    return params


def _unit_prefixes(m: ModelConfig) -> list[tuple[str, bool]]:
    """(name prefix, is a MoE block) of each block in the scanned unit (transformer.py)."""
    if not m.moe.enabled:
        return [("layers/", False)]
    if m.moe.every == 1:
        return [("layers/", True)]
    return [(f"layers/block_{i}/", i == m.moe.every - 1) for i in range(m.moe.every)]


def model_params(m: ModelConfig) -> list[ParamShape]:
    """Every parameter of the Transformer in ``jaxpar/model`` (tested against the real model)."""
    e, v = m.d_model, m.vocab_size
    units = m.n_layers // m.moe.every if m.moe.enabled else m.n_layers
    params = [
        ParamShape("embedding", (v, e), ("vocab", "embed")),
        ParamShape("final_norm/scale", (e,), ("embed",)),
    ]
    for prefix, moe in _unit_prefixes(m):
        params += _block_params(prefix, m, units, moe)
    if not m.tie_embeddings:
        params.append(ParamShape("lm_head", (e, v), ("embed", "vocab")))
    return sorted(params, key=lambda p: p.name)


def model_buffers(m: ModelConfig) -> list[ParamShape]:
    """Non-trainable variables (``TrainState.buffers``): the router biases of aux-loss-free
    balancing, float32 and replicated."""
    if not m.moe.enabled or m.moe.router != "sigmoid_bias":
        return []
    units = m.n_layers // m.moe.every
    return [ParamShape(f"{prefix}moe/router_bias", (units, m.moe.num_experts), ("layers", None))
            for prefix, moe in _unit_prefixes(m) if moe]


SpecEntry = str | tuple[str, ...] | None


def _entry_axes(entry: SpecEntry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _parts(spec: Sequence[SpecEntry], mesh: Mapping[str, int]) -> int:
    """How many pieces a spec cuts an array into."""
    return math.prod(mesh[a] for entry in spec for a in _entry_axes(entry))


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

    @property
    def matmul(self) -> bool:
        """A weight the model casts to the compute dtype (everything but the norm scales and the
        MoE router, which routes in float32)."""
        return not self.name.endswith(("/scale", "/router"))

    @property
    def expert(self) -> bool:
        """A routed expert's weight (split over ``expert``, used inside the expert shard_map)."""
        return "/moe/w_" in self.name


def param_costs(cfg: Config) -> list[ParamCost]:
    """Split every parameter with the config's rules (a ConfigError names a bad rule)."""
    mesh = cfg.mesh_shape
    rules = logical_rules(cfg)
    out = []
    for p in model_params(cfg.model):
        spec = tuple(resolve_spec(p.name, p.names, p.shape, rules, mesh))
        spec = spec + (None,) * (len(p.shape) - len(spec))
        size = math.prod(p.shape) * PARAM_BYTES
        moment_spec = _zero1_spec(spec, p.names, mesh) if cfg.parallel.zero == 1 else spec
        fsdp_parts = math.prod(mesh[a] for e in spec for a in _entry_axes(e) if a == "fsdp")
        out.append(ParamCost(
            name=p.name, shape=p.shape, spec=spec,
            bytes_per_device=size // _parts(spec, mesh),
            moment_bytes_per_device=size // _parts(moment_spec, mesh),
            gathered_bytes=size // _parts(spec, mesh) * fsdp_parts,
            stacked=p.stacked))
    return out


def _zero1_spec(spec: tuple[SpecEntry, ...], names: tuple[str, ...],
                mesh: Mapping[str, int]) -> tuple[SpecEntry, ...]:
    """ZeRO-1's moment spec: the ``embed`` dim also split over data and fsdp (parallel/zero.py)."""
    extra = tuple(a for a in ZERO1_AXES if mesh[a] > 1)
    if not extra or "embed" not in names:
        return spec
    dim = names.index("embed")
    existing = _entry_axes(spec[dim])
    merged = existing + tuple(a for a in extra if a not in existing)
    return spec[:dim] + (merged,) + spec[dim + 1:]


# --------------------------------------------------------------------------------------------
# Report types


@dataclass(frozen=True)
class MemoryCost:
    """Bytes per device. ``state``: what the step takes and returns (donated)."""

    params: int
    optimizer: int  # two Adam moments + two int32 counts
    gradients: int  # including the accumulator when grad_accum > 1
    batch: int  # inputs, targets (int32) and mask (float32) rows of this device
    activations: int  # saved for the backward pass, all layers, one micro-batch
    working: int  # one layer's backward, the head's logits, FSDP-gathered weights
    update: int  # the optimizer update's temporaries (after activations are freed)
    stash: int = 0  # pipeline: stage inputs and output gradients held between F and backward
    buffers: int = 0  # non-trainable model state (MoE router biases)

    @property
    def state(self) -> int:
        return self.params + self.optimizer + self.buffers + 4  # + the int32 step of TrainState

    @property
    def peak(self) -> int:
        return (self.state + self.gradients + self.batch
                + max(self.activations + self.stash + self.working, self.update))


@dataclass(frozen=True)
class CollectiveCost:
    """One logical communication of the step, per device, summed over the step."""

    kind: str  # all-reduce, all-gather, reduce-scatter (as jaxpar.inspect.hlo.KINDS)
    axes: tuple[str, ...]  # mesh axes its groups span
    count: int  # executions per step
    bytes: int  # payload per device per step
    wire_bytes: int  # ring bytes sent per device per step
    what: str  # which tensors, and why
    overlapped: bool  # hidden behind compute by the overlap rule (module docstring)


@dataclass(frozen=True)
class FlopsCost:
    """FLOPs per device per step."""

    model: float  # useful work (what MFU counts): flops.train_flops_per_token x tokens
    embedding_one_hot: float  # the one-hot embedding matmul, forward + weight gradient
    recompute: float  # remat's extra forward work
    context_attention: float = 0.0  # ring attention's executed minus dense attention's flops
    expert_padding: float = 0.0  # MoE rows computed that carry no token (and XLA:CPU's ragged_dot)

    @property
    def executed(self) -> float:
        return (self.model + self.embedding_one_hot + self.recompute + self.context_attention
                + self.expert_padding)


@dataclass(frozen=True)
class TimeCost:
    """Seconds per step on one hardware profile (see the overlap rule in the docstring)."""

    hardware: str
    compute: float
    comm_by_axis: dict[str, float]  # "tensor (NVLink)" -> seconds
    blocking_comm: float
    overlapped_comm: float
    exposed_comm: float  # the part of overlapped_comm that compute does not hide
    step: float
    tokens_per_s: float
    mfu: float


@dataclass(frozen=True)
class CostReport:
    """Everything :func:`estimate` predicts for one config; ``time`` needs a hardware profile."""

    cfg: Config  # validated
    devices: int
    mesh: dict[str, int]
    params: list[ParamCost]
    memory: MemoryCost
    collectives: list[CollectiveCost]
    flops: FlopsCost
    time: TimeCost | None
    notes: list[str] = field(default_factory=list)
    micro_batch: int = 0  # sequences per device per micro-step (per microbatch with pipe)
    tokens_per_step: int = 0  # global
    pipeline: dict | None = None  # parallel.pipeline.describe(): schedule, ticks, bubble, slots

    def collective_rows(self) -> list[dict[str, Any]]:
        """One row per (kind, axes) like ``summarize_collectives`` (per step totals)."""
        return summarize(self.collectives)

    def to_dict(self) -> dict[str, Any]:
        """Plain dicts and lists, for ``json.dumps``."""
        out = asdict(self)
        out["memory"].update(state=self.memory.state, peak=self.memory.peak)
        out["flops"]["executed"] = self.flops.executed
        out["collective_rows"] = self.collective_rows()
        return out


def summarize(collectives: Sequence[CollectiveCost]) -> list[dict[str, Any]]:
    rows: dict[tuple[str, tuple[str, ...]], dict[str, Any]] = {}
    for c in collectives:
        row = rows.setdefault((c.kind, c.axes), {"kind": c.kind, "axes": list(c.axes),
                                                 "count": 0, "bytes": 0, "wire_bytes": 0})
        row["count"] += c.count
        row["bytes"] += c.bytes
        row["wire_bytes"] += c.wire_bytes
    return [rows[key] for key in sorted(rows)]


# --------------------------------------------------------------------------------------------
# The estimate


def wire_bytes(kind: str, payload: int, group: int) -> int:
    """Ring bytes each device sends (the definitions of jaxpar.inspect.hlo)."""
    if group <= 1:
        return 0
    if kind == "all-reduce":
        return payload * 2 * (group - 1) // group
    if kind == "collective-permute":
        return payload
    return payload * (group - 1) // group


@dataclass(frozen=True)
class _Step:
    """The sizes every formula below uses."""

    cfg: Config
    b: int  # micro-batch per device
    s: int  # global sequence length
    a: int  # compute dtype bytes
    accum: int
    mesh: dict[str, int]
    sp: bool  # sequence parallelism in effect (tensor > 1)
    xla_cpu: bool  # predict XLA:CPU's program rather than the GPU/TPU compilers'
    pipeline: dict | None = None  # parallel.pipeline.describe() when pipe > 1

    @property
    def p(self) -> int:
        return self.mesh["pipe"]

    @property
    def m(self) -> int:
        """Pipeline microbatches per micro-step (1 without a pipeline)."""
        return self.cfg.train.microbatches

    @property
    def layers(self) -> int:
        """Layers this device runs: its stage's share of the stack."""
        return self.cfg.model.n_layers // self.p

    @property
    def runs(self) -> int:
        """How often a device runs its layers forward per step: micro-steps x microbatches."""
        return self.accum * self.m

    @property
    def recomputes(self) -> int:
        """Extra forwards the pipeline executor runs per microbatch and chunk: one inside each
        B, two for a split backward (I and W each recompute)."""
        if self.pipeline is None:
            return 0
        return 2 if self.pipeline["schedule"] == "zero_bubble" else 1

    @property
    def sent(self) -> int:
        """Bytes of one stage-to-stage message: a microbatch's residual stream shard (split
        over tensor too under sequence parallelism), as it travels."""
        return self.tokens_x_embed(self.wire) // (self.t if self.sp else 1)

    @property
    def wire(self) -> int:
        """Bytes per compute-dtype element on the wire: XLA:CPU computes bf16 dots in float32."""
        return PARAM_BYTES if self.xla_cpu else self.a

    @property
    def column_parallel_reductions(self) -> int:
        """Backward input-gradient reductions per layer over tensor: XLA:CPU reduces q, k, v,
        gate and up one by one; the TPU compiler sums q/k/v and gate/up first, as Megatron."""
        return 5 if self.xla_cpu else 2

    @property
    def t(self) -> int:
        return self.mesh["tensor"]

    @property
    def c(self) -> int:
        return self.mesh["context"]

    @property
    def sl(self) -> int:
        """Tokens of a sequence on this device (split over context)."""
        return self.s // self.c

    @property
    def ring(self) -> bool:
        return self.c > 1 and self.cfg.parallel.context_impl == "ring"

    @property
    def act(self) -> int:
        """A: one residual-stream activation, b x S/c x E in the compute dtype."""
        return self.b * self.sl * self.cfg.model.d_model * self.a

    def tokens_x_embed(self, element_bytes: int) -> int:
        """b x S/c x E elements of ``element_bytes`` each (an activation on the wire)."""
        return self.b * self.sl * self.cfg.model.d_model * element_bytes

    # Mixture of experts: per device and micro-step, per MoE layer.

    @property
    def tokens(self) -> int:
        """T: tokens one device routes per micro-step (its b rows x S/c positions)."""
        return self.b * self.sl

    @property
    def moe_exchange(self) -> str | None:
        """How slots cross the expert axis: ``capacity`` (dropping), ``padded`` (dropless on
        XLA:CPU), ``ragged`` (dropless elsewhere), or None (no expert axis, or a dense model)."""
        moe = self.cfg.model.moe
        if not moe.enabled or self.mesh["expert"] == 1:
            return None
        if moe.dispatch == "dropping":
            return "capacity"
        return "padded" if self.xla_cpu else "ragged"

    @property
    def expert_rows(self) -> int:
        """Rows one device's experts compute per MoE layer (= rows of each all-to-all): the
        capacity buffer, the worst-case blocks of the padded exchange, or the T x k real slots."""
        moe, g = self.cfg.model.moe, self.mesh["expert"]
        if moe.dispatch == "dropping":
            return moe.num_experts * moe.capacity(self.tokens)
        if self.moe_exchange == "padded":
            return g * self.tokens * min(moe.top_k, moe.num_experts // g)
        return self.tokens * moe.top_k

    @property
    def kv_block(self) -> int:
        """Elements of this device's K (or V): b x S/c x K/t x D."""
        m = self.cfg.model
        return self.b * self.sl * (m.n_kv_heads // self.t) * m.resolved_head_dim


def _step(cfg: Config, xla_cpu: bool) -> _Step:
    mesh = dict(cfg.mesh_shape)
    shards = math.prod(mesh[a] for a in BATCH_AXES)
    t, par = cfg.train, cfg.parallel
    b = t.batch_size // (t.grad_accum * t.microbatches * shards)
    pipeline = (describe(par.pipeline_schedule, mesh["pipe"], t.microbatches, par.virtual_stages)
                if mesh["pipe"] > 1 else None)
    return _Step(cfg=cfg, b=b, s=t.seq_len, a=DTYPE_BYTES[t.dtype], accum=t.grad_accum,
                 mesh=mesh, sp=par.sequence_parallel and mesh["tensor"] > 1, xla_cpu=xla_cpu,
                 pipeline=pipeline)


def estimate(cfg: Config, hardware: str | HardwareProfile | None = None) -> CostReport:
    """The cost of one step of ``cfg`` (validated: mesh resolved), per device.

    With ``hardware`` (a profile or its name in :data:`jaxpar.inspect.hardware.PROFILES`) the
    report also has step time and MFU, and its collectives are those of that platform's
    compiler: without one (or with ``cpu``) they are XLA:CPU's, i.e. what ``jaxpar inspect``
    compiles on this machine (module docstring). Raises ConfigError if the mesh still has a -1
    axis or a rule does not divide a parameter.
    """
    if any(size < 1 for size in cfg.mesh_shape.values()):
        raise ConfigError("estimate: the config must be validated first (mesh has a -1 axis)")
    hw = get_profile(hardware) if hardware is not None else None
    st = _step(cfg, xla_cpu=hw is None or hw.name == "cpu")
    params = param_costs(cfg)
    collectives = _collectives(st, params)
    flops = _flops(st)
    memory = _memory(st, params)
    time = _time(st, collectives, flops, hw) if hw is not None else None
    return CostReport(cfg=cfg, devices=math.prod(st.mesh.values()), mesh=st.mesh, params=params,
                      memory=memory, collectives=collectives, flops=flops, time=time,
                      notes=_notes(st), micro_batch=st.b,
                      tokens_per_step=cfg.train.batch_size * cfg.train.seq_len,
                      pipeline=st.pipeline)


def _notes(st: _Step) -> list[str]:
    notes = []
    if st.cfg.parallel.rules:
        notes.append("parallel.rules overrides: parameter bytes follow them, collectives assume "
                     "the default table")
    if st.cfg.train.dtype == "float32":
        notes.append("train.dtype=float32: compute timed at the dense bf16 peak (optimistic)")
    if st.accum > 1:
        notes.append(f"grad_accum={st.accum}: gradients are reduced every micro-step, as the "
                     "compiled step does")
    if st.pipeline is not None:
        notes.append(f"pipeline {st.pipeline['schedule']}: bubble {st.pipeline['bubble']:.1%} "
                     "of the ticks idle (compute time divided by 1 - bubble); the executor "
                     f"recomputes each chunk's forward {st.recomputes}x in the backward")
    if st.ring:
        notes.append("ring attention skips the causal half of the S x S square that model flops "
                     "(jaxpar.model.flops) count as useful, so the MFU bound can pass 100%")
    if st.moe_exchange is not None:
        moe, slots = st.cfg.model.moe, st.tokens * st.cfg.model.moe.top_k
        notes.append(f"MoE all-to-alls carry {st.expert_rows:,} rows per layer and device, "
                     f"{slots:,} of them tokens ({1 - slots / st.expert_rows:.0%} padding; "
                     + ("dropping: unused capacity" if moe.dispatch == "dropping" else
                        "padded all-to-all: worst-case blocks" if st.moe_exchange == "padded"
                        else "ragged: load imbalance not modelled") + ")")
    return notes


def _collectives(st: _Step, params: list[ParamCost]) -> list[CollectiveCost]:
    out: list[CollectiveCost] = []
    mesh, cfg, n_layers, g = st.mesh, st.cfg, st.layers, st.accum
    # Under a pipeline a device runs its stage's layers once per microbatch, forward once plus
    # once per recomputation (``_Step.recomputes``), backward once (twice split into I and W),
    # and reduces weight gradients after every microbatch's backward. ``runs`` = g without one.
    runs, fw, bw = st.runs, 1 + st.recomputes, max(1, st.recomputes)
    grad_runs = g if st.pipeline is None else runs

    def add(kind: str, axes: tuple[str, ...], count: int, total: int, what: str,
            overlapped: bool) -> None:
        """``count`` executions per step moving ``total`` payload bytes in all."""
        axes = tuple(a for a in axes if mesh[a] > 1)
        group = math.prod(mesh[a] for a in axes)
        if count and total and group > 1:
            out.append(CollectiveCost(kind, axes, count, total, wire_bytes(kind, total, group),
                                      what, overlapped))

    layer = [p for p in params if p.stacked]
    other = [p for p in params if not p.stacked]

    def moved(p: ParamCost, nbytes: int) -> int:
        return _in_compute_dtype(p, nbytes, st.wire)

    def grad(p: ParamCost, nbytes: int) -> int:
        """Gradients travel like their weights, but lm_head's: its matmul yields float32."""
        return nbytes if p.name == "lm_head" else moved(p, nbytes)

    def reduced(group: list[ParamCost], gathered: bool = False) -> int:
        """Gradient bytes of ``group`` reduced per step (``gathered``: the unscattered size).
        Under a pipeline each backward reduces what it produced: its chunk's layers every
        microbatch, the shared parameters (embedding, final norm, head) on the first and last
        stage only, 1/p of the runs on average."""
        def size(p: ParamCost) -> int:
            return grad(p, p.gathered_bytes if gathered else p.bytes_per_device)

        layers = sum(size(p) for p in group if p.stacked)
        shared = sum(size(p) for p in group if not p.stacked)
        if st.pipeline is None:
            return g * (layers + shared)
        return runs * layers + runs // st.p * shared

    # Parameters are replicated over data, expert and context (and fsdp under ZeRO-1), except
    # the routed experts' weights, which are split over expert: one all-reduce per set of axes
    # sums the gradient shards.
    replicas = (("data", "expert", "context") if cfg.parallel.zero == 3 else
                (*ZERO1_AXES, "expert", "context"))
    by_replicas: dict[tuple[str, ...], list[ParamCost]] = {}
    for p in params:
        split = {a for entry in p.spec for a in _entry_axes(entry)}
        by_replicas.setdefault(tuple(a for a in replicas if a not in split), []).append(p)
    units = n_layers // cfg.model.moe.every if cfg.model.moe.enabled else n_layers

    # ZeRO-3 / FSDP: weights gathered where used, gradients reduce-scattered to their shards.
    if cfg.parallel.zero == 3 and mesh["fsdp"] > 1:
        fsdp_layer = [p for p in layer if p.gathered_bytes != p.bytes_per_device]
        fsdp_other = [p for p in other if p.gathered_bytes != p.bytes_per_device]
        # remat=none keeps each layer's gathered weights for the backward pass; remat gathers
        # them again there.
        passes = (1 if cfg.train.remat == "none" else 2) * fw
        add("all-gather", ("fsdp",), passes * n_layers * runs * len(fsdp_layer),
            passes * runs * sum(moved(p, p.gathered_bytes) for p in fsdp_layer),
            "layer weights gathered before use" + (", and again backward" if passes == 2
                                                   else " (kept for the backward pass)"), True)
        add("all-gather", ("fsdp",), len(fsdp_other),
            sum(moved(p, p.gathered_bytes) for p in fsdp_other),
            "embedding, lm_head and final norm gathered once per step", True)
        add("reduce-scatter", ("fsdp",), (n_layers + 1) * grad_runs,
            reduced(fsdp_layer + fsdp_other, gathered=True),
            "gradients reduce-scattered to their shards, every micro-step", True)

    # Data (and context) parallelism: gradients summed over the replicas, every micro-step;
    # ZeRO-1 then gathers the parameters each device updated for its slice of the moments.
    for axes, group in by_replicas.items():
        experts = all(p.expert for p in group)
        add("all-reduce", axes,
            grad_runs * (units * any(p.stacked for p in group)
                         + any(not p.stacked for p in group)),
            reduced(group),
            ("routed experts' " if experts else "")
            + ("gradient shards" if cfg.parallel.zero == 3 else "ZeRO-1: whole gradients")
            + " all-reduced, every " + ("micro-step" if st.pipeline is None else "microbatch"),
            True)
    if cfg.parallel.zero == 1:
        add("all-gather", ZERO1_AXES, len(params), sum(p.bytes_per_device for p in params),
            "ZeRO-1: updated parameters gathered from the optimizer shards", False)

    # Context parallelism: attention's keys and values.
    if st.ring:
        c, blk, per_layer = st.c, st.kv_block, n_layers * runs
        add("collective-permute", ("context",), per_layer * 2 * (c - 1),
            per_layer * 2 * (c - 1) * blk * st.wire, "ring attention: K, V blocks forward",
            True)
        add("collective-permute", ("context",), per_layer * 2 * (c - 1),
            per_layer * 2 * (c - 1) * blk * st.wire, "ring attention: K, V blocks backward",
            True)
        add("collective-permute", ("context",), per_layer * 2 * c,
            per_layer * 2 * ((c - 1) * blk * 4 + blk * st.wire),
            "ring attention: dK, dV travelling home backward (float32, the last hop cast)", True)
    elif st.c > 1:  # allgather: K and V gathered whole, their gradients reduce-scattered
        per_layer, gathered = n_layers * runs, st.kv_block * st.c * st.wire
        add("all-gather", ("context",), 2 * per_layer * fw, 2 * per_layer * fw * gathered,
            "context allgather attention: K, V of the whole sequence forward", False)
        add("reduce-scatter", ("context",), 2 * per_layer * bw, 2 * per_layer * bw * gathered,
            "context allgather attention: dK, dV backward", False)

    # Expert parallelism: each MoE layer's slots travel to their experts' devices and back
    # (dispatch, combine), and again in the backward pass; remat recomputes the forward pair.
    moe = cfg.model.moe
    if st.moe_exchange is not None:
        per_layer, rows = cfg.model.n_moe_layers * g, st.expert_rows
        payload = rows * cfg.model.d_model * st.wire
        kind = "ragged-all-to-all" if st.moe_exchange == "ragged" else "all-to-all"
        forward = 2 if cfg.train.remat == "none" else 4
        real = {"capacity": f"capacity buffer of {rows} rows per layer",
                "padded": f"worst-case blocks, {rows} rows per layer, "
                          f"{st.tokens * moe.top_k} of them tokens",
                "ragged": f"{rows} token rows per layer"}[st.moe_exchange]
        add(kind, ("expert",), per_layer * forward, per_layer * forward * payload,
            f"MoE dispatch + combine forward{', again in remat' if forward == 4 else ''} "
            f"({real})", False)
        add(kind, ("expert",), per_layer * 2, per_layer * 2 * payload,
            "MoE dispatch + combine backward", False)
        if st.moe_exchange == "padded":  # each row's int32 expert id travels with it
            ids = forward // 2
            add("all-to-all", ("expert",), per_layer * ids, per_layer * ids * rows * 4,
                "MoE expert ids of the padded rows (forward)", False)

    # Tensor (and sequence) parallelism: activations, blocking. lm_head's input gradient is
    # float32 (the logits are); everything else moves in the compute dtype.
    if st.t > 1:
        act, head_grad = st.tokens_x_embed(st.wire), st.tokens_x_embed(4)
        remat = cfg.train.remat
        # Per step, over all layers: row-parallel outputs forward (attention and MLP, or the
        # experts' summed outputs and the shared experts'), column-parallel input gradients
        # backward (a MoE layer's tokens enter its experts once: one reduction, see
        # jaxpar.parallel.expert).
        n_moe = cfg.model.n_moe_layers
        shared = 1 if moe.num_shared_experts else 0
        rows_per_layer = (n_layers - n_moe) * ROW_PARALLEL_MATMULS + n_moe * (2 + shared)
        column = st.column_parallel_reductions
        moe_column = (3 + 1 + 2 * shared) if st.xla_cpu else (1 + 1 + shared)
        columns = (n_layers - n_moe) * column + n_moe * moe_column
        row_outputs = runs * (rows_per_layer + n_layers * (remat == "full"))
        column_grads = runs * columns
        per_layer = n_layers * runs  # activation traffic: per microbatch
        # the embedding and head run on the first and last stage only: averaged over stages
        ends = max(1, runs // st.p)

        def add_act(kind: str, count: int, what: str, payload: int = act,
                    times: int = 1) -> None:
            """``times``: the forward (fw) or backward (bw) multiplicity under a pipeline."""
            count *= times
            add(kind, ("tensor",), count, count * payload, what, False)

        if not st.sp:
            add_act("all-reduce", row_outputs,
                    "row-parallel outputs (attention, MLP) forward"
                    + (", attention again in remat" if remat == "full" else ""), times=fw)
            add_act("all-reduce", column_grads,
                    "column-parallel input gradients backward (" + ("q, k, v, gate, up" if
                    column == 5 else "q+k+v, gate+up") + ")", times=bw)
            add_act("all-reduce", ends, "vocab-parallel embedding forward", times=fw)
            add_act("all-reduce", ends, "lm_head input gradient backward", payload=head_grad,
                    times=bw)
        else:
            gathers = 2 + 2 + (2 if remat in ("dots", "full") else 0)
            add_act("all-gather", per_layer * gathers,
                    "sequence gathered entering attention/MLP (forward; output gradients "
                    "backward" + ("; again in remat" if remat != "none" else "") + ")", times=fw)
            add_act("reduce-scatter", row_outputs,
                    "sequence scattered leaving attention/MLP forward", times=fw)
            add_act("reduce-scatter", column_grads,
                    "column-parallel input gradients backward (" + ("q, k, v, gate, up" if
                    column == 5 else "q+k+v, gate+up") + ")", times=bw)
            add_act("all-gather", 2 * ends,
                    "lm_head input forward, embedding output gradient backward", times=fw)
            add_act("reduce-scatter", ends, "vocab-parallel embedding forward", times=fw)
            add_act("reduce-scatter", ends, "lm_head input gradient backward", payload=head_grad,
                    times=bw)
            add("all-reduce", ("tensor",), (n_layers + 1) * grad_runs,
                grad_runs * (2 * n_layers + 1) * cfg.model.d_model * PARAM_BYTES,
                "norm-scale gradients of the sequence shards", False)
        add_act("all-reduce", 2 * ends, "vocab-parallel loss: max and sum of exponentials",
                payload=st.b * st.sl * 4, times=fw)

    # Pipeline: every tick of the table each device sends one activation forward and one
    # gradient backward (zeros when its entry sends nothing); the replicated shared parameters'
    # gradients are summed over the stages once per micro-step.
    if st.pipeline is not None:
        ticks = st.pipeline["ticks"]
        add("collective-permute", ("pipe",), 2 * ticks * g, 2 * ticks * g * st.sent,
            f"pipeline: activation forward + gradient backward, each of {ticks} ticks", False)
        add("all-reduce", ("pipe",), g, g * sum(p.bytes_per_device for p in other),
            "pipeline: embedding, final norm and head gradients summed over stages", True)
    return out


def _flops(st: _Step) -> FlopsCost:
    m, cfg = st.cfg.model, st.cfg
    per_device = cfg.train.batch_size * cfg.train.seq_len / math.prod(st.mesh.values())
    attention_forward = 4 * m.n_layers * m.n_heads * m.resolved_head_dim * st.s  # per token
    layer_matmuls = matmul_params(m) - m.d_model * m.vocab_size
    # Ring attention runs inside a custom VJP whose outputs are kept, so remat never redoes it.
    recomputed_attention = 0 if st.ring else attention_forward
    # The routed experts' matmuls (ragged or batched dots) are not what `dots` saves.
    expert = 3 * m.d_model * m.resolved_d_ff_expert if m.moe.enabled else 0
    recomputed_experts = 2 * m.n_moe_layers * m.moe.top_k * expert
    recompute = {"none": 0, "dots": recomputed_attention + recomputed_experts,
                 "full": 2 * layer_matmuls + recomputed_attention}[cfg.train.remat]
    # The pipeline executor's backward recomputes the chunk's forward (once per B, twice for
    # a split I + W), on top of what remat recomputes inside that backward.
    recompute += st.recomputes * (2 * layer_matmuls + attention_forward)
    padding = 0.0
    if m.moe.enabled:
        # Rows the experts compute beyond the T x k slots: capacity slack, padded blocks, and
        # on XLA:CPU ragged_dot's lowering, a dense matmul masked per expert (all local ones).
        local = m.moe.num_experts // st.mesh["expert"]
        rows = st.expert_rows * (local if st.xla_cpu and m.moe.dispatch == "dropless" else 1)
        padding = (m.n_moe_layers * st.accum * (rows - st.tokens * m.moe.top_k) * 6 * expert
                   / st.t)
    ring_delta = 0.0
    if st.ring:
        # Blocks computed by the busiest device, as a fraction of the full S x S square: the
        # zigzag layout balances the causal half (2c+1 of 4c chunk pairs each); a contiguous
        # split leaves the last device all of its blocks. Flash-style backward: 5 matmuls per
        # block (scores recomputed) against dense attention's 4, forward 2 as dense.
        c = st.c
        done = (2 * c + 1) / (4 * c) if cfg.parallel.zigzag else 1.0
        ring_delta = done * attention_forward * (1 + 10 / 4) - 3 * attention_forward
    return FlopsCost(model=train_flops_per_token(m, st.s) * per_device,
                     embedding_one_hot=4 * m.vocab_size * m.d_model * per_device,
                     recompute=recompute * per_device,
                     context_attention=ring_delta * per_device,
                     expert_padding=padding)


def _moe_activations(st: _Step, remat: str) -> int:
    """Bytes a MoE layer's feed-forward part saves, one micro-batch (in place of the SwiGLU's):
    router logits, probabilities and one-hot choices (float32); the k copies of each token and
    their outputs; the rows sent, received and returned ([expert_rows, E]); the experts' five
    hidden-sized tensors per row; the shared experts like a SwiGLU. ``dots`` keeps only the
    router logits and the shared experts' matmul outputs: the routed experts' ragged or batched
    dots are recomputed, with their all-to-alls."""
    m, moe, a, t = st.cfg.model, st.cfg.model.moe, st.a, st.t
    tokens, e = st.tokens, m.d_model
    shared = tokens * moe.num_shared_experts * m.resolved_d_ff_expert // t * a
    if remat == "dots":
        return tokens * moe.num_experts * 4 + 2 * shared
    rows = st.expert_rows
    return (3 * tokens * moe.num_experts * 4 + 2 * tokens * moe.top_k * e * a
            + 3 * rows * e * a + 5 * rows * m.resolved_d_ff_expert // t * a + 5 * shared)


def _layer_activations(st: _Step, remat: str, moe: bool = False) -> int:
    """Bytes one layer saves for the backward pass, one micro-batch (module docstring)."""
    m, b, s, a, t = st.cfg.model, st.b, st.sl, st.a, st.t
    d = m.resolved_head_dim
    full = b * s * m.d_model * a  # A
    residual = full // t if st.sp else full
    q = b * s * (m.n_heads // t) * d * a
    kv = 2 * b * s * (m.n_kv_heads // t) * d * a
    mlp = b * s * (m.d_ff // t) * a
    # Ring attention's custom VJP keeps its float32 output and log-sum-exp whatever the policy.
    ring = b * s * (m.n_heads // t) * (d + 1) * 4 if st.ring else 0
    if remat == "full":
        return residual + ring
    ffn = _moe_activations(st, remat) if moe else (5 if remat == "none" else 2) * mlp
    if remat == "dots":
        return residual + q + kv + full + ffn + ring
    # What autodiff keeps (jax's residuals): per RMSNorm its input, the float32 normalised
    # values and the (gathered) output; rotated q, k and v; the attention output; gate, its
    # sigmoid, silu(gate), up and their product; two float32 S x S tensors per head (XLA keeps
    # the masked scores alive next to the softmax output), plus a compute-dtype copy of the
    # probabilities for the weighted sum when that dtype is narrower.
    norm = residual + residual * 4 // a + full
    keys = st.s if st.c > 1 else s  # allgather attention: local queries x the whole sequence
    probs = 0 if st.ring else b * (m.n_heads // t) * s * keys * (2 * 4 + (a if a < 4 else 0))
    return 2 * norm + q + kv + q + ffn + probs + ring


def _in_compute_dtype(p: ParamCost, nbytes: int, a: int) -> int:
    """Bytes of a weight (or its gradient) as it travels: cast to the compute dtype, except
    the norm scales, which stay float32."""
    return nbytes * a // PARAM_BYTES if p.matmul else nbytes


def _memory(st: _Step, params: list[ParamCost]) -> MemoryCost:
    cfg, m = st.cfg, st.cfg.model
    param_bytes = sum(p.bytes_per_device for p in params)
    moments = sum(p.moment_bytes_per_device for p in params)
    head = st.b * st.sl * (m.vocab_size // st.t) * (4 + 4 + st.a) + 2 * st.act
    # One layer's weights as its matmuls read them: cast to the compute dtype, gathered over
    # fsdp. remat=none keeps them for the backward pass, in every layer.
    # (With MoE every=k > 1, a "layer" here is one scanned group of k blocks.)
    blocks = [moe for _, moe in _unit_prefixes(m)]
    units = m.n_layers // len(blocks)
    layer_weights = sum(_in_compute_dtype(p, p.gathered_bytes, st.a)
                        for p in params if p.stacked) // units
    kept_weights = layer_weights if cfg.train.remat == "none" else 0
    gathered = 0
    if cfg.parallel.zero == 3 and st.mesh["fsdp"] > 1:  # one layer's weights and gradient
        gathered = 2 * layer_weights + sum(_in_compute_dtype(p, p.gathered_bytes, st.a)
                                           for p in params if not p.stacked)
    if st.ring:  # one block's float32 scores, probabilities and their gradients
        chunk = st.sl // (2 if cfg.parallel.zigzag else 1)
        head += 4 * st.b * (m.n_heads // st.t) * chunk * chunk * 4
    rows = cfg.train.batch_size // math.prod(st.mesh[a] for a in BATCH_AXES)
    saved_layers, stash = m.n_layers, 0
    if st.pipeline is not None:
        # Between a chunk's F and its backward only its input is kept (a stash slot); the
        # backward recomputes one chunk at a time, saving what remat lets it for those layers.
        saved_layers = st.layers // cfg.parallel.virtual_stages
        slots = st.pipeline["activation_slots"] + st.pipeline["gradient_slots"]
        stash = slots * st.act // (st.t if st.sp else 1)
    return MemoryCost(
        params=param_bytes,
        optimizer=2 * moments + 2 * 4,  # + int32 counts of Adam and the lr schedule
        gradients=param_bytes * (2 if st.accum > 1 else 1),
        batch=rows * st.sl * 12,
        activations=(saved_layers if st.pipeline is not None else units)
        * (sum(_layer_activations(st, cfg.train.remat, moe) for moe in blocks) + kept_weights),
        working=max(_layer_activations(st, "none", moe) for moe in blocks) + head + gathered,
        update=moments,
        stash=stash,
        buffers=sum(math.prod(b.shape) * PARAM_BYTES for b in model_buffers(m)))


def _time(st: _Step, collectives: list[CollectiveCost], flops: FlopsCost,
          hw: HardwareProfile) -> TimeCost:
    compute = flops.executed / hw.peak_flops
    if st.pipeline is not None:  # idle ticks: the same work spread over more time
        compute /= 1 - st.pipeline["bubble"]
    by_axis: dict[str, float] = {}
    blocking = overlapped = 0.0
    for c in collectives:
        link, bandwidth = hw.axis_link(st.mesh, c.axes)
        seconds = c.wire_bytes / bandwidth
        label = f"{'+'.join(c.axes)} ({link})"
        by_axis[label] = by_axis.get(label, 0.0) + seconds
        if c.overlapped:
            overlapped += seconds
        else:
            blocking += seconds
    exposed = max(0.0, overlapped - compute)
    step = compute + blocking + exposed
    tokens = st.cfg.train.batch_size * st.s
    return TimeCost(hardware=hw.name, compute=compute, comm_by_axis=by_axis,
                    blocking_comm=blocking, overlapped_comm=overlapped, exposed_comm=exposed,
                    step=step, tokens_per_s=tokens / step,
                    mfu=flops.model / (step * hw.peak_flops))
