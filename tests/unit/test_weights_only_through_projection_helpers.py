"""Every weight reaches its matmul through a projection helper (docs/add-a-layer.md).

The helpers in ``jaxpar/model/projection.py`` (``weight``, ``project``, ``project_all``,
``lookup``, ``add_bias``) and ``jaxpar/model/layers.py: stored_weight`` (the experts' weights)
are where FSDP's gather, the gradient dtype and the backward pass's memory are handled. A
parameter read anywhere else skips all three, and no equivalence test on one device sees it.

The test traces a forward pass of small models (abstract: no memory, no compile). Each
parameter carries its path in an ``on_get_value`` hook, so every read of its value is seen;
while one of the helpers runs, the read counts as the helper's. Only norm scales may be read
outside a helper: a norm multiplies by its scale, it is no matmul.
"""

from __future__ import annotations

import contextlib
import importlib
import pkgutil
from collections.abc import Callable

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import jaxpar.model
from jaxpar.config import load_config
from jaxpar.model import layers, projection
from jaxpar.model.annotate import layout_with
from jaxpar.model.transformer import abstract_model

HELPERS = (projection.weight, projection.project, projection.project_all, projection.lookup,
           projection.add_bias, layers.stored_weight)

# Parameters that are no matmul's weight, by their last name: the norms' scales.
NOT_MATMUL_WEIGHTS = {"scale"}

MOE = ["model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.d_ff_expert=32"]
MLA = ["model.mla.kv_lora_rank=16", "model.mla.q_lora_rank=8", "model.mla.qk_rope_head_dim=4",
       "model.mla.qk_nope_head_dim=4", "model.mla.v_head_dim=8"]
MODELS = {
    "tiny": ("tiny", []),
    "tiny-gemma-like": ("tiny", ["model.qkv_bias=true", "model.qk_norm=true",
                                 "model.post_norms=true", "model.tie_embeddings=true",
                                 "model.sliding_window=4", "model.global_every=2"]),
    "moe-tiny": ("moe-tiny", []),
    "deepseek-like": ("tiny", [*MOE, *MLA, "model.n_layers=3", "model.moe.first_dense=1",
                               "model.moe.num_shared_experts=1",
                               "model.moe.router=sigmoid_bias"]),
    "tiny-lora": ("tiny", ["train.lora.rank=2"]),
    "moe-tiny-lora": ("moe-tiny", ["train.lora.rank=2"]),
    "deepseek-like-lora": ("tiny", [*MOE, *MLA, "model.moe.every=2", "train.lora.rank=2",
                                    "train.lora.targets=[q_a,q_b,kv_a,kv_b,o,gate,up,down]"]),
}
# Split layouts take other branches (q, k, v stacked into one matmul; the vocab-parallel
# embedding): both are traced.
SPLIT = {"heads": 2, "kv_heads": 2, "mlp": 2, "vocab": 2}


def model_modules() -> list:
    return [importlib.import_module(f"jaxpar.model.{m.name}")
            for m in pkgutil.iter_modules(jaxpar.model.__path__)]


class Reads:
    """Which parameters were read inside a helper and which outside one."""

    def __init__(self) -> None:
        self.depth = 0
        self.inside: set[str] = set()
        self.outside: set[str] = set()

    def hook(self, path: str) -> Callable:
        def on_get_value(variable, value):
            (self.inside if self.depth else self.outside).add(path)
            return value
        return on_get_value

    def helper(self, fn: Callable) -> Callable:
        def counted(*args, **kwargs):
            self.depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.depth -= 1
        return counted


def traced_reads(monkeypatch, preset: str, overrides: list[str], split: bool
                 ) -> tuple[Reads, set[str]]:
    """(the reads of one forward pass, every parameter's path)."""
    reads = Reads()
    # Every module of jaxpar/model that holds a helper by name gets the counted one, so a new
    # module that imports a helper is covered without a change here.
    for module in model_modules():
        for name, value in list(vars(module).items()):
            if any(value is helper for helper in HELPERS):
                monkeypatch.setattr(module, name, reads.helper(value))
    # A parameter's shape is no read of its value (flax's ``shape`` reads the value).
    monkeypatch.setattr(nnx.Variable, "shape", property(lambda v: v.get_raw_value().shape))
    cfg = load_config(preset, overrides)
    lora = cfg.train.lora if cfg.train.lora.rank > 0 else None
    model = abstract_model(cfg.model, lora)
    params = set()
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Param):
            name = "/".join(map(str, path))
            params.add(name)
            node.set_metadata(on_get_value=reads.hook(name))
    graphdef, state = nnx.split(model)
    tokens = jnp.zeros((2, 8), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(8, dtype=jnp.int32), (2, 8))
    with layout_with(split_counts=SPLIT) if split else contextlib.nullcontext():
        jax.eval_shape(lambda s: nnx.merge(graphdef, s)(tokens, positions), state)
    return reads, params


@pytest.mark.parametrize("split", [False, True], ids=["whole", "split"])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_every_weight_is_read_only_through_a_projection_helper(monkeypatch, model, split):
    reads, params = traced_reads(monkeypatch, *MODELS[model], split=split)
    weights = {p for p in params if p.split("/")[-1] not in NOT_MATMUL_WEIGHTS}
    assert weights, "the model has no weights: the scan found nothing"
    bypassed = sorted(reads.outside & weights)
    assert not bypassed, (f"read outside jaxpar/model/projection.py's helpers: {bypassed}; "
                          "multiply by them through weight/project/project_all/lookup "
                          "(docs/add-a-layer.md)")
    assert sorted(weights - reads.inside) == [], "weights no helper read"
    assert reads.inside | reads.outside == params, "parameters the forward pass never read"
