"""The analytic cost model and ``jaxpar plan`` against compiled steps (the hand-checked numbers
are in ``tests/unit/test_cost_model.py``).

The compiled checks build each layout's train step once (module-level cache) on the 8 virtual CPU
devices of conftest.py and compare, per (kind, mesh axes), the per-step collective bytes of the
optimized HLO with :func:`jaxpar.cost.estimate.estimate`, and the step's argument bytes with the
predicted parameter + optimizer state. Collective rows smaller than ``SMALL`` of the step's total
collective bytes are scalars (loss, token counts, gradient-norm partial sums) and norm-scale
gradients; the model leaves them out or only approximates them, so both sides drop them.
"""

from __future__ import annotations

import functools

import pytest
from helpers import tiny_8x32 as tiny

from jaxpar.cost.estimate import estimate

DEVICES = 8
# tiny with 8 experts (top-2, 64 hidden units) in every second of 4 blocks
MOE = ["model.n_layers=4", "model.moe.num_experts=8", "model.moe.top_k=2", "model.moe.every=2",
       "model.moe.d_ff_expert=64"]
SMALL = 0.01  # collective rows under 1% of a step's collective bytes are ignored
COLLECTIVE_TOLERANCE = 0.10
STATE_TOLERANCE = 0.05

# The acceptance layouts (and ZeRO-1, for its optimizer split and final parameter gather), with
# the (kind, axes) rows their compiled step must have.
LAYOUTS = {
    "data=8": (["mesh.data=8"], {("all-reduce", ("data",))}),
    "fsdp=8": (["mesh.data=1", "mesh.fsdp=8"],
               {("all-gather", ("fsdp",)), ("reduce-scatter", ("fsdp",))}),
    # A tied embedding's gradient is reduced twice: the head's in the loss's backward pass, the
    # lookup's at its end (cost/ledger.py: Ledger.reduced).
    "fsdp=8,tied": (["mesh.data=1", "mesh.fsdp=8", "model.tie_embeddings=true"],
                    {("all-gather", ("fsdp",)), ("reduce-scatter", ("fsdp",))}),
    # bf16 parameters: gathered after the cast to the float32 compute dtype, reduced in float32.
    "fsdp=8,param_dtype=bf16": (["mesh.data=1", "mesh.fsdp=8", "train.param_dtype=bfloat16"],
                                {("all-gather", ("fsdp",)), ("reduce-scatter", ("fsdp",))}),
    "data=2,tensor=4": (["mesh.data=2", "mesh.tensor=4"],
                        {("all-reduce", ("data",)), ("all-reduce", ("tensor",))}),
    # ZeRO-3 under tensor parallelism: the stacked q/k/v and gate/up weights are gathered for
    # the forward pass and again for the backward one, like every other weight.
    "data=2,fsdp=2,tensor=2": (["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"],
                               {("all-gather", ("fsdp",)), ("reduce-scatter", ("fsdp",)),
                                ("all-reduce", ("data",)), ("all-reduce", ("tensor",))}),
    # parallel.fsdp_gather=ring: the weights split over tensor too gathered in rings of sends
    # over fsdp (the norm scales, lm_head and the gradients as before).
    "fsdp=4,tensor=2,ring": (["mesh.data=1", "mesh.fsdp=4", "mesh.tensor=2",
                              "parallel.fsdp_gather=ring"],
                             {("all-gather", ("fsdp",)), ("reduce-scatter", ("fsdp",)),
                              ("collective-permute", ("fsdp",)), ("all-reduce", ("tensor",))}),
    # ... and the routed experts' weights over fsdp, the others over fsdp x expert.
    "moe,fsdp=2,expert=2,tensor=2,ring": (
        [*MOE, "mesh.data=1", "mesh.fsdp=2", "mesh.expert=2", "mesh.tensor=2",
         "parallel.fsdp_gather=ring"],
        {("all-gather", ("fsdp", "expert")), ("reduce-scatter", ("fsdp", "expert")),
         ("collective-permute", ("fsdp",)), ("collective-permute", ("fsdp", "expert")),
         ("all-to-all", ("expert",)), ("all-reduce", ("tensor",))}),
    # Gemma's block (post-norms, GeGLU, q/k norms, scaled embeddings and queries, capped
    # logits): nothing more to gather or reduce than the norm scales.
    "data=2,fsdp=2,tensor=2,gemma": (
        ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "model.post_norms=true",
         "model.embed_scale=true", "model.mlp_activation=gelu_tanh", "model.qk_norm=true",
         "model.query_scale=8", "model.final_softcap=30"],
        {("all-gather", ("fsdp",)), ("reduce-scatter", ("fsdp",)),
         ("all-reduce", ("data",)), ("all-reduce", ("tensor",))}),
    # Muon's owner-computes: each stacked matrix's pieces go to the device of the fsdp x tensor
    # group that iterates on its layer, and the results' pieces back (two all-to-alls). (Before,
    # the partitioner's reshards of the iterations added 2.9 MiB the plan lacked.)
    "data=2,fsdp=2,tensor=2,muon": (["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2",
                                     "train.optimizer=muon"],
                                    {("all-gather", ("fsdp",)), ("reduce-scatter", ("fsdp",)),
                                     ("all-reduce", ("data",)), ("all-reduce", ("tensor",)),
                                     ("all-to-all", ("fsdp", "tensor"))}),
    # ... and on the routed experts, exchanged within the expert shard that holds them (optax's
    # flattening of [layers, experts] into one axis gathered all experts over expert).
    "moe,data=2,expert=2,tensor=2,muon": (
        [*MOE, "mesh.data=2", "mesh.expert=2", "mesh.tensor=2", "train.optimizer=muon"],
        # The dense weights split over expert (ZeRO-3 over expert): gathered and reduce-scattered
        # over it, and Muon's momentum of the matrices split over expert and tensor
        # exchanged over both.
        {("all-to-all", ("tensor",)), ("all-reduce", ("data",)), ("all-gather", ("expert",)),
         ("reduce-scatter", ("expert",)), ("all-reduce", ("tensor",)),
         ("all-to-all", ("expert",)), ("all-to-all", ("expert", "tensor"))}),
    "data=4,tensor=2,sp": (["mesh.data=4", "mesh.tensor=2", "parallel.sequence_parallel=true"],
                           {("all-reduce", ("data",)), ("all-gather", ("tensor",)),
                            ("reduce-scatter", ("tensor",))}),
    "data=4,fsdp=2,zero=1": (["mesh.data=4", "mesh.fsdp=2", "parallel.zero=1"],
                             {("reduce-scatter", ("data", "fsdp")),
                              ("all-gather", ("data", "fsdp"))}),
    # ZeRO-1 beside context (the gradient's sum over context stays an all-reduce) and with the
    # micro-steps' by-hand sum over data (its psum and slice become a reduce-scatter too).
    "data=2,context=2,tensor=2,zero=1": (
        ["mesh.data=2", "mesh.context=2", "mesh.tensor=2", "parallel.zero=1"],
        {("reduce-scatter", ("data",)), ("all-reduce", ("context",)),
         ("all-gather", ("data",)), ("all-reduce", ("tensor",)),
         ("collective-permute", ("context",))}),
    "data=8,grad_accum=2,zero=1": (["mesh.data=8", "train.grad_accum=2", "train.batch_size=16",
                                    "parallel.zero=1"],
                                   {("reduce-scatter", ("data",)), ("all-gather", ("data",))}),
    # FSDP x ring attention x tensor with SP, remat=dots (the dense demo). (No data axis:
    # XLA:CPU sometimes splits a data x context gradient all-reduce in two.)
    "fsdp=2,context=2,tensor=2,sp,dots": (
        ["mesh.data=1", "mesh.fsdp=2", "mesh.context=2", "mesh.tensor=2",
         "parallel.sequence_parallel=true", "train.remat=dots"],
        {("all-gather", ("fsdp",)), ("reduce-scatter", ("fsdp",)), ("all-reduce", ("context",)),
         ("collective-permute", ("context",)), ("all-gather", ("tensor",)),
         ("reduce-scatter", ("tensor",))}),
    # Ulysses (heads over tensor and context, forward all-to-alls again under remat=dots) and
    # the 4 x 2 hybrid: all-to-alls in groups of 4, the ring over the 2 groups (measured: every
    # row 1.00 of the plan but the hybrid's permutes, 0.97: the masks' int32 hops).
    "context=4,tensor=2,ulysses,dots": (
        ["mesh.data=1", "mesh.context=4", "mesh.tensor=2", "parallel.context_impl=ulysses",
         "train.remat=dots"],
        {("all-reduce", ("context",)), ("all-reduce", ("tensor",)), ("all-to-all", ("context",))}),
    "context=8,hybrid=4x2": (
        ["mesh.data=1", "mesh.context=8", "parallel.context_impl=hybrid",
         "parallel.ulysses_size=4"],
        {("all-reduce", ("context",)), ("all-to-all", ("context",)),
         ("collective-permute", ("context",))}),
    # Pipelines: the sends of every tick, the shared gradients' sum over stages, and the other
    # axes' collectives repeated per microbatch and recomputation inside the stages.
    "pipe=2,tensor=2,data=2,1f1b": (
        ["mesh.pipe=2", "mesh.tensor=2", "mesh.data=2", "train.microbatches=4",
         "parallel.pipeline_schedule=1f1b"],
        {("collective-permute", ("pipe",)), ("all-reduce", ("pipe",)),
         ("all-reduce", ("tensor",)), ("all-reduce", ("data",))}),
    # ... with grad_accum=2 folded in: the sends and sums over pipe of one schedule over 8
    # microbatches, not of two over 4 (measured: every row 1.00 of the plan).
    "pipe=2,tensor=2,data=2,1f1b,grad_accum=2": (
        ["mesh.pipe=2", "mesh.tensor=2", "mesh.data=2", "train.microbatches=4",
         "parallel.pipeline_schedule=1f1b", "train.grad_accum=2", "train.batch_size=16"],
        {("collective-permute", ("pipe",)), ("all-reduce", ("pipe",)),
         ("all-reduce", ("tensor",)), ("all-reduce", ("data",))}),
    # LoRA in a pipeline: the frozen embedding and head's pieces are not summed over pipe, nor
    # chunk 0's input gradient for them; only the adapters' gradients over data.
    "lora,pipe=2,tensor=2,data=2,1f1b": (
        ["mesh.pipe=2", "mesh.tensor=2", "mesh.data=2", "train.microbatches=4",
         "parallel.pipeline_schedule=1f1b", "train.lora.rank=4"],
        {("collective-permute", ("pipe",)), ("all-reduce", ("pipe",)),
         ("all-reduce", ("tensor",)), ("all-reduce", ("data",))}),
    "pipe=4,fsdp=2,zero_bubble": (
        ["mesh.pipe=4", "mesh.data=1", "mesh.fsdp=2", "model.n_layers=4",
         "train.microbatches=4", "parallel.pipeline_schedule=zero_bubble"],
        {("collective-permute", ("pipe",)), ("all-reduce", ("pipe",)),
         ("all-gather", ("fsdp",)), ("reduce-scatter", ("fsdp",))}),
    # DualPipe-V: the V's sends go both ways; its head on the first device.
    "pipe=2,data=4,dualpipe_v": (
        ["mesh.pipe=2", "mesh.data=4", "model.n_layers=4", "train.microbatches=4",
         "train.batch_size=16", "parallel.pipeline_schedule=dualpipe_v"],
        {("collective-permute", ("pipe",)), ("all-reduce", ("pipe",)),
         ("all-reduce", ("data",))}),
    "pipe=2,data=4,interleaved": (
        ["mesh.pipe=2", "mesh.data=4", "model.n_layers=4", "train.microbatches=2",
         "parallel.pipeline_schedule=interleaved", "parallel.virtual_stages=2"],
        {("collective-permute", ("pipe",)), ("all-reduce", ("pipe",)),
         ("all-reduce", ("data",))}),
    "pipe=8,gpipe": (["mesh.pipe=8", "mesh.data=1", "model.n_layers=8", "train.microbatches=8"],
                     {("collective-permute", ("pipe",)), ("all-reduce", ("pipe",))}),
    # FSDP (by hand) and tensor with SP inside pipeline stages: the by-hand gathers and
    # reduce-scatters work on weights whole over tensor, and the pipe all-reduces keep SP's split.
    # (Two layers per stage: the stacked weights are gathered once for both.)
    "pipe=2,fsdp=2,tensor=2,sp": (
        ["mesh.pipe=2", "mesh.data=1", "mesh.fsdp=2", "mesh.tensor=2", "model.n_layers=4",
         "parallel.sequence_parallel=true", "train.microbatches=4"],
        {("collective-permute", ("pipe",)), ("all-reduce", ("pipe",)),
         ("all-gather", ("fsdp",)), ("reduce-scatter", ("fsdp",)), ("all-gather", ("tensor",)),
         ("reduce-scatter", ("tensor",))}),
    # ... and FSDP layer by layer (parallel.pipeline_fsdp=per_layer): each layer gathered in
    # every slot and its gradient reduce-scattered there (cost/pipeline.py:
    # per_layer_fsdp_collectives; measured: 1.55 MB gathered, 0.81 MB scattered, against
    # per_step's 0.21 MB each, both exact).
    "pipe=2,fsdp=2,tensor=2,sp,per_layer": (
        ["mesh.pipe=2", "mesh.data=1", "mesh.fsdp=2", "mesh.tensor=2", "model.n_layers=4",
         "parallel.sequence_parallel=true", "train.microbatches=4",
         "parallel.pipeline_fsdp=per_layer"],
        {("collective-permute", ("pipe",)), ("all-reduce", ("pipe",)),
         ("all-gather", ("fsdp",)), ("reduce-scatter", ("fsdp",)), ("all-gather", ("tensor",)),
         ("reduce-scatter", ("tensor",))}),
    # ... with each chunk's input stashed (parallel.pipeline_stash=inputs): every backward slot
    # runs its chunk's forward again first, so its layers are gathered once more and the
    # sequence gathered and scattered over tensor as in a forward (cost: chunk_forwards).
    "pipe=2,fsdp=2,tensor=2,sp,per_layer,inputs": (
        ["mesh.pipe=2", "mesh.data=1", "mesh.fsdp=2", "mesh.tensor=2", "model.n_layers=4",
         "parallel.sequence_parallel=true", "train.microbatches=4",
         "parallel.pipeline_fsdp=per_layer", "parallel.pipeline_stash=inputs"],
        {("all-reduce", ("pipe",)),  # (the sends: under SMALL of these bytes)
         ("all-gather", ("fsdp",)), ("reduce-scatter", ("fsdp",)), ("all-gather", ("tensor",)),
         ("reduce-scatter", ("tensor",))}),
    # MoE inside a pipeline: the stage's MoE layers, every microbatch and masked slot.
    "moe,pipe=2,expert=2,tensor=2": (
        [*MOE, "mesh.pipe=2", "mesh.data=1", "mesh.expert=2", "mesh.tensor=2",
         "train.microbatches=4", "parallel.pipeline_schedule=1f1b"],
        {("collective-permute", ("pipe",)), ("all-reduce", ("pipe",)),
         ("all-reduce", ("expert",)), ("all-reduce", ("tensor",)), ("all-to-all", ("expert",))}),
    # DeepSeek-V3's block: multi-head latent attention (the values padded to the q/k width),
    # group-limited routing with a shared expert, and a dense first block in a scanned stack of
    # its own, gathered layer by layer like the others.
    "deepseek,fsdp=4,expert=2": (
        ["mesh.data=1", "mesh.fsdp=4", "mesh.expert=2", "model.mla.q_lora_rank=24",
         "model.mla.kv_lora_rank=16", "model.mla.qk_nope_head_dim=8",
         "model.mla.qk_rope_head_dim=8", "model.mla.v_head_dim=12", "model.n_layers=3",
         "model.moe.num_experts=8", "model.moe.top_k=2", "model.moe.router=sigmoid_bias",
         "model.moe.n_group=2", "model.moe.topk_group=1", "model.moe.num_shared_experts=1",
         "model.moe.d_ff_expert=32", "model.moe.first_dense=1"],
        # The experts' weights gathered over fsdp, the dense ones over fsdp x expert.
        {("all-gather", ("fsdp",)), ("reduce-scatter", ("fsdp",)), ("all-to-all", ("expert",)),
         ("all-gather", ("fsdp", "expert")), ("reduce-scatter", ("fsdp", "expert"))}),
}

