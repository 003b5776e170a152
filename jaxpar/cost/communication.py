"""The collectives of one train step, per device: one function per parallelism, as ``parallel/``.

Counts are per step, as :func:`jaxpar.inspect.hlo.collectives.summarize_collectives` counts
them, so the two compare. Each axis's formulas, ``bytes`` against ``wire_bytes``, and the
dtypes: docs/cost-model.md, "Collectives per step".
"""

from __future__ import annotations

import math
from collections.abc import Callable

from jaxpar.config import MESH_AXES, documents_masked
from jaxpar.cost.ledger import EXPOSED, HIDDEN, CollectiveCost, Ledger, ring_hidden
from jaxpar.cost.optimizer import muon_collectives, muon_matrices
from jaxpar.cost.params import PARAM_BYTES, ParamCost, entry_axes
from jaxpar.cost.pipeline import (
    per_layer_fsdp,
    per_layer_fsdp_collectives,
    pipeline_collectives,
)
from jaxpar.cost.shapes import StepSizes
from jaxpar.model.transformer import dense_units, layer_units
from jaxpar.parallel.point_to_point import fsdp_gather_ring
from jaxpar.parallel.zero import ZERO1_AXES

ROW_PARALLEL_MATMULS = 2  # attention output, down projection


def collectives(st: StepSizes, params: list[ParamCost]) -> list[CollectiveCost]:
    """Every collective of one step, per device (docs/cost-model.md,
    "Collectives per step")."""
    ledger = Ledger(st, params)
    for parallelism in (fsdp_collectives, data_collectives, context_collectives,
                        expert_collectives, tensor_collectives, pipeline_collectives,
                        rerun_collectives, muon_collectives):
        parallelism(ledger)
    return ledger.out


def fsdp_collectives(c: Ledger) -> None:
    """ZeRO-3 / FSDP: weights gathered where used, gradients reduce-scattered to their shards,
    over ``fsdp`` (and ``expert`` outside the routed experts: ``ParamCost.gather_axes``)."""
    st, cfg = c.st, c.st.cfg
    if cfg.parallel.zero != 3 or not any(p.gather_axes for p in c.params):
        return
    layer = [p for p in c.layer if p.gather_axes]
    dense = [p for p in c.dense if p.gather_axes]
    other = [p for p in c.other if p.gather_axes and p not in dense]
    if "fsdp" in c.by_hand or st.pipeline is not None:
        # By hand, the executor gathers a stage's weights once per step; else a stage's weights
        # do not change within a stretch of rounds and XLA hoists their gathers out of the
        # stretch's loop (an upper bound: how many survive is its choice).
        # One gather per stacked weight (all the stage's layers at once) each time.
        # A pipeline's dense first blocks run before it, on the whole batch at once, gathered
        # layer by layer as without a pipeline (below), once per step.
        pre_runs = 1
        runs = 1 if "fsdp" in c.by_hand else len(st.pipeline["stretches"])
        if per_layer_fsdp(st):  # parallel.pipeline_fsdp=per_layer: in every slot, by layer
            per_layer_fsdp_collectives(c, layer)
        else:
            for axes, group in _by_gather_axes(layer):
                c.add("all-gather", axes, runs * len(group),
                      runs * sum(c.moved(p, p.gathered_bytes) for p in group),
                      "stage weights gathered once, kept for every microbatch", HIDDEN)
    else:
        pre_runs = st.runs
        _layer_gathers(c, layer)
    # DeepSeek's dense first blocks are a scanned stack of their own (no pipeline splits
    # it): each layer gathered before use and again for its backward pass, like `layers`
    # (docs/cost-model.md).
    _gathers(c, dense, 2 * pre_runs * dense_units(cfg.model), 2 * pre_runs,
             "dense first blocks' weights gathered before use, and again backward",
             lambda axes: _gather_ring(c, axes))
    # Outside the layer loops nothing runs beside them: the gathers before the first layer,
    # the head's gradient reduction after the last (synchronous on the TPU compiler).
    _gathers(c, other, 1, 1, "embedding, lm_head and final norm gathered once per step",
             lambda axes: EXPOSED, outside_loops=True)
    _gradient_scatters(c, layer, dense, other)


