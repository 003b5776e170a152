"""One optimizer step as a pure, jitted function of (state, batch), sharded by annotations.

The step never mentions a collective: the rules table lays out parameters, state and batch,
the model constrains activations, and the compiler inserts the collectives. The hops of one
step, and the objective (a sum over tokens divided by the global valid count, so that it does
not depend on the mesh): docs/train-step.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.config import Config, ConfigError, documents_masked
from jaxpar.mesh import process_batch_rows, step_compiler_options
from jaxpar.model.annotate import installed, lora_dropout_for, lora_dropout_tokens
from jaxpar.model.layers import FULL_PRECISION
from jaxpar.model.lora import adapter_part, base_part, dropout_key, merged, with_dropout_tokens
from jaxpar.model.lora import for_gradients as lora_for_gradients
from jaxpar.model.lora import from_gradients as lora_from_gradients
from jaxpar.model.mask import AttentionMask, document_positions
from jaxpar.model.moe import moe_loss, moe_metrics, update_router_bias
from jaxpar.model.remat import Remat
from jaxpar.model.transformer import (
    DTYPES,
    abstract_model,
    create_model,
)
from jaxpar.parallel.context import zigzag_order
from jaxpar.parallel.hooks import model_layout
from jaxpar.parallel.manual import sum_over_data_once
from jaxpar.parallel.microbatch import split_micro_steps
from jaxpar.parallel.optimizer_state import muon_layout
from jaxpar.parallel.pipeline.executor import Program, pipelined_gradients
from jaxpar.parallel.rules import (
    is_axes_leaf,
    logical_rules,
    model_specs,
    named_shardings,
    param_logical_axes,
    param_name,
    resolve_spec,
)
from jaxpar.parallel.zero import data_summed_by_hand, gradient_specs, optimizer_state_specs
from jaxpar.platform import NO_BF16_GRADIENT_SUMS
from jaxpar.train.optimizers import (  # noqa: F401  (learning_rate_schedule: re-exported)
    as_float32,
    in_float32,
    learning_rate_schedule,
    make_optimizer,
)

Batch = dict[str, jax.Array]  # inputs, targets: int32 [B, S]; mask: float32 [B, S]


class TrainState(NamedTuple):
    step: jax.Array  # int32 scalar: optimizer steps taken
    params: dict
    opt_state: Any
    buffers: dict  # non-trainable model variables (MoE router biases, window flags) or {}


def stored_params(params: dict, param_dtype: str) -> dict:
    """Parameters in the dtype they are stored in (``train.param_dtype``), except those the
    model uses in float32 whatever the dtypes (layers.FULL_PRECISION: norm scales, the router),
    which a bfloat16 copy would only round."""
    dtype = DTYPES[param_dtype]
    return jax.tree_util.tree_map_with_path(
        lambda path, a: a if param_name(path).split("/")[-1] in FULL_PRECISION
        else a.astype(dtype), params)


def lora_of(cfg: Config):
    """``train.lora`` when it adds adapters (rank > 0), else None."""
    return cfg.train.lora if cfg.train.lora.rank > 0 else None


def trained(cfg: Config, tree: dict) -> dict:
    """The part of a parameter-shaped tree the optimizer updates: all of it, or under LoRA the
    adapters (jaxpar/model/lora.py); the base weights are then frozen: no gradient, no
    optimizer state."""
    return tree if lora_of(cfg) is None else adapter_part(tree)


def for_gradients(cfg: Config, params: dict, buffers: dict) -> tuple[dict, Any]:
    """(what is differentiated, what rides along): under LoRA the frozen base weights ride
    with the buffers, so no gradient of theirs is computed or summed."""
    return lora_for_gradients(params, buffers, lora_of(cfg) is not None)


def from_gradients(cfg: Config, params: dict, buffers: Any) -> tuple[dict, dict]:
    """The inverse of :func:`for_gradients`: the whole parameters and the buffers."""
    return lora_from_gradients(params, buffers, lora_of(cfg) is not None)


def batch_token_loss(params: dict, buffers: dict, graphdef: nnx.GraphDef, batch: Batch, *,
                     dtype: Any, remat: Remat, loss_pieces: int, embedding_grad_pieces: int = 1
                     ) -> tuple[jax.Array, dict]:
    """Sum over valid tokens of the cross entropy (normalised later by the global count), the
    logits made ``loss_pieces`` pieces at a time (the embedding's gradient
    ``embedding_grad_pieces`` slices of the vocabulary at a time), and the MoE layers' aux dict
    (``{}`` for a dense model)."""
    model = nnx.merge(graphdef, params, buffers)
    x = model.embed(batch["inputs"], dtype=dtype, grad_pieces=embedding_grad_pieces)
    with lora_dropout_tokens(batch.get("lora_tokens")):
        x, aux = model.run_layers(x, batch["positions"], remat=remat)
    return model.edges.token_loss(model.final_hidden(x), model.head(dtype), batch["targets"],
                                  batch["mask"], loss_pieces), aux


@dataclass(frozen=True)
class Trainer:
    """The jitted functions of one run and the shardings they were built with.

    Every call enters the run's mesh, so activation constraints (bare PartitionSpecs) resolve.
    """

    cfg: Config
    mesh: jax.sharding.Mesh
    graphdef: nnx.GraphDef
    logical_axes: dict  # parameter path -> logical names
    param_specs: dict  # parameter path -> PartitionSpec
    state_shardings: TrainState
    batch_sharding: NamedSharding
    abstract_state: TrainState  # ShapeDtypeStructs carrying their shardings
    seq_order: np.ndarray  # token order within a sequence (zigzag under context parallelism)
    # Model layer of each stored layer (interleaved pipelines store a device's chunks together;
    # pipeline.stage_layer_order); None when stored in model order.
    layer_order: np.ndarray | None
    pipeline: Program | None  # the compiled schedule table when mesh.pipe > 1
    _init: Callable
    _step: Callable
    _loss_and_grads: Callable
    _reorder: Callable  # (state, order) -> state with the stacked layers in that order

    def to_model_order(self, state: TrainState) -> TrainState:
        """``state`` with the stacked layers (and their optimizer moments) in model order, as
        checkpoints store them; the same object when the run stores them so already."""
        if self.layer_order is None:
            return state
        with jax.set_mesh(self.mesh):
            return self._reorder(state, np.argsort(self.layer_order))

    def from_model_order(self, state: TrainState) -> TrainState:
        """The inverse of :meth:`to_model_order`: a checkpoint's state in this run's order."""
        if self.layer_order is None:
            return state
        with jax.set_mesh(self.mesh):
            return self._reorder(state, self.layer_order)

    def init(self) -> TrainState:
        with jax.set_mesh(self.mesh):
            return self._init()

    def step(self, state: TrainState, batch: Batch) -> tuple[TrainState, dict]:
        """One optimizer step; ``state`` is donated (do not use it afterwards)."""
        with jax.set_mesh(self.mesh):
            return self._step(state, batch)

    def loss_and_grads(self, state: TrainState, batch: Batch) -> tuple[jax.Array, dict]:
        """The cross-entropy and the gradient of the whole objective (with MoE aux losses)."""
        with jax.set_mesh(self.mesh):
            loss, grads, _ = self._loss_and_grads(state, batch)
            return loss, grads

    def loss_grads_and_aux(self, state: TrainState, batch: Batch
                           ) -> tuple[jax.Array, dict, dict]:
        """As :meth:`loss_and_grads`, plus the MoE aux dict summed over micro-steps."""
        with jax.set_mesh(self.mesh):
            return self._loss_and_grads(state, batch)

    @property
    def jitted_loss_and_grads(self) -> Callable:
        """``(state, batch) -> (loss, grads, aux)`` as jitted, to call inside another jitted
        function (the pipeline's eval step, train/validation_loss.py) without entering the mesh
        again."""
        return self._loss_and_grads

    def abstract_batch(self) -> Batch:
        t = self.cfg.train
        def leaf(dtype):
            return jax.ShapeDtypeStruct((t.batch_size, t.seq_len), dtype,
                                        sharding=self.batch_sharding)
        batch = {"inputs": leaf(jnp.int32), "targets": leaf(jnp.int32), "mask": leaf(jnp.float32)}
        if documents_masked(self.cfg):
            batch.update(segment_ids=leaf(jnp.int32), rope_positions=leaf(jnp.int32))
        return batch

    def compile_step(self) -> jax.stages.Compiled:
        """The train step compiled from abstract arrays: no parameter memory is allocated."""
        with jax.set_mesh(self.mesh):
            return self._step.lower(self.abstract_state, self.abstract_batch()).compile()

    def local_batch_rows(self) -> np.ndarray:
        """The global batch rows this process's devices hold (all of them in one process)."""
        t = self.cfg.train
        return process_batch_rows(self.batch_sharding, (t.batch_size, t.seq_len))

    def put_batch(self, local_batch: dict[str, np.ndarray]) -> Batch:
        """This process's rows (:meth:`local_batch_rows`, in that order) -> global arrays laid
        out for the step (tokens reordered into ``seq_order`` here, on the host, where it costs
        no communication). With ``segment_ids``, each token's position in its document
        (``rope_positions``) is computed first, in row order (module docstring). Each device
        gets its slice of the rows it holds, whichever other processes hold the same rows."""
        t, rows = self.cfg.train, self.local_batch_rows()
        shape = (t.batch_size, t.seq_len)

        def put(local: np.ndarray) -> jax.Array:
            local = np.asarray(local)[:, self.seq_order]
            return jax.make_array_from_callback(
                shape, self.batch_sharding,
                lambda index: local[np.searchsorted(rows, np.arange(shape[0])[index[0]])][
                    :, index[1]])

        if "segment_ids" in local_batch:
            local_batch = dict(local_batch,
                               rope_positions=document_positions(local_batch["segment_ids"]))
        return {k: put(v) for k, v in local_batch.items()}


class Shardings(NamedTuple):
    """Building a trainer, part 1 of 4 (docs/train-step.md, "Building the trainer"): the model's
    abstract state and where every array lives."""

    graphdef: nnx.GraphDef
    logical_axes: dict  # parameter path -> logical names
    param_specs: dict  # parameter path -> PartitionSpec
    abstract_state: TrainState  # ShapeDtypeStructs carrying their shardings
    state: TrainState  # NamedShardings of the train state
    batch: NamedSharding


def muon_specs(cfg: Config, logical_axes: dict) -> dict | None:
    """How each Muon matrix's Newton-Schulz iterations are laid out
    (:func:`jaxpar.parallel.optimizer_state.muon_layout`); None for the other optimizers."""
    if cfg.train.optimizer != "muon":
        return None
    rules = logical_rules(cfg)
    return jax.tree_util.tree_map_with_path(
        lambda path, names: muon_layout(param_name(path), names, rules, cfg.mesh_shape,
                                        cfg.parallel.zero),
        logical_axes, is_leaf=is_axes_leaf)


def resolve_shardings(cfg: Config, mesh: jax.sharding.Mesh,
                      tx: optax.GradientTransformation) -> Shardings:
    """Parameters, buffers (every other variable: MoE router biases), optimizer state and the
    batch, laid out by the rules table."""
    mesh_shape, rules = cfg.mesh_shape, logical_rules(cfg)
    model = abstract_model(cfg.model, lora_of(cfg), vocab_rows=cfg.vocab_rows())
    graphdef, abstract_params, abstract_buffers = nnx.split(model, nnx.Param, ...)
    abstract_params = jax.eval_shape(partial(stored_params, param_dtype=cfg.train.param_dtype),
                                     nnx.to_pure_dict(abstract_params))
    abstract_buffers = nnx.to_pure_dict(abstract_buffers)
    logical_axes = param_logical_axes(model)
    specs, buffer_specs = model_specs(model, abstract_params, abstract_buffers, rules, mesh_shape)
    abstract_opt = jax.eval_shape(tx.init, trained(cfg, abstract_params))
    opt_specs = optimizer_state_specs(cfg, abstract_opt, trained(cfg, abstract_params),
                                      trained(cfg, specs), trained(cfg, logical_axes))
    state = named_shardings(mesh, TrainState(step=PartitionSpec(), params=specs,
                                             opt_state=opt_specs, buffers=buffer_specs))
    if cfg.train.offload.optimizer:  # between steps in host memory (train_step_fn brings it)
        state = state._replace(opt_state=jax.tree.map(
            lambda s: s.with_memory_kind("pinned_host"), state.opt_state))
    batch_spec = resolve_spec("batch", ("batch", "seq"), (cfg.train.batch_size,
                                                          cfg.train.seq_len), rules, mesh_shape)
    abstract_state = jax.tree.map(
        lambda a, sharding: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding),
        TrainState(jax.ShapeDtypeStruct((), jnp.int32), abstract_params, abstract_opt,
                   abstract_buffers), state)
    return Shardings(graphdef, logical_axes, specs, abstract_state, state,
                     NamedSharding(mesh, batch_spec))