# Compiled matmul flops (loop trips counted, a conditional as its costliest branch) against the
# plan's executed flops. Ring attention's kernel skips causal blocks behind a conditional, which
# the HLO count cannot see; with a contiguous split the busiest device computes all of its
# blocks (the plan's share for it), so every device's count is exact.
FLOPS = {
    "moe,pipe=2,expert=2,tensor=2": LAYOUTS["moe,pipe=2,expert=2,tensor=2"][0],
    "pipe=2,fsdp=2,tensor=2,sp": LAYOUTS["pipe=2,fsdp=2,tensor=2,sp"][0],
    "context=8,ring,contiguous": ["mesh.data=1", "mesh.context=8", "train.seq_len=64",
                                  "parallel.context_impl=ring", "parallel.zigzag=false"],
    # Muon's iterations, one layer's matrices per device (2 layers padded to the 4 devices of
    # fsdp x tensor): 58 of the step's 78 MFLOP (old plan, without them: 0.25 of it).
    "data=2,fsdp=2,tensor=2,muon": LAYOUTS["data=2,fsdp=2,tensor=2,muon"][0],
    "moe,data=2,expert=2,tensor=2,muon": LAYOUTS["moe,data=2,expert=2,tensor=2,muon"][0],
    # The vocab-parallel embedding gathers each device's rows: a one-hot matmul forward pass
    # would add 2 V/t E flops a token, a fifth of this step's (old code: 1.20 of the plan).
    "data=4,tensor=2,vocab=4096": ["mesh.data=4", "mesh.tensor=2", "model.vocab_size=4096"],
    # ... as does each pipeline stage from its vocabulary piece.
    "pipe=2,data=4,vocab=4096": ["mesh.pipe=2", "mesh.data=4", "train.microbatches=2",
                                 "parallel.pipeline_schedule=1f1b", "model.vocab_size=4096"],
}
FLOPS_TOLERANCE = 0.10