def _by_gather_axes(group: list[ParamCost]) -> list[tuple[tuple[str, ...], list[ParamCost]]]:
    """``group`` by the axes each parameter is gathered over (the routed experts over
    ``fsdp``, the rest over ``fsdp x expert``)."""
    out: dict[tuple[str, ...], list[ParamCost]] = {}
    for p in group:
        out.setdefault(p.gather_axes, []).append(p)
    return sorted(out.items())


def _ring(c: Ledger, axes: tuple[str, ...]) -> float:
    """The hidden share of a collective matmul's ring over ``axes``."""
    return ring_hidden(math.prod(c.st.mesh[a] for a in axes))


def _gather_ring(c: Ledger, axes: tuple[str, ...]) -> float:
    """In the layer loops each gather is a collective matmul, hidden but for its ring's last
    step; not those of weights split over tensor too (docs/cost-model.md, "Time on a hardware
    profile")."""
    return _ring(c, axes) if c.st.mesh["tensor"] == 1 else EXPOSED


def _layer_gathers(c: Ledger, layer: list[ParamCost]) -> None:
    """Outside a pipeline: each layer's weights gathered forward and again backward
    (docs/cost-model.md, "fsdp"). The experts' gathers sit inside their shard_map, which no
    collective matmul decomposes: synchronous."""
    st = c.st
    kept = [p for p in layer if not p.resharded]
    runs = c.forwards * st.runs
    passes = 1 + _rematted(st)
    _gathers(c, kept, passes * runs * st.layers, passes * runs,
             "MoE weights gathered, kept for the backward (gathered again where remat "
             "recomputes the layer)", lambda axes: EXPOSED)
    _gathers(c, [p for p in layer if p not in kept], 2 * runs * st.layers, 2 * runs,
             "layer weights gathered before use, and again backward",
             lambda axes: _gather_ring(c, axes))


# The share of the ring sends (parallel.fsdp_gather=ring) the TPU compiler schedules beside a
# matmul (docs/performance.md). The experts': two of each weight's three steps at fsdp=4,
# gathers and reduce-scatters alike (Mixtral widths, fsdp=4 expert=8; the gathers' windows
# hold little work, the reduce-scatters' much). The weights split over tensor too: one in
# seven (Llama-3-70B widths, fsdp=16 tensor=4 with sequence parallelism).
EXPERT_GATHER_RING_HIDDEN = EXPERT_SCATTER_RING_HIDDEN = 2 / 3
TENSOR_SPLIT_RING_HIDDEN = 1 / 7


def _in_ring(c: Ledger, p: ParamCost) -> bool:
    """Whether ``p`` is gathered in a ring of sends: the routed experts' weights, and the
    weights the projections gather (parallel/rules.py: activation_constrainer) that tensor
    splits too, under parallel.fsdp_gather=ring."""
    st = c.st
    if not fsdp_gather_ring(st.cfg, st.platform):
        return False
    split = {a for entry in p.spec for a in entry_axes(entry)}
    # DeepSeek's dense first blocks go through the same projections as the layers.
    projected = p.projected or (p.dense_stack and p.matmul and not p.name.endswith("_bias"))
    return p.expert or (projected and "tensor" in split and st.mesh["tensor"] > 1)


def _gathers(c: Ledger, group: list[ParamCost], count_each: float, times: float, what: str,
             hidden: Callable[[tuple[str, ...]], float], outside_loops: bool = False) -> None:
    """``group``'s gathers: ``count_each`` per parameter and step, ``times`` its gathered bytes;
    an all-gather hidden by ``hidden(axes)``, or a ring of sends (:func:`_in_ring`)."""
    for axes, part in _by_gather_axes(group):
        plain = [p for p in part if not _in_ring(c, p)]
        experts = [p for p in part if p not in plain and p.expert]
        tensor_split = [p for p in part if p not in plain and not p.expert]
        for members, share in ((experts, EXPERT_GATHER_RING_HIDDEN),
                               (tensor_split, TENSOR_SPLIT_RING_HIDDEN)):
            if members:
                _add_ring(c, axes, count_each * len(members),
                          times * sum(c.moved(p, p.gathered_bytes) for p in members),
                          what + ", in a ring of sends", EXPOSED if outside_loops else share)
        if plain:
            c.add("all-gather", axes, round(count_each * len(plain)),
                  round(times * sum(c.moved(p, p.gathered_bytes) for p in plain)), what,
                  hidden(axes))


