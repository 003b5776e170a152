"""DeepSeek-V3's dense first blocks (``model.moe.first_dense``) in a pipeline: a pre-phase
before the stages, outside the executor's ``shard_map``.

The embedding and ``dense_layers`` run on the step's batch under ``jax.vjp``, rows split over
``pipe`` and the batch axes, so each token's dense blocks run once. The output, cut into
microbatches, replaces chunk 0's embedding: one all-gather of ``B/d x S/c x E`` over ``pipe``
per step (d: batch-axis devices, c: context). The VJP turns chunk 0's input gradients into the
embedding's and dense blocks' gradients, summed once per step. Their weights are whole on
every stage; their residuals (``B/(d p)`` rows) live while the pipeline runs. More:
docs/pipelines.md, "Dense first blocks".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from jaxpar.config import Config
from jaxpar.model.annotate import constrain
from jaxpar.model.projection import RESIDUAL
from jaxpar.model.remat import Remat
from jaxpar.model.transformer import scan_stack
from jaxpar.parallel.hooks import model_hooks
from jaxpar.parallel.pipeline.stages import PIPE_AXIS
from jaxpar.parallel.rules import logical_rules


def dense_pre_phase(cfg: Config, graphdef: Any, mesh_shape: dict, platform: str, *,
                     dtype: Any, remat: Remat, split: Callable) -> Callable:
    """``(params, buffers, batch) -> (x0, backward)``: chunk 0's inputs (microbatched by
    ``split``), and the map from their gradient to the embedding's and ``dense_layers``'
    gradients. Rows are split over pipe too, so pipe devices share the work."""
    rules = logical_rules(cfg)
    pre_rules = {k: (*rules[k], PIPE_AXIS) for k in ("batch", "residual_batch")}
    pre_cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(
        cfg.parallel, rules={**cfg.parallel.rules, **pre_rules}))

    def embed_and_dense(pre_params: dict, params: dict, buffers: dict, batch: dict) -> Any:
        with model_hooks(pre_cfg, mesh_shape, platform):
            net = nnx.merge(graphdef, {**params, **pre_params}, buffers)
            x = net.embed(batch["inputs"], dtype=dtype,
                          grad_pieces=cfg.embedding_grad_pieces())
            x, _ = scan_stack(net.dense_layers, x, batch["positions"], remat)
            x = constrain(x, RESIDUAL)
        return split(x)

    def forward(params: dict, buffers: dict, batch: dict) -> tuple[Any, Callable]:
        pre_params = {k: params[k] for k in ("embedding", "dense_layers")}
        x0, vjp = jax.vjp(lambda pp: embed_and_dense(pp, params, buffers, batch), pre_params)

        def backward(d_x0: Any) -> dict:
            # Under the pre-phase's hooks again: the custom VJPs' backward rules are traced
            # here, and their layouts (rows split over pipe) must be the forward's.
            with model_hooks(pre_cfg, mesh_shape, platform):
                (d_pre,) = vjp(d_x0)
            return d_pre

        return x0, backward

    return forward