# Compiled peak memory (arguments + outputs - aliased + temp) against the plan's, for pipeline
# stages: the stashes, the running chunk's residuals and XLA's copies of the stage weights.
# (Sequences of 128 tokens so that activations, not tiny weights, make the peak, as in practice.)
LONG = ["train.batch_size=16", "train.seq_len=128", "model.n_kv_heads=8"]
MEMORY = {
    "pipe=2,data=4,1f1b": [*LONG, "mesh.pipe=2", "mesh.data=4", "train.microbatches=4",
                           "parallel.pipeline_schedule=1f1b"],
    "pipe=2,data=4,gpipe": [*LONG, "mesh.pipe=2", "mesh.data=4", "train.microbatches=4",
                            "parallel.pipeline_schedule=gpipe"],
    # grad_accum folded into GPipe's one schedule: it stashes all 8 microbatches (measured:
    # 12.7 MB against 8.5 MB without grad_accum; the plan 0.99 of it), and no accumulator.
    "pipe=2,data=4,gpipe,grad_accum=2": [*LONG, "train.batch_size=32", "mesh.pipe=2",
                                         "mesh.data=4", "train.microbatches=4",
                                         "train.grad_accum=2",
                                         "parallel.pipeline_schedule=gpipe"],
    "pipe=2,data=4,interleaved": LAYOUTS["pipe=2,data=4,interleaved"][0],
    # Zero bubble: the W stash, what each I leaves its W (the output gradient of every weight
    # matmul), two slots and a spare at p=2, beside the residuals held until the W (measured
    # 1.00 of the plan with tensor=2 and SP; pipe=2 data=4 1.04, 1F1B's layout 1.07).
    "pipe=2,data=2,tensor=2,sp,zero_bubble": [
        *LONG, "mesh.pipe=2", "mesh.data=2", "mesh.tensor=2", "parallel.sequence_parallel=true",
        "train.microbatches=4", "parallel.pipeline_schedule=zero_bubble"],
    "moe,pipe=2,expert=2,tensor=2": [*LAYOUTS["moe,pipe=2,expert=2,tensor=2"][0], *LONG],
    # LoRA: the running chunk builds the adapters' gradients only, and the head's step no
    # embedding or head gradient (measured 1.07 of the plan, as without LoRA)
    "lora,pipe=2,data=4,1f1b": [*LONG, "mesh.pipe=2", "mesh.data=4", "train.microbatches=4",
                                "parallel.pipeline_schedule=1f1b", "train.lora.rank=4"],
    # FSDP layer by layer: no stage copy of the weights, the layers' sums in their shards,
    # each layer's gradient added into them inside the layer loop (measured 1.02 of the plan;
    # per_step's layout 0.93)
    "pipe=2,fsdp=2,tensor=2,sp,per_layer": LAYOUTS["pipe=2,fsdp=2,tensor=2,sp,per_layer"][0],
    # Each chunk's input stashed (parallel.pipeline_stash=inputs): one activation a slot, and
    # the backward slot's chunk residuals made again beside what reads them (measured 1.05
    # of the plan; per_layer with tensor and SP 1.08, where keeping residuals reads 1.25)
    "pipe=2,data=4,1f1b,inputs": [*LONG, "mesh.pipe=2", "mesh.data=4", "train.microbatches=4",
                                  "parallel.pipeline_schedule=1f1b",
                                  "parallel.pipeline_stash=inputs"],
    "pipe=2,fsdp=2,tensor=2,sp,per_layer,inputs": [
        *LAYOUTS["pipe=2,fsdp=2,tensor=2,sp,per_layer,inputs"][0], *LONG],
}
MEMORY_TOLERANCE = 0.10
# Muon's update phase makes the peak when its gathered matrices outweigh the activations: 8
# layers of d_model 256 and d_ff 1024 (31 MB of matrices gathered whole) at fsdp=8 under ZeRO-1,
# which gathers rather than exchanging with owners. (Old plan, without the gathered matrices:
# 0.62 of the compiled peak.)
MUON_MEMORY = ("mesh.data=1", "mesh.fsdp=8", "parallel.zero=1", "train.optimizer=muon",
               "model.d_model=256", "model.d_ff=1024", "model.n_layers=8")