def plain_gradients(cfg: Config, graphdef: nnx.GraphDef, param_shardings: Any,
                    platform: str) -> Callable:
    """Building a trainer, part 3 of 4, the gradient function without a pipeline: ``(params,
    buffers, batch, valid) -> (grads, (loss_sum, aux))``, ``train.grad_accum`` micro-steps
    summed. Where :func:`~jaxpar.parallel.zero.data_summed_by_hand` says so, the sum over
    ``data`` is taken by hand once per step (:func:`sum_over_data_once`); ``fsdp`` keeps its
    per-micro-step gathers and reduce-scatters."""
    dtype, accum = DTYPES[cfg.train.dtype], cfg.train.grad_accum
    remat = Remat.of_train(cfg.train)
    moe, pieces, embedding_pieces = cfg.model.moe, cfg.loss_pieces(), cfg.embedding_grad_pieces()

    def objective(params: dict, buffers: dict, batch: Batch, valid: jax.Array
                  ) -> tuple[jax.Array, tuple[jax.Array, dict]]:
        """What one micro-step differentiates; returns the summed token loss and the aux dict
        beside it. (``params``, ``buffers``: as :func:`for_gradients` splits them.)"""
        params, buffers = from_gradients(cfg, params, buffers)
        loss_sum, aux = batch_token_loss(params, buffers, graphdef, batch, dtype=dtype,
                                         remat=remat, loss_pieces=pieces,
                                         embedding_grad_pieces=embedding_pieces)
        return loss_sum / valid + moe_loss(aux, moe) / accum, (loss_sum, aux)

    grad_fn = jax.grad(objective, has_aux=True)
    accumulated = (grad_fn if accum == 1 else
                   accumulate_micro_steps(objective, grad_fn, param_shardings, accum))
    if not data_summed_by_hand(cfg, xla_cpu=platform == "cpu"):
        return accumulated
    return sum_over_data_once(cfg, accumulated, platform)