def _add_ring(c: Ledger, axes: tuple[str, ...], count: float, payload: float, what: str,
              hidden: float) -> None:
    """``count`` gathers (reduce-scatters) of ``payload`` bytes in all as rings of sends over
    ``axes``: n - 1 sends each, 1/n of the payload each (parallel/point_to_point.py)."""
    n = math.prod(c.st.mesh[a] for a in axes)
    c.add("collective-permute", axes, round(count * (n - 1)), round(payload * (n - 1) / n),
          what, hidden)


def _gradient_scatters(c: Ledger, layer: list[ParamCost], dense: list[ParamCost],
                       other: list[ParamCost]) -> None:
    """Gradients reduce-scattered to their shards, every micro-step; the embedding's is a
    collective matmul like the layers', lm_head's and the experts' are synchronous."""
    st = c.st
    stacks = ([] if per_layer_fsdp(st) else layer) + dense
    experts = [p for p in stacks if p.expert]
    stacks = [p for p in stacks if not p.expert]
    embedding = [p for p in other if p.name == "embedding"]
    rest = [p for p in other if p not in embedding]
    for group, count, ring in ((stacks, st.layers, True), (experts, st.layers, False),
                               (embedding, 1, True), (rest, 1, False)):
        for axes, part in _by_gather_axes(group):
            runs = count * c.runs_over(axes)
            payload = c.reduced([p for p in part if p.trained], gathered=True,
                                by_hand="fsdp" in c.by_hand)
            what = "gradients reduce-scattered to their shards, every micro-step"
            if group is experts and all(_in_ring(c, p) for p in part):
                _add_ring(c, axes, runs, payload, what + ", in a ring of sends",
                          EXPERT_SCATTER_RING_HIDDEN)
                continue
            c.add("reduce-scatter", axes, runs, payload, what, _ring(c, axes) if ring else EXPOSED)


def data_collectives(c: Ledger) -> None:
    """Data (and context, and expert outside the experts) parallelism: gradients summed over
    the replicas, every micro-step; then ZeRO-1's gather of the updated parameters."""
    st, cfg = c.st, c.st.cfg
    # Parameters are replicated over data, expert and context (and fsdp under ZeRO-1), except
    # the routed experts' weights, which are split over expert: one all-reduce per set of axes
    # sums the gradient shards.
    replicas = (("data", "expert", "context") if cfg.parallel.zero == 3 else
                (*ZERO1_AXES, "expert", "context"))
    by_replicas: dict[tuple[str, ...], list[ParamCost]] = {}
    # A pipeline's dense first blocks run before it with the embedding, on rows split over pipe
    # too: their gradients (the embedding's with the stages' pieces) summed in one.
    pre_phase: list[ParamCost] = []
    for p in c.params:
        if not p.trained:  # a LoRA run's frozen base weights: no gradient to sum
            continue
        split = {a for entry in p.spec for a in entry_axes(entry)}
        if c.dense and st.pipeline is not None and (p.dense_stack or p.name == "embedding"):
            pre_phase.append(p)
            continue
        by_replicas.setdefault(tuple(a for a in replicas if a not in split), []).append(p)
    if pre_phase:
        axes = tuple(a for a in MESH_AXES if a in (*replicas, "pipe"))
        c.add("all-reduce", axes, 1, c.reduced(pre_phase, by_hand=True),
              "embedding and dense first blocks' gradients (before the pipeline) all-reduced, "
              "once per step",
              HIDDEN)
    units = layer_units(cfg.model) // st.p  # a stage's units of the `layers` stack
    for axes, group in by_replicas.items():
        experts = "routed experts' " if all(p.expert for p in group) else ""
        count = c.runs_over(axes) * (units * any(p.stacked for p in group)
                                     + any(not p.stacked for p in group))
        by_hand = c.summed_by_hand(axes)
        payload = c.reduced(group, by_hand=by_hand)
        every = "micro-step" if st.pipeline is None or by_hand else "backward slot"
        scattered = zero1_scatter_axes(c, axes, group)
        if scattered:
            c.add("reduce-scatter", scattered, count, payload,
                  f"ZeRO-1: {experts}gradients reduce-scattered to the moments' slices, every "
                  + every, HIDDEN)
            axes = tuple(a for a in axes if a not in scattered)
        # The partitioner's sums over expert are synchronous on the TPU compiler (Mixtral
        # widths, fsdp=4 expert=8: docs/performance.md); the others are assumed hidden.
        c.add("all-reduce", axes, count, payload,
              f"{experts}gradient shards all-reduced, every {every}",
              EXPOSED if "expert" in axes and st.mesh["expert"] > 1 and not by_hand
              else HIDDEN)
    if cfg.parallel.zero == 1:
        # Muon's matrices are updated whole on every device (their momentum gathered for the
        # iterations, muon_collectives): nothing of theirs to gather afterwards.
        whole = {m.name for m in muon_matrices(cfg, c.params)}
        updated = [p for p in c.params if p.trained and p.name not in whole]
        c.add("all-gather", ZERO1_AXES, len(updated),
              sum(p.bytes_per_device for p in updated),
              "ZeRO-1: updated parameters gathered from the optimizer shards", EXPOSED)