@functools.cache
def compiled_step(overrides: tuple[str, ...]) -> dict:
    """Compile tiny's train step with ``overrides`` once: its per-step collective rows, memory
    and matmul flops."""
    from jaxpar.inspect.hlo.collectives import parse_collectives, summarize_collectives
    from jaxpar.inspect.hlo.flops import dot_flops
    from jaxpar.mesh import make_mesh
    from jaxpar.train.step import build_trainer

    cfg = tiny(*overrides)
    trainer = build_trainer(cfg, make_mesh(cfg))
    step = trainer.compile_step()
    text = step.as_text()
    rows = summarize_collectives(parse_collectives(text, cfg.mesh_shape))
    return {"cfg": cfg, "rows": rows, "memory": step.memory_analysis(),
            "flops": dot_flops(text)}


def compiled(name: str) -> dict:
    return compiled_step(tuple(LAYOUTS[name][0]))


def significant(rows: list[dict]) -> dict[tuple[str, tuple[str, ...]], dict]:
    total = sum(r["bytes"] for r in rows)
    return {(r["kind"], tuple(r["axes"])): r for r in rows if r["bytes"] >= SMALL * total}


def close(predicted: float, actual: float, tolerance: float) -> bool:
    return abs(predicted - actual) <= tolerance * actual