def accumulate_micro_steps(objective: Callable, grad_fn: Callable, param_shardings: Any,
                           accum: int) -> Callable:
    """``grad_fn`` summed over ``accum`` micro-steps in a ``lax.scan``. The running sum is
    float32 whatever the parameters' dtype: bfloat16 sums of many micro-steps lose the small
    ones."""

    def accumulated(params: dict, buffers: dict, batch: Batch, valid: jax.Array) -> tuple:
        def micro_step(carry, micro_batch):
            grads, summed = grad_fn(params, buffers, micro_batch, valid)
            return jax.tree.map(jnp.add, carry, (grads, summed)), None

        # The running gradient sum is sharded like the parameters (1/N under FSDP); bare specs,
        # so that the same code runs inside sum_over_data_once's shard_map.
        zero_grads = jax.lax.with_sharding_constraint(
            jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params),
            jax.tree.map(lambda sharding: sharding.spec, param_shardings))
        micro_batches = split_micro_steps(batch, accum)
        # The aux dict's shapes, for a zero carry (traced, never run).
        _, zero_summed = jax.eval_shape(partial(objective, params, buffers, valid=valid),
                                        jax.tree.map(lambda x: x[0], micro_batches))
        zeros = (zero_grads, jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), zero_summed))
        (grads, summed), _ = jax.lax.scan(micro_step, zeros, micro_batches)
        return grads, summed

    return accumulated