def zero1_scatter_axes(c: Ledger, axes: tuple[str, ...], group: list[ParamCost]
                       ) -> tuple[str, ...]:
    """The axes over which ZeRO-1 reduce-scatters ``group``'s gradients; the rest of ``axes``
    (context, expert) stays an all-reduce."""
    if c.st.cfg.parallel.zero != 1 or c.st.pipeline is not None:
        return ()
    if not all(p.moment_bytes_per_device < p.bytes_per_device for p in group):
        return ()
    return tuple(a for a in ZERO1_AXES if a in axes and c.st.mesh[a] > 1)


def context_collectives(c: Ledger) -> None:
    """Context parallelism (``parallel/context.py``, ``parallel/ulysses.py``): attention's
    keys and values."""
    st = c.st
    per_layer = st.layers * st.runs
    if st.ulysses_group > 1:
        _ulysses_collectives(c)
    if st.ring:
        n, blk = st.ring_steps, st.ring_block
        # (In a pipeline stage: every slot that runs, masked ones too.)
        fw, bw = per_layer * c.forwards, per_layer * c.backwards
        c.add("collective-permute", ("context",), round(fw * 2 * (n - 1)),
              round(fw * 2 * (n - 1) * blk * st.wire), "ring attention: K, V blocks forward",
              HIDDEN)
        c.add("collective-permute", ("context",), round(bw * 2 * (n - 1)),
              round(bw * 2 * (n - 1) * blk * st.wire), "ring attention: K, V blocks backward",
              HIDDEN)
        c.add("collective-permute", ("context",), round(bw * 2 * n),
              round(bw * 2 * ((n - 1) * blk * 4 + blk * st.wire)),
              "ring attention: dK, dV travelling home backward (float32, the last hop cast)",
              HIDDEN)
    elif st.c > 1 and st.ulysses_group == 1:  # allgather: K and V gathered whole, their
        # gradients reduce-scattered
        gathered, fw, bw = st.kv_block * st.c * st.wire, c.forwards, c.backwards
        # remat (dots or full) recomputes attention in the backward pass, the gathers with it
        fw += bw * _rematted(st)
        c.add("all-gather", ("context",), round(2 * per_layer * fw),
              round(2 * per_layer * fw * gathered),
              "context allgather attention: K, V of the whole sequence (forward, and again "
              "where remat recomputes attention)", EXPOSED)
        c.add("reduce-scatter", ("context",), 2 * per_layer * bw,
              2 * per_layer * bw * st.kv_block * st.c * 4,
              "context allgather attention: dK, dV backward (float32)", EXPOSED)