# --------------------------------------------------------------------------------------------
# Against the compiled step


@pytest.mark.parametrize("name", LAYOUTS)
def test_compiled_collectives_have_the_predicted_kinds_axes_and_bytes_per_step(name):
    got = compiled(name)
    actual = significant(got["rows"])
    predicted = significant(estimate(got["cfg"]).collective_rows())
    assert set(actual) == LAYOUTS[name][1]
    assert set(predicted) == set(actual)
    for key, row in actual.items():
        if (key == ("all-gather", ("fsdp",)) and got["cfg"].mesh.pipe > 1
                and got["cfg"].model.moe.enabled):
            # With FSDP left to the partitioner (MoE models), XLA hoists a stage's
            # loop-invariant weight gathers out of the executor's loops; how many survive per
            # stretch is its choice: the plan's figure is an upper bound.
            assert row["bytes"] <= predicted[key]["bytes"] * (1 + COLLECTIVE_TOLERANCE), row
            continue
        assert close(predicted[key]["bytes"], row["bytes"], COLLECTIVE_TOLERANCE), (key, row)
        # XLA:CPU runs a reduce-scatter as all-reduce + slice, which sends twice a ring
        # reduce-scatter's bytes; the model predicts the ring's, so wire bytes are compared for
        # the other kinds only.
        if key[0] != "reduce-scatter":
            assert close(predicted[key]["wire_bytes"], row["wire_bytes"],
                         COLLECTIVE_TOLERANCE), (key, row)


