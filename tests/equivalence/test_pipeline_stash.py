"""A stage that keeps only each chunk's input (``parallel.pipeline_stash=inputs``) against the
single-device run, and what it stashes.

tiny with 8 layers: the loss, gradients and parameters after 3 AdamW steps agree with one
device in fp32 when every backward slot runs its chunk's forward again from the stashed input
(jaxpar/parallel/pipeline/recompute.py): 1F1B with FSDP layer by layer, tensor and sequence
parallelism under ``remat=full`` (the layout measured at Llama-3-70B widths, docs/pipelines.md)
in the default suite; GPipe, interleaved and a plain 1F1B in the slow one. The stash holds one
activation per slot, the compiled temp memory falls, and no collective sits under a
conditional. The plan against the compiled peak: tests/equivalence/test_cost_vs_compiled.py.
"""

from __future__ import annotations

import jax
import pytest
from helpers import (
    assert_grads_and_params_match,
    collectives_in_conditionals,
    compiled_temp_bytes,
    in_model_order,
    run_layout,
)

from jaxpar.config import load_config, validate

MODEL = ("model.n_layers=8",)
REFERENCE = ("mesh.data=1", *MODEL)
INPUTS = ("parallel.pipeline_stash=inputs",)
PER_LAYER = ("mesh.pipe=2", "mesh.data=1", "mesh.fsdp=2", "mesh.tensor=2",
             "parallel.sequence_parallel=true", "train.microbatches=4",
             "parallel.pipeline_schedule=1f1b", "parallel.pipeline_fsdp=per_layer",
             "train.remat=full", *MODEL)
LAYOUTS = {
    "1f1b,per_layer,fsdp=2,tensor=2,sp,full": PER_LAYER,
    "1f1b,pipe=2,m=4": ("mesh.pipe=2", "mesh.data=1", "train.microbatches=4",
                        "parallel.pipeline_schedule=1f1b", *MODEL),
    "gpipe,pipe=2,data=2,m=2": ("mesh.pipe=2", "mesh.data=2", "train.microbatches=2",
                                "parallel.pipeline_schedule=gpipe", *MODEL),
    "interleaved,pipe=2,v=2,dots": ("mesh.pipe=2", "mesh.data=1", "train.microbatches=4",
                                    "parallel.pipeline_schedule=interleaved",
                                    "parallel.virtual_stages=2", "train.remat=dots", *MODEL),
}
DEFAULT = {"1f1b,per_layer,fsdp=2,tensor=2,sp,full"}


@pytest.mark.parametrize("name", [n if n in DEFAULT else pytest.param(n, marks=pytest.mark.slow)
                                  for n in LAYOUTS])
def test_stashing_chunk_inputs_matches_single_device_loss_grads_and_params(name):
    got, ref = run_layout((*LAYOUTS[name], *INPUTS)), run_layout(REFERENCE)
    assert abs(got["loss"] - ref["loss"]) / ref["loss"] < 1e-5
    assert abs(got["last_loss"] - ref["last_loss"]) / ref["last_loss"] < 1e-5
    grads, params = in_model_order(got)
    assert_grads_and_params_match({"grads": grads, "params": params}, ref)
    assert collectives_in_conditionals(got["hlo"]) == []


def test_the_stash_holds_each_chunks_input_and_the_step_less_memory():
    """What the stash holds per slot: one activation (the chunk's input) where ``residuals``
    holds a layer input per layer of the chunk (``remat=full``); the compiled temp memory of
    the step falls with it. 16 layers of 1024 tokens, so that the stash outweighs the chunk's
    residuals made again in the backward slot (measured: 28.5 MiB -> 25.9 MiB; with 8 layers
    of 512 tokens the stash is too small for it: 18.9 -> 19.4 MiB)."""
    longer = ("model.n_layers=16", "train.seq_len=1024", "train.batch_size=8")
    temps = {}
    for stash in ("residuals", "inputs"):
        cfg = validate(load_config("tiny", [*PER_LAYER, *longer,
                                            f"parallel.pipeline_stash={stash}"]), 8)
        temps[stash] = compiled_temp_bytes(cfg, 8)
    assert temps["inputs"] < temps["residuals"], temps


def test_a_stage_stashes_the_chunk_input_alone(monkeypatch):
    """The forward slot hands the stash the chunk's input (one activation) and none of the
    residuals its VJP made (a layer input per layer of the chunk under ``remat=full``)."""
    from jaxpar.mesh import make_mesh
    from jaxpar.parallel.pipeline import recompute, slots
    from jaxpar.train.step import build_trainer

    seen = {}

    def record(env, x, residuals):
        kept = recompute.kept(env, x, residuals)
        seen["made"] = [(tuple(a.shape), a.dtype) for a in residuals]
        seen["kept"] = [(tuple(a.shape), a.dtype) for a in kept]
        return kept

    monkeypatch.setattr(slots, "kept", record)
    cfg = validate(load_config("tiny", [*PER_LAYER, *INPUTS]), 8)
    build_trainer(cfg, make_mesh(cfg)).compile_step()
    rows = cfg.train.batch_size // cfg.train.microbatches // cfg.mesh.fsdp
    activation = (rows, cfg.train.seq_len, cfg.model.d_model)  # tensor is left automatic
    assert seen["kept"] == [(activation, jax.numpy.dtype(cfg.train.dtype))], seen
    assert len(seen["made"]) >= 1 and seen["made"] != seen["kept"]