def _ulysses_collectives(c: Ledger) -> None:
    """Ulysses' all-to-alls in groups of u (docs/cost-model.md, "context")."""
    st = c.st
    u, d = st.ulysses_group, st.cfg.model.resolved_head_dim
    heads = 2 * (st.cfg.model.n_heads // st.t) + 2 * st.exchanged_kv_heads
    per_pass = st.b * st.sl * heads * d * st.wire  # the four all-to-alls of one pass
    fw = c.forwards + c.backwards * _rematted(st)
    per_layer = st.layers * st.runs
    c.add("all-to-all", ("context",), round(4 * per_layer * (fw + c.backwards)),
          round(per_layer * (fw + c.backwards) * per_pass),
          f"Ulysses attention: q, k, v to the head split and the output back, in groups of {u} "
          "(forward, backward, and forward again where remat recomputes attention)", EXPOSED,
          group=u)
    leaves = 1 + documents_masked(st.cfg) + (st.cfg.model.sliding_window is not None)
    count = round(leaves * st.runs * c.forwards)
    c.add("all-gather", ("context",), count, count * st.b * st.sl * u * 4,
          "Ulysses attention: the masks' int32 order (documents, windows) of the group", EXPOSED,
          group=u)


def expert_collectives(c: Ledger) -> None:
    """Expert parallelism (``parallel/expert.py``): each MoE layer's slots travel to their
    experts' devices and back (dispatch, combine), and again in the backward pass; remat
    recomputes the forward pair."""
    st, cfg = c.st, c.st.cfg
    if st.moe_exchange is None:
        return
    moe = cfg.model.moe
    rows = st.expert_rows
    payload = rows * cfg.model.d_model * st.wire
    kind = "ragged-all-to-all" if st.moe_exchange == "ragged" else "all-to-all"
    again = _rematted(st)  # remat redoes the forward pair in the backward pass
    # Per step: the stage's MoE layers x microbatches, x the slots they run in (pipeline).
    forward = round(st.moe_layers * st.runs * (2 * c.forwards + 2 * again * c.backwards))
    backward = round(st.moe_layers * st.runs * 2 * c.backwards)
    real = {"capacity": f"capacity buffer of {rows} rows per layer",
            "padded": f"worst-case blocks, {rows} rows per layer, "
                      f"{st.tokens * moe.top_k} of them tokens",
            "ragged": f"{rows} token rows per layer"}[st.moe_exchange]
    c.add(kind, ("expert",), forward, forward * payload,
          f"MoE dispatch + combine forward{', again in remat' if again else ''} "
          f"({real})", EXPOSED)
    c.add(kind, ("expert",), backward, backward * payload,
          "MoE dispatch + combine backward", EXPOSED)
    if st.moe_exchange == "padded":  # each row's int32 expert id travels with it
        ids = forward // 2
        c.add("all-to-all", ("expert",), ids, ids * rows * 4,
              "MoE expert ids of the padded rows (forward)", EXPOSED)


def _tensor_counts(c: Ledger) -> tuple[int, int, int]:
    """Per step, over all layers: tensor's reductions (docs/cost-model.md, "tensor without").
    A pipeline's embedding and head runs are divided here by the forward multiplicity, which
    ``add_act`` multiplies back."""
    st, m = c.st, c.st.cfg.model
    n_layers, n_moe = st.layers, st.moe_layers
    shared = 1 if m.moe.num_shared_experts else 0
    rows_per_layer = _row_outputs(st)
    moe_column = (st.attention_matmuls + 1 + shared * st.mlp_matmuls if st.xla_cpu
                  else 1 + 1 + shared)
    columns = (n_layers - n_moe) * st.column_parallel_reductions + n_moe * moe_column
    # Recomputing a layer (remat=full) reduces attention's output again, and with
    # model.post_norms the MLP's (or the MoE layer's) too: its post-norm's backward pass reads
    # it. Without post-norms nothing in the backward pass reads the MLP's output.
    again = _attention_again(st)
    mlp_again = (rows_per_layer - n_layers) * (again and m.post_norms)
    row_outputs = round(st.runs * (rows_per_layer + n_layers * again + mlp_again))
    if st.pipeline is None:
        return row_outputs, st.runs * columns, st.runs, st.runs
    embeds, heads = (round(st.pipeline[k] / st.executed("forward"))
                     for k in ("embed_steps", "head_steps"))
    return row_outputs, st.runs * columns, embeds, heads


def _row_outputs(st: StepSizes) -> int:
    """Row-parallel outputs a forward of the stage's layers reduces over ``tensor``, one
    microbatch: attention's and the MLP's (a MoE layer: the experts' summed outputs and the
    shared experts')."""
    shared = 1 if st.cfg.model.moe.num_shared_experts else 0
    return ((st.layers - st.moe_layers) * ROW_PARALLEL_MATMULS
            + st.moe_layers * (2 + shared))


def _input_gathers(st: StepSizes) -> int:
    """Megatron-SP's input gathers in a forward of the stage's layers, one microbatch: one per
    input, whatever the matmuls reading it."""
    shared = 1 if st.cfg.model.moe.num_shared_experts else 0
    return (st.layers - st.moe_layers) * 2 + st.moe_layers * (1 + shared)


def rerun_collectives(c: Ledger) -> None:
    """``parallel.pipeline_stash=inputs``: the stage layers' forward collectives once more per
    backward slot (docs/pipelines.md, "Each chunk's input alone")."""
    st = c.st
    if not st.stashes_inputs:
        return
    again = c.backwards  # per useful run of the chunk
    what = " again, the chunk's forward in each backward slot (pipeline_stash=inputs)"
    if st.t > 1:
        act, rows = st.tokens_x_embed(st.wire), round(st.runs * _row_outputs(st) * again)
        if st.sp:
            gathers = round(st.runs * _input_gathers(st) * again)
            c.add("all-gather", ("tensor",), gathers, gathers * act,
                  "sequence gathered entering attention/MLP" + what, EXPOSED)
        c.add("reduce-scatter" if st.sp else "all-reduce", ("tensor",), rows, rows * act,
              "row-parallel outputs" + what, EXPOSED)
    per_layer = st.layers * st.runs * again
    if st.ulysses_group > 1:
        heads = 2 * (st.cfg.model.n_heads // st.t) + 2 * st.exchanged_kv_heads
        count = round(4 * per_layer)
        c.add("all-to-all", ("context",), count, round(per_layer * st.b * st.sl * heads
                                                       * st.cfg.model.resolved_head_dim
                                                       * st.wire),
              "Ulysses attention: q, k, v, output" + what, EXPOSED, group=st.ulysses_group)
    if st.ring:
        hops = round(per_layer * 2 * (st.ring_steps - 1))
        c.add("collective-permute", ("context",), hops, hops * st.ring_block * st.wire,
              "ring attention: K, V blocks" + what, HIDDEN)
    elif st.c > 1 and st.ulysses_group == 1:
        count = round(2 * per_layer)
        c.add("all-gather", ("context",), count, count * st.kv_block * st.c * st.wire,
              "context allgather attention: K, V" + what, EXPOSED)
    if st.moe_exchange is not None:
        count = round(st.moe_layers * st.runs * 2 * again)
        payload = st.expert_rows * st.cfg.model.d_model * st.wire
        c.add("ragged-all-to-all" if st.moe_exchange == "ragged" else "all-to-all",
              ("expert",), count, count * payload, "MoE dispatch + combine" + what, HIDDEN)


def _rematted(st: StepSizes) -> float:
    """The share of the layers a remat policy recomputes: one in ``train.remat_every``."""
    return 0.0 if st.cfg.train.remat == "none" else 1 / st.cfg.train.remat_every


def _attention_again(st: StepSizes) -> float:
    """The share of the layers whose backward pass recomputes attention's output, and so
    reduces it again: remat=full, and remat=dots (or offload_dots) in a pipeline stage, whose
    matmuls' custom VJP the dots policy does not save."""
    remat = st.cfg.train.remat
    again = remat == "full" or (remat in ("dots", "offload_dots") and st.pipeline is not None)
    return _rematted(st) if again else 0.0


def _input_regathers(c: Ledger) -> int:
    """Megatron-SP's input all-gathers again in the backward pass, per step (docs/cost-model.md,
    "tensor with sequence parallelism")."""
    st = c.st
    rematted = 2 * st.layers * st.runs
    if st.cfg.train.remat == "attention":
        # The MLP's recomputation gathers its input, and its weight gradients' backward rule
        # gathers it again (not merged: Llama-3-8B widths, fsdp=8 tensor=8 with SP: 3 a layer).
        rematted += (st.layers - st.moe_layers) * st.runs
    # One gather per input, whatever the matmuls reading it (they share its kept slice); a MoE
    # layer's experts read their own token copies.
    kept = 0 if st.pipeline is not None else _input_gathers(st) * st.runs
    share = _rematted(st)
    return round(share * rematted + (1 - share) * kept)


def tensor_collectives(c: Ledger) -> None:
    """Tensor (and sequence) parallelism: activations, blocking but for sequence parallelism's
    reduce-scatters. lm_head's input gradient is float32 (the logits are); everything else
    moves in the compute dtype."""
    st, cfg = c.st, c.st.cfg
    if st.t == 1:
        return
    act, head_grad = st.tokens_x_embed(st.wire), st.tokens_x_embed(4)
    remat, n_layers = cfg.train.remat, st.layers
    row_outputs, column_grads, embeds, heads = _tensor_counts(c)
    regathers = _input_regathers(c)
    per_layer = n_layers * st.runs  # activation traffic: per microbatch
    columns = {2: "q+k+v, gate+up", 3: "q, k+v, gate+up", 5: "q, k, v, gate, up"}[
        st.column_parallel_reductions]
    fw, bw = c.forwards, c.backwards

    def add_act(kind: str, count: int, what: str, payload: int = act, times: int = 1,
                hidden: float = EXPOSED) -> None:
        """``times``: the forward (fw) or backward (bw) multiplicity under a pipeline."""
        count = round(count * times)
        c.add(kind, ("tensor",), count, count * payload, what, hidden)

    # Sequence parallelism's reduce-scatters of the layers' matmul outputs (the row-parallel
    # outputs forward, the column-parallel input gradients backward) are collective matmuls
    # on the TPU compiler (jaxpar.mesh.SP_TPU_COMPILER_OPTIONS); its gathers stay synchronous.
    ring = ring_hidden(st.t)

    if not st.sp:
        add_act("all-reduce", row_outputs, "row-parallel outputs (attention, MLP) forward"
                + (", attention again in remat" if _attention_again(st) else "")
                + (" (and the MLP: post-norms)" if _attention_again(st) and cfg.model.post_norms
                   else ""), times=fw)
        add_act("all-reduce", column_grads,
                f"column-parallel input gradients backward ({columns})", times=bw)
        add_act("all-reduce", embeds, "vocab-parallel embedding forward", times=fw)
        add_act("all-reduce", heads, "lm_head input gradient backward", payload=head_grad,
                times=bw)
    else:
        add_act("all-gather", per_layer * 4 + regathers,
                "sequence gathered entering attention/MLP (forward; output gradients "
                "backward; inputs again for the weight gradients"
                + (" in remat" if remat != "none" else "") + ")", times=fw)
        add_act("reduce-scatter", row_outputs,
                "sequence scattered leaving attention/MLP forward", times=fw, hidden=ring)
        add_act("reduce-scatter", column_grads,
                f"column-parallel input gradients backward ({columns})", times=bw,
                hidden=ring)
        add_act("all-gather", heads + embeds,
                "lm_head input forward, embedding output gradient backward", times=fw)
        add_act("reduce-scatter", embeds, "vocab-parallel embedding forward", times=fw)
        add_act("reduce-scatter", heads, "lm_head input gradient backward", payload=head_grad,
                times=bw)
        c.add("all-reduce", ("tensor",), (n_layers + 1) * c.grad_runs,
              c.grad_runs * (2 * n_layers + 1) * cfg.model.d_model * PARAM_BYTES,
              "norm-scale gradients of the sequence shards", EXPOSED)
    add_act("all-reduce", 2 * heads, "vocab-parallel loss: max and sum of exponentials",
            payload=st.b * st.sl * 4, times=fw)