@pytest.mark.parametrize("name", LAYOUTS)
def test_predicted_parameter_and_optimizer_bytes_match_the_compiled_arguments(name):
    got = compiled(name)
    report = estimate(got["cfg"])
    arguments = got["memory"].argument_size_in_bytes - report.memory.batch
    assert close(report.memory.state, arguments, STATE_TOLERANCE)


@pytest.mark.parametrize("name", FLOPS)
def test_compiled_matmul_flops_are_the_plans_executed_flops(name):
    got = compiled_step(tuple(FLOPS[name]))
    assert close(estimate(got["cfg"]).flops.executed, got["flops"], FLOPS_TOLERANCE)


@pytest.mark.parametrize("name", MEMORY)
def test_compiled_peak_memory_of_a_pipeline_stage_is_the_plans(name):
    got = compiled_step(tuple(MEMORY[name]))
    m = got["memory"]
    peak = (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
            + m.temp_size_in_bytes)
    assert close(estimate(got["cfg"]).memory.peak, peak, MEMORY_TOLERANCE), peak


def test_compiled_peak_memory_of_muons_update_is_the_plans():
    got = compiled_step(MUON_MEMORY)
    m = got["memory"]
    peak = (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
            + m.temp_size_in_bytes)
    assert close(estimate(got["cfg"]).memory.peak, peak, MEMORY_TOLERANCE), peak


