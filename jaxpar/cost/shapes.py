"""The sizes every formula of the cost model uses, per device, for one config.

The notation (B, S, E, ... and ``A = b * S/c * E * a``): docs/cost-model.md, "Notation".
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from jaxpar.config import BATCH_AXES, Config
from jaxpar.cost.params import PARAM_BYTES
from jaxpar.model.fused import resolve
from jaxpar.model.transformer import layer_is_local
from jaxpar.parallel.context import zigzag_order
from jaxpar.parallel.pipeline.executor import describe
from jaxpar.platform import splash_possible

DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


@dataclass(frozen=True)
class StepSizes:
    """The sizes every cost formula uses."""

    cfg: Config
    b: int  # micro-batch per device
    s: int  # global sequence length
    a: int  # compute dtype bytes
    accum: int
    mesh: dict[str, int]
    sp: bool  # sequence parallelism in effect (tensor > 1)
    xla_cpu: bool  # predict XLA:CPU's program rather than the GPU/TPU compilers'
    pipeline: dict | None = None  # parallel.pipeline.describe() when pipe > 1
    platform: str = "cpu"  # the backend `model.attention=auto` resolves for

    @property
    def p(self) -> int:
        return self.mesh["pipe"]

    @property
    def m(self) -> int:
        """Pipeline microbatches per micro-step (1 without a pipeline)."""
        return self.cfg.train.microbatches

    @property
    def layers(self) -> int:
        """Layers this device runs: its stage's share."""
        return self.cfg.model.n_layers // self.p

    @property
    def moe_layers(self) -> int:
        """MoE layers this device runs: its stage's share."""
        return self.cfg.model.n_moe_layers // self.p

    @property
    def runs(self) -> int:
        """Forward runs of a device's layers per step: micro-steps x microbatches."""
        return self.accum * self.m

    @property
    def wire(self) -> int:
        """Bytes per compute-dtype element on the wire (XLA:CPU computes bf16 dots in float32)."""
        return PARAM_BYTES if self.xla_cpu else self.a

    @property
    def attention_matmuls(self) -> int:
        """Attention's column-parallel matmuls under tensor parallelism: q+k+v stacked
        (``projection.project_all``); q and k+v under GQA (XLA:CPU reduces their input gradients one
        by one); q, k and v in a pipeline stage (weights not stacked)."""
        if self.pipeline is not None:
            return 3
        return 1 if self.cfg.model.n_kv_heads == self.cfg.model.n_heads else 2

    @property
    def mlp_matmuls(self) -> int:
        """SwiGLU's column-parallel matmuls: gate+up stacked; gate and up in a pipeline."""
        return 2 if self.pipeline is not None else 1

    @property
    def column_matmuls(self) -> int:
        """Matmuls per dense layer reading the gathered input under tensor parallelism."""
        return self.attention_matmuls + self.mlp_matmuls

    @property
    def column_parallel_reductions(self) -> int:
        """Input-gradient reductions over tensor per layer: one per column matmul on
        XLA:CPU; the TPU compiler sums them first."""
        return self.column_matmuls if self.xla_cpu else 2

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
    def loss_pieces(self) -> int:
        """Sequence pieces the loss (or the pipeline's head) is computed in."""
        return self.cfg.loss_pieces()

    @property
    def embedding_grad_pieces(self) -> int:
        """Vocabulary slices the embedding's gradient is built in (a stage: of its piece)."""
        return self.cfg.embedding_grad_pieces()

    @property
    def vocab_rows(self) -> int:
        """The vocabulary padded for the layout (``Config.vocab_rows``): bytes and executed flops
        count it; useful flops count ``model.vocab_size``."""
        return self.cfg.vocab_rows()

    @property
    def ring(self) -> bool:
        """K/V blocks go round a ring over ``context``: ``ring``, the ``hybrid``'s outer."""
        return self.c > 1 and self.cfg.parallel.context_impl in ("ring", "hybrid")

    @property
    def ulysses_group(self) -> int:
        """Devices of one Ulysses all-to-all: all of ``context`` (``ulysses``), ``ulysses_size``
        (hybrid); 1 for ring and all-gather."""
        impl = self.cfg.parallel.context_impl
        if self.c == 1 or impl not in ("ulysses", "hybrid"):
            return 1
        return self.c if impl == "ulysses" else self.cfg.parallel.ulysses_size

    @property
    def ring_steps(self) -> int:
        """Devices round the ring: c, or the hybrid's c / ulysses_size groups."""
        return self.c // self.ulysses_group

    @property
    def exchanged_kv_heads(self) -> int:
        """K': a tensor shard's kv heads as exchanged, repeated until they split over the group
        (``ulysses.kv_repeats``); K/t without an exchange."""
        kv, u = self.cfg.model.n_kv_heads // self.t, self.ulysses_group
        return kv * (u // math.gcd(kv, u))

    @property
    def ring_block(self) -> int:
        """Elements of one K (or V) ring block: b x S/c x K/t x D; hybrid: u x S/c tokens of K'/u
        heads."""
        return self.b * self.sl * self.exchanged_kv_heads * self.cfg.model.resolved_head_dim

    @property
    def attention(self) -> str:
        """The step's attention: ``ring``/``allgather``/``hybrid`` over ``context``
        (blockwise kernel), else ``model.attention`` resolved on ``platform`` (``ulysses``:
        on the whole sequence)."""
        if self.c > 1 and self.cfg.parallel.context_impl != "ulysses":
            return self.cfg.parallel.context_impl
        m = self.cfg.model
        return resolve(m.attention, self.platform, self.s, m.attention_block, self.cfg.train.dtype,
                       splash_possible(self.cfg.mesh.pipe, self.cfg.mesh.tensor), model=m)

    @property
    def pieces_attended(self) -> bool:
        """Whether the kernel works on the device's sequence pieces (ring, all-gather, hybrid), not
        the whole sequence (one device, Ulysses)."""
        return self.c > 1 and self.cfg.parallel.context_impl != "ulysses"

    @property
    def flash(self) -> bool:
        """Online softmax with a custom VJP: saves output and log-sum-exp, no score matrix; scores
        recomputed backward."""
        return self.attention != "dense"

    @property
    def block(self) -> int:
        """Queries (and keys) per flash block: ``model.attention_block``, at most one contiguous
        local piece (a zigzag chunk under context parallelism)."""
        piece = (self.sl // (2 if self.cfg.parallel.zigzag else 1) if self.pieces_attended
                 else self.s)
        return min(self.cfg.model.attention_block, piece)

    @property
    def computed_share(self) -> float:
        """Share of the S x S square the busiest device computes: zigzag balances the causal half
        (2c+1 of 4c chunk pairs each); a contiguous split leaves the last device all its blocks; one
        device: n(n+1)/2 of n^2. Sliding-window layers count the blocks the window touches
        (:func:`windowed_share`, averaged over layers)."""
        if self.pieces_attended:
            causal = (2 * self.c + 1) / (4 * self.c) if self.cfg.parallel.zigzag else 1.0
        else:
            n = self.s // self.block
            causal = (n + 1) / (2 * n)
        m = self.cfg.model
        if m.sliding_window is None or m.sliding_window >= self.s:
            return causal
        local = float(np.mean(layer_is_local(m)))
        c = self.c if self.pieces_attended else 1
        order = zigzag_order(self.s, c) if c > 1 and self.cfg.parallel.zigzag else None
        band = windowed_share(self.s, c, self.block, m.sliding_window, order)
        return local * band + (1 - local) * causal

    @property
    def act(self) -> int:
        """A: one residual-stream activation, b x S/c x E in the compute dtype."""
        return self.b * self.sl * self.cfg.model.d_model * self.a

    def tokens_x_embed(self, element_bytes: int) -> int:
        """b x S/c x E elements of ``element_bytes`` (an activation on the wire)."""
        return self.b * self.sl * self.cfg.model.d_model * element_bytes

    # Mixture of experts: per device and micro-step, per MoE layer.

    @property
    def tokens(self) -> int:
        """T: tokens a device routes per micro-step (b rows x S/c)."""
        return self.b * self.sl

    @property
    def moe_exchange(self) -> str | None:
        """How slots cross ``expert``: ``capacity`` (dropping), ``padded`` (dropless on XLA:CPU),
        ``ragged`` (dropless elsewhere), None (no expert axis, or dense)."""
        moe = self.cfg.model.moe
        if not moe.enabled or self.mesh["expert"] == 1:
            return None
        if moe.dispatch == "dropping":
            return "capacity"
        return "padded" if self.xla_cpu else "ragged"

    @property
    def expert_rows(self) -> int:
        """Rows a device's experts compute per MoE layer (= rows per all-to-all): the capacity
        buffer, the padded exchange's worst-case blocks, or the T x k real slots."""
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

    # Pipeline (parallel/pipeline/executor.py): what the executor's schedule adds per microbatch.

    def executed(self, direction: str) -> float:
        """Forward (``"forward"``) or backward chunk runs a stage executes per useful one (masked
        slots included)."""
        if self.pipeline is None:
            return 1.0
        useful = self.pipeline["microbatches"] * self.pipeline["virtual_stages"]
        return self.pipeline[f"{direction}_steps"] / useful

    @property
    def stashes_inputs(self) -> bool:
        """Whether a stage stashes chunk inputs and reruns the chunk backward
        (``parallel.pipeline_stash=inputs``)."""
        return self.pipeline is not None and self.cfg.parallel.pipeline_stash == "inputs"

    def chunk_forwards(self) -> float:
        """Forward runs of each chunk per useful one (masked too);
        ``pipeline_stash=inputs`` adds one per backward slot."""
        return self.executed("forward") + (self.executed("backward") if self.stashes_inputs
                                           else 0.0)

    @property
    def sent(self) -> int:
        """Bytes of one stage-to-stage message: a microbatch's residual-stream shard as it travels
        (split over tensor too under sequence parallelism)."""
        return self.tokens_x_embed(self.wire) // (self.t if self.sp else 1)


@functools.lru_cache(maxsize=1024)
def _schedule(name: str, p: int, m: int, v: int, accum: int, overlap: bool) -> dict:
    """``describe``, cached for ``plan --search`` (docs/plan.md, "Search and verify"). Callers
    get a copy."""
    return describe(name, p, m, v, accum=accum, overlap=overlap)


def step_sizes(cfg: Config, xla_cpu: bool, platform: str = "cpu") -> StepSizes:
    """The sizes of one step of ``cfg`` (validated), for XLA:CPU or an accelerator."""
    mesh = dict(cfg.mesh_shape)
    shards = math.prod(mesh[a] for a in BATCH_AXES)
    t, par = cfg.train, cfg.parallel
    b = t.batch_size // (t.grad_accum * t.microbatches * shards)
    # One schedule over grad_accum x microbatches (the executor folds the micro-steps in).
    pipeline = (dict(_schedule(par.pipeline_schedule, mesh["pipe"], t.microbatches,
                               par.virtual_stages, t.grad_accum, par.pipeline_overlap))
                if mesh["pipe"] > 1 else None)
    return StepSizes(cfg=cfg, b=b, s=t.seq_len, a=DTYPE_BYTES[t.dtype], accum=t.grad_accum,
                     mesh=mesh, sp=par.sequence_parallel and mesh["tensor"] > 1,
                     xla_cpu=xla_cpu, pipeline=pipeline, platform=platform)


def windowed_share(s: int, c: int, block: int, window: int,
                   order: np.ndarray | None = None) -> float:
    """Share of the S x S square the busiest of ``c`` devices computes in a local layer: the
    (query block, key block) pairs of its S/c tokens (in ``order``) the kernels do not skip by
    :func:`~jaxpar.model.mask.block_kind`'s two rules, vectorised."""
    order = np.arange(s) if order is None else np.asarray(order)
    tiles = order.reshape(-1, block)
    first, last = tiles.min(-1), tiles.max(-1)
    skip = (last[:, None] < first[None, :]) | (first[:, None] - window >= last[None, :])
    per_device = (~skip).reshape(c, -1, len(tiles)).sum(axis=(1, 2))
    return float(per_device.max()) / (len(tiles) // c * len(tiles))