def loss_and_grads_fn(cfg: Config, grad_fn: Callable, seq_order: np.ndarray,
                      grad_shardings: dict, platform: str) -> Callable:
    """Building a trainer, part 4 of 4 (with :func:`train_step_fn`): ``(state, batch) -> (loss,
    grads, aux)`` with the parallel hooks installed."""

    def loss_and_grads(state: TrainState, batch: Batch) -> tuple[jax.Array, dict, dict]:
        valid = jnp.maximum(jnp.sum(batch["mask"]), 1.0)
        batch = with_dropout_tokens(with_positions(batch, seq_order), cfg.train.lora)
        dropout = lora_dropout_for(dropout_key(cfg.train.lora, cfg.train.seed, state.step),
                                   cfg.train.lora.dropout)
        with installed(replace(model_layout(cfg, cfg.mesh_shape, platform),
                               lora_dropout=dropout)):
            grads, (loss_sum, aux) = grad_fn(*for_gradients(cfg, state.params, state.buffers),
                                             batch, valid)
        # Gradients live where their parameters live (under ZeRO-1, where the moments do:
        # parallel/zero.py: gradient_specs): under FSDP and ZeRO-1 this is what turns the
        # gradient all-reduce into a reduce-scatter.
        grads = jax.lax.with_sharding_constraint(grads, grad_shardings)
        return loss_sum / valid, grads, aux

    return loss_and_grads