# Ulysses attends the whole sequence with 1/u of a tensor shard's heads: blockwise attention's
# one-block working set (256 x 256 scores here) counted for all heads made the plan 2.9 times
# the compiled peak (at data=1; after: Ulysses 1.11 of the plan, the hybrid 0.98, so 15%).
ULYSSES_MEMORY = {
    "ulysses": ("mesh.data=2", "mesh.context=4", "parallel.context_impl=ulysses"),
    "hybrid=2x2": ("mesh.data=2", "mesh.context=4", "parallel.context_impl=hybrid",
                   "parallel.ulysses_size=2"),
}


@pytest.mark.parametrize("name", ULYSSES_MEMORY)
def test_compiled_peak_memory_of_ulysses_counts_the_heads_a_device_attends(name):
    got = compiled_step((*ULYSSES_MEMORY[name], "train.seq_len=256", "train.remat=full",
                         "model.attention=blockwise"))
    m = got["memory"]
    peak = (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
            + m.temp_size_in_bytes)
    assert close(estimate(got["cfg"]).memory.peak, peak, 0.15), peak


@pytest.mark.parametrize("layout", [["mesh.data=1", "mesh.fsdp=8"],
                                    ["mesh.data=2", "mesh.fsdp=2", "mesh.context=2"]])
def test_loss_pieces_reduce_the_head_gradient_once_whatever_their_count(layout):
    """The head's gradient is summed over the token shards once per step, not once per piece of
    the loss: the same collective bytes in 1 and in 8 pieces (each piece's partial sum stays
    on its device), as the plan says."""
    vocab = ["model.vocab_size=1024"]  # the head's gradient is most of the gradient bytes
    whole = significant(compiled_step((*layout, *vocab, "train.loss_pieces=1"))["rows"])
    pieces = compiled_step((*layout, *vocab, "train.loss_pieces=8"))
    assert set(significant(pieces["rows"])) == set(whole)
    for key, row in significant(pieces["rows"]).items():
        assert close(row["bytes"], whole[key]["bytes"], 0.02), (key, row, whole[key])
    predicted = significant(estimate(pieces["cfg"]).collective_rows())
    for key, row in significant(pieces["rows"]).items():
        assert close(predicted[key]["bytes"], row["bytes"], COLLECTIVE_TOLERANCE), key
