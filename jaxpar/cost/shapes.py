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
    """The sizes every formula of the cost model uses (docs/cost-model.md, "Notation")."""

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
        """Layers this device runs: its stage's share of the stack."""
        return self.cfg.model.n_layers // self.p

    @property
    def moe_layers(self) -> int:
        """MoE layers this device runs: its stage's share of them."""
        return self.cfg.model.n_moe_layers // self.p

    @property
    def runs(self) -> int:
        """How often a device runs its layers forward per step: micro-steps x microbatches."""
        return self.accum * self.m

    @property
    def wire(self) -> int:
        """Bytes per compute-dtype element on the wire: XLA:CPU computes bf16 dots in float32."""
        return PARAM_BYTES if self.xla_cpu else self.a

    @property
    def attention_matmuls(self) -> int:
        """The attention's column-parallel matmuls under tensor parallelism: q+k+v stacked
        (``projection.project_all``), q and k+v with grouped-query attention (their input
        gradients, summed in one VJP, are still reduced one by one on XLA:CPU); q, k and v in
        a pipeline stage, whose prepared weights are not stacked."""
        if self.pipeline is not None:
            return 3
        return 1 if self.cfg.model.n_kv_heads == self.cfg.model.n_heads else 2

    @property
    def mlp_matmuls(self) -> int:
        """The SwiGLU's column-parallel matmuls: gate+up stacked, gate and up in a pipeline."""
        return 2 if self.pipeline is not None else 1

    @property
    def column_matmuls(self) -> int:
        """Matmuls per dense layer reading the gathered input under tensor parallelism."""
        return self.attention_matmuls + self.mlp_matmuls

    @property
    def column_parallel_reductions(self) -> int:
        """Backward input-gradient reductions per layer over tensor: one per column matmul on
        XLA:CPU; the TPU compiler sums separate ones before reducing."""
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
        """Pieces of the sequence the loss (or the pipeline's head) is computed in."""
        return self.cfg.loss_pieces()

    @property
    def embedding_grad_pieces(self) -> int:
        """Slices of the vocabulary the embedding's gradient is built in (a pipeline stage: of its
        piece)."""
        return self.cfg.embedding_grad_pieces()

    @property
    def vocab_rows(self) -> int:
        """The vocabulary as the arrays hold it, padded for the layout (``Config.vocab_rows``):
        what bytes and executed flops count; useful flops count ``model.vocab_size``."""
        return self.cfg.vocab_rows()

    @property
    def ring(self) -> bool:
        """K/V blocks go round a ring over ``context``: ``ring``, and the ``hybrid``'s outer
        ring."""
        return self.c > 1 and self.cfg.parallel.context_impl in ("ring", "hybrid")

    @property
    def ulysses_group(self) -> int:
        """Devices of one Ulysses all-to-all (parallel/ulysses.py): all of ``context`` for
        ``ulysses``, the hybrid's ``ulysses_size``; 1 for the ring and the all-gather."""
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
        """K': a tensor shard's kv heads as the all-to-all exchanges them, repeated until they
        split over its group (``ulysses.kv_repeats``); K/t without one."""
        kv, u = self.cfg.model.n_kv_heads // self.t, self.ulysses_group
        return kv * (u // math.gcd(kv, u))

    @property
    def ring_block(self) -> int:
        """Elements of one K (or V) block going round the ring: b x S/c x K/t x D, or in the
        hybrid, after the all-to-all, u x S/c tokens of K'/u heads."""
        return self.b * self.sl * self.exchanged_kv_heads * self.cfg.model.resolved_head_dim

    @property
    def attention(self) -> str:
        """The attention the step runs: ``ring``/``allgather``/``hybrid`` over ``context`` (on
        the blockwise kernel), else what ``model.attention`` resolves to on ``platform`` (for
        ``ulysses``: on the whole sequence, which its kernel attends)."""
        if self.c > 1 and self.cfg.parallel.context_impl != "ulysses":
            return self.cfg.parallel.context_impl
        m = self.cfg.model
        return resolve(m.attention, self.platform, self.s, m.attention_block, self.cfg.train.dtype,
                       splash_possible(self.cfg.mesh.pipe, self.cfg.mesh.tensor), model=m)

    @property
    def pieces_attended(self) -> bool:
        """Whether the attention kernel works on the device's pieces of the sequence (ring,
        all-gather, hybrid), not the whole sequence (one device, Ulysses)."""
        return self.c > 1 and self.cfg.parallel.context_impl != "ulysses"

    @property
    def flash(self) -> bool:
        """Attention with an online softmax and a custom VJP: it saves the output and the
        log-sum-exp, never a score matrix, and recomputes the scores backward."""
        return self.attention != "dense"

    @property
    def block(self) -> int:
        """Queries (and keys) per block of the flash kernel: ``model.attention_block``, at most
        one contiguous piece of the local sequence (a zigzag chunk under context parallelism)."""
        piece = (self.sl // (2 if self.cfg.parallel.zigzag else 1) if self.pieces_attended
                 else self.s)
        return min(self.cfg.model.attention_block, piece)

    @property
    def computed_share(self) -> float:
        """Share of the S x S square the busiest device's flash kernel computes: the zigzag
        layout balances the causal half (2c+1 of 4c chunk pairs each); a contiguous split
        leaves the last device all of its blocks; on one device, n(n+1)/2 of n^2 blocks. With
        a sliding window, local layers count the blocks the window touches (averaged over the
        layers: :func:`windowed_share`)."""
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

    # Pipeline (parallel/pipeline/executor.py): what the executor's schedule adds per microbatch.

    def executed(self, direction: str) -> float:
        """Forward (``"forward"``) or backward chunk runs a pipeline stage executes per useful
        one: its steps with that slot, masked ones included, over microbatches x chunks."""
        if self.pipeline is None:
            return 1.0
        useful = self.pipeline["microbatches"] * self.pipeline["virtual_stages"]
        return self.pipeline[f"{direction}_steps"] / useful

    @property
    def stashes_inputs(self) -> bool:
        """Whether a stage keeps each chunk's input and runs the chunk again in its backward
        slot (``parallel.pipeline_stash=inputs``, :mod:`jaxpar.parallel.pipeline.recompute`)."""
        return self.pipeline is not None and self.cfg.parallel.pipeline_stash == "inputs"

    def chunk_forwards(self) -> float:
        """Forward runs of each chunk a stage executes per useful one (masked slots too): its
        forward slots', and with ``pipeline_stash=inputs`` one more in every backward slot."""
        return self.executed("forward") + (self.executed("backward") if self.stashes_inputs
                                           else 0.0)

    @property
    def sent(self) -> int:
        """Bytes of one stage-to-stage message: a microbatch's residual stream shard (split
        over tensor too under sequence parallelism), as it travels."""
        return self.tokens_x_embed(self.wire) // (self.t if self.sp else 1)


@functools.lru_cache(maxsize=1024)
def _schedule(name: str, p: int, m: int, v: int, accum: int, overlap: bool) -> dict:
    """``describe``, kept: it simulates the schedule tick by tick (milliseconds) and depends on
    these six values only, and ``plan --search`` asks it for thousands of layouts (half its
    time for llama3-70b on 256 devices). Callers get a copy."""
    return describe(name, p, m, v, accum=accum, overlap=overlap)


def step_sizes(cfg: Config, xla_cpu: bool, platform: str = "cpu") -> StepSizes:
    """The sizes of one step of ``cfg`` (validated), for XLA:CPU's program or an accelerator's."""
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
    (query block, key block) pairs of its S/c tokens (stored in ``order``) against all S that
    the kernels do not skip, by :func:`~jaxpar.model.mask.block_kind`'s two rules (every key
    after every query; every key before every query's window) vectorised over the pairs."""
    order = np.arange(s) if order is None else np.asarray(order)
    tiles = order.reshape(-1, block)
    first, last = tiles.min(-1), tiles.max(-1)
    skip = (last[:, None] < first[None, :]) | (first[:, None] - window >= last[None, :])
    per_device = (~skip).reshape(c, -1, len(tiles)).sum(axis=(1, 2))
    return float(per_device.max()) / (len(tiles) // c * len(tiles))