def with_positions(batch: Batch, seq_order: np.ndarray) -> Batch:
    """``batch`` with ``positions`` for the model: each token's place in the row, in seq_order
    (the same for every row; positions travel with the tokens); with ``segment_ids``, the mask
    description of the row's documents (:class:`~jaxpar.model.mask.AttentionMask`), which
    replaces the segment ids and document positions in the batch."""
    order = jnp.broadcast_to(jnp.asarray(seq_order, jnp.int32), batch["inputs"].shape)
    if "segment_ids" not in batch:
        return dict(batch, positions=order)
    rest = {k: a for k, a in batch.items() if k not in ("segment_ids", "rope_positions")}
    return dict(rest, positions=AttentionMask(order, batch["segment_ids"],
                                              batch["rope_positions"]))


def train_step_fn(cfg: Config, tx: optax.GradientTransformation,
                  loss_and_grads: Callable) -> Callable:
    """Building a trainer, part 4 of 4, around :func:`loss_and_grads_fn`: ``(state, batch) ->
    (state, metrics)``: AdamW, the non-finite guard, the MoE router-bias update."""
    schedule, moe = learning_rate_schedule(cfg.train), cfg.model.moe

    offload = cfg.train.offload.optimizer

    def train_step(state: TrainState, batch: Batch) -> tuple[TrainState, dict]:
        loss, grads, aux = loss_and_grads(state, batch)
        if offload:  # the host-resident optimizer state, to the device for the update
            state = state._replace(opt_state=jax.device_put(state.opt_state,
                                                            jax.memory.Space.Device))
        updates, opt_state = tx.update(grads, state.opt_state, trained(cfg, state.params))
        params = optax.apply_updates(trained(cfg, state.params), updates)
        if lora_of(cfg) is not None:  # the frozen base weights, as they were
            params = merged(params, base_part(state.params))
        grad_norm = optax.tree.norm(as_float32(grads))
        # A non-finite loss or gradient drops the whole update on device (no host sync): params
        # and optimizer state (whose count drives Adam's bias correction and the lr schedule)
        # stay as they were; `step` still counts the batch consumed. The loop reads `nonfinite`
        # to skip or stop (train.on_nonfinite).
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        params, opt_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old),
                                         (params, opt_state), (state.params, state.opt_state))
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": schedule(state.step),
                   "nonfinite": ~finite}
        buffers = state.buffers
        if moe.enabled:
            metrics.update(moe_metrics(aux, cfg.model,
                                       cfg.train.grad_accum * cfg.train.microbatches))
            if moe.router == "sigmoid_bias":
                # The stacked router biases, one row per MoE layer (the other buffers, the
                # layers' window flags, stay).
                buffers = jax.tree_util.tree_map_with_path(
                    lambda path, b: update_router_bias(b, aux["layer_expert_tokens"],
                                                       moe.bias_update_rate)
                    if getattr(path[-1], "key", None) == "router_bias" else b, buffers)
        if offload:
            opt_state = jax.device_put(opt_state, jax.memory.Space.Host)
        return TrainState(state.step + 1, params, opt_state, buffers), metrics

    return train_step


def check_reduce_dtype(cfg: Config, platform: str) -> None:
    """bfloat16 gradient sums on a platform that cannot compile them
    (:data:`jaxpar.platform.NO_BF16_GRADIENT_SUMS`): a config error here, not a crash.
    ``jaxpar inspect --target tpu-...`` compiles them for a TPU from this machine."""
    if platform in NO_BF16_GRADIENT_SUMS and cfg.parallel.reduce_dtype == "bfloat16":
        raise ConfigError("parallel.reduce_dtype=bfloat16: XLA:CPU cannot compile bfloat16 "
                          "gradient sums; use float32 on CPU (inspect --target tpu-... "
                          "compiles them for a TPU)")


def check_host_memory(cfg: Config, device: Any) -> None:
    """Refuse ``train.offload.optimizer`` and ``remat=offload_dots`` on a platform without
    pinned host memory, before any trace; a device that cannot list its memories passes."""
    asked = [name for name, on in (("train.offload.optimizer=true", cfg.train.offload.optimizer),
                                   ("train.remat=offload_dots",
                                    cfg.train.remat == "offload_dots")) if on]
    if not asked:
        return
    try:
        kinds = sorted({memory.kind for memory in device.addressable_memories()})
    except Exception:  # noqa: BLE001  (compile-only or exotic devices)
        return
    if "pinned_host" not in kinds:
        raise ConfigError(f"{asked[0]}: {device.platform} devices have no pinned_host memory "
                          f"(their memory kinds: {', '.join(kinds) or 'none'}); turn host "
                          "offload off on this platform")


def build_trainer(cfg: Config, mesh: jax.sharding.Mesh) -> Trainer:
    """Resolve every sharding for ``cfg`` (validated) on ``mesh`` and jit init/step. Its four
    parts: docs/train-step.md, "Building the trainer"."""
    logical_axes = trained(cfg, param_logical_axes(abstract_model(
        cfg.model, lora_of(cfg), vocab_rows=cfg.vocab_rows())))
    tx = make_optimizer(cfg.train, logical_axes, muon_specs(cfg, logical_axes))
    check_host_memory(cfg, mesh.devices.flat[0])
    sh = resolve_shardings(cfg, mesh, tx)
    platform = mesh.devices.flat[0].platform
    check_reduce_dtype(cfg, platform)
    model_layout(cfg, cfg.mesh_shape, platform)  # a layout that cannot run fails here
    n_context = cfg.mesh.context
    seq_order = (zigzag_order(cfg.train.seq_len, n_context)
                 if n_context > 1 and cfg.parallel.zigzag else np.arange(cfg.train.seq_len))
    if cfg.mesh.pipe > 1:
        grad_fn, layer_order, program = pipelined_gradients(
            cfg, sh.graphdef, sh.param_specs, sh.logical_axes, dtype=DTYPES[cfg.train.dtype],
            remat=Remat.of_train(cfg.train), platform=platform)
    else:
        grad_fn = plain_gradients(cfg, sh.graphdef, trained(cfg, sh.state.params), platform)
        layer_order = program = None
    grad_shardings = named_shardings(mesh, gradient_specs(cfg, trained(cfg, sh.param_specs),
                                                          trained(cfg, sh.logical_axes)))
    loss_and_grads = loss_and_grads_fn(cfg, grad_fn, seq_order, grad_shardings, platform)

    def init() -> TrainState:
        _, params, buffers = nnx.split(create_model(cfg.model, cfg.train.seed, lora_of(cfg),
                                                    vocab_rows=cfg.vocab_rows()), nnx.Param, ...)
        params = stored_params(nnx.to_pure_dict(params), cfg.train.param_dtype)
        buffers = nnx.to_pure_dict(buffers)
        if layer_order is not None:
            # The buffers too: the layers' window flags differ from layer to layer.
            params, buffers = reorder_layers((params, buffers), layer_order)
        return TrainState(jnp.zeros((), jnp.int32), params, tx.init(trained(cfg, params)),
                          buffers)

    return Trainer(
        cfg=cfg, mesh=mesh, graphdef=sh.graphdef, logical_axes=sh.logical_axes,
        param_specs=sh.param_specs, state_shardings=sh.state, batch_sharding=sh.batch,
        abstract_state=sh.abstract_state, seq_order=seq_order, layer_order=layer_order,
        pipeline=program,
        _init=jax.jit(init, out_shardings=sh.state),
        _step=jax.jit(train_step_fn(cfg, tx, loss_and_grads),
                      in_shardings=(sh.state, sh.batch), out_shardings=(sh.state, None),
                      donate_argnums=0, compiler_options=step_compiler_options(platform, cfg)),
        _loss_and_grads=jax.jit(loss_and_grads, in_shardings=(sh.state, sh.batch),
                                out_shardings=(None, trained(cfg, sh.state.params), None),
                                compiler_options=step_compiler_options(platform, cfg)),
        _reorder=jax.jit(reorder_layers, in_shardings=(sh.state, None),
                         out_shardings=sh.state))


def reorder_layers(tree: Any, order: jax.Array) -> Any:
    """Every array under a ``layers`` key (parameters, gradients, optimizer moments) permuted
    along its stacked first dimension: ``out[i] = tree[order[i]]``. Arrays without that
    dimension (Adafactor's one-element placeholders) stay as they are."""
    def leaf(path: tuple, a: jax.Array) -> jax.Array:
        under_layers = any(getattr(key, "key", None) == "layers" for key in path)
        return a[order] if under_layers and a.ndim > 0 and a.shape[0] == len(order) else a

    return jax.tree_util.tree_map_with_path(leaf, tree)


