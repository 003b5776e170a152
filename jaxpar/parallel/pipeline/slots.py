"""One round of the pipeline executor on one device: its slots in order (forward, head, backward
or I, W), the stashes they read and write (:class:`Carry`), and the sends over ``pipe``
(:func:`run_round`). What a round reads: :class:`~jaxpar.parallel.pipeline.stage_env.StageEnv`;
the program of rounds: :mod:`jaxpar.parallel.pipeline.program`; the whole:
:mod:`jaxpar.parallel.pipeline.executor`."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

from jaxpar.model.annotate import constrain
from jaxpar.model.projection import RESIDUAL, one_hot_weight_grad
from jaxpar.parallel.pipeline.layerwise import added
from jaxpar.parallel.pipeline.program import Program
from jaxpar.parallel.pipeline.recompute import kept, rebuilt
from jaxpar.parallel.pipeline.stage_env import StageEnv
from jaxpar.parallel.pipeline.stages import (
    PIPE_AXIS,
    embed_partial,
    head_and_loss,
    sum_over_stages,
)
from jaxpar.parallel.point_to_point import ppermute_in_order


class Carry(NamedTuple):
    """What a device carries from round to round: the stashes (one slot per microbatch in
    flight, and a spare one that masked writes go to), the gradient sums and the loss."""

    acts: jax.Array  # [act_slots + 1, *activation]: inputs that arrived for a forward
    res: list  # per residual leaf [res_slots + 1, ...]: what a backward needs
    grads: jax.Array  # [grad_slots + 1, *activation]: output gradients for a backward
    layer_grads: Any  # like the local layers, [v, layers_per_chunk, ...], float32
    shared_grads: Any  # embedding/head (pieces, summed over pipe at the end) and final norm
    # ({} when they are frozen: LoRA)
    loss: jax.Array  # float32: summed token loss (the same on every stage)
    aux: Any  # the chunks' aux sums (layer-stacked keys: [v, layers_per_chunk, ...])
    # With a pre-phase (dense first blocks): [m, *activation], the gradient w.r.t. each
    # microbatch's input to chunk 0 (None without one)
    d_inputs: Any = None
    # Per crossing leaf [wait_slots + 1, ...]: what an I leaves its W (zero bubble's W stash;
    # [] when every backward runs whole)
    waits: list = ()


def put(buffer: jax.Array, slot: jax.Array, value: jax.Array) -> jax.Array:
    return lax.dynamic_update_index_in_dim(buffer, value.astype(buffer.dtype), slot, 0)


def _masked_add(on: jax.Array, total: Any, new: Any) -> Any:
    return jax.tree.map(lambda a, b: a + jnp.where(on, b, jnp.zeros_like(b)).astype(a.dtype),
                        total, new)


def initial_carry(env: StageEnv, program: Program, stash_spec: PartitionSpec,
                  layer_grad_specs: Any, shared_grad_specs: Any) -> Carry:
    def zeros(tree: Any, specs: Any) -> Any:
        return lax.with_sharding_constraint(
            jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), tree), specs)

    # Each stash starts filled with its own value (what a slot holds before its first write
    # is never used): XLA merges equal constant buffers into one and copies it into each
    # carry, which kept one more stash-sized buffer alive (seen: +25% of GPipe's stash).
    wait_shapes = env.wait_shapes() if program.wait_slots else ()
    fills = iter(range(2 + len(env.res_shapes) + len(wait_shapes)))

    def stash(slots: int) -> jax.Array:
        return lax.with_sharding_constraint(
            jnp.full((slots + 1, *env.act.shape), next(fills), env.act.dtype), stash_spec)

    v = jax.tree.leaves(env.chunks)[0].shape[0]
    aux0 = {k: jnp.zeros((v, *a.shape) if k in env.stages.layer_stacked else a.shape, a.dtype)
            for k, a in env.aux_shapes.items()}
    res0 = ([stash(program.res_slots)] if env.stash_inputs  # chunk inputs, laid out as such
            else [jnp.full((program.res_slots + 1, *r.shape), next(fills), r.dtype)
                  for r in env.res_shapes])
    d_inputs = (jnp.zeros_like(env.micro["x0"]) if env.stages.pre_embedded else None)
    shared_grads = zeros(env.shared, shared_grad_specs) if env.train_shared else {}
    waits = [jnp.full((program.wait_slots + 1, *w.shape), next(fills), w.dtype)
             for w in wait_shapes]
    return Carry(stash(program.act_slots), res0, stash(program.grad_slots),
                 zeros(env.chunks, layer_grad_specs), shared_grads,
                 jnp.zeros((), jnp.float32), aux0, d_inputs, waits)


def _add_aux(env: StageEnv, total: dict, aux: dict, j: jax.Array, on: jax.Array) -> dict:
    out = {}
    for k, a in aux.items():
        a = jnp.where(on, a, jnp.zeros_like(a))
        out[k] = total[k].at[j].add(a) if k in env.stages.layer_stacked else total[k] + a
    return out


def _forward_input(env: StageEnv, c: Carry, r: dict) -> jax.Array:
    """What the forward slot's chunk runs on: the embedding (chunk 0) or an arrived input."""
    entering = env.microbatch(r["embed_mb"])
    if env.stages.pre_embedded:  # embedded (and through the dense blocks) before the pipeline
        x0 = entering["x0"]
    else:
        table = env.piece.cut(env.table())
        x0 = sum_over_stages(embed_partial(env.stages, table, env.piece, entering["inputs"]),
                             env.stages.handover_dtype)
    x0 = constrain(x0, RESIDUAL)
    return jnp.where(r["f_first"] == 1, x0.astype(env.act.dtype), c.acts[r["f_in"]])


def _forward_kept(env: StageEnv, c: Carry, r: dict, aux: dict, res: list) -> Carry:
    """The forward's residuals into their stash slot, its aux statistics into the sums."""
    return c._replace(res=[put(buf, r["f_res"], leaf)
                           for buf, leaf in zip(c.res, res, strict=True)],
                      aux=_add_aux(env, c.aux, aux, r["f_chunk"], r["f_on"] == 1))


def _forward_slot(env: StageEnv, c: Carry, r: dict) -> tuple[Carry, jax.Array, list]:
    x = _forward_input(env, c, r)
    (y, aux), res = env.forward(r["f_chunk"], x, env.microbatch(r["f_mb"]))
    res = kept(env, x, res)
    return _forward_kept(env, c, r, aux, res), y, res


def _fused_slots(env: StageEnv, c: Carry, r: dict, input_only: bool,
                 ) -> tuple[Carry, jax.Array, jax.Array, list | None]:
    """The forward slot and the backward slot (B, or I with ``input_only``) in one layer loop
    (``parallel.pipeline_overlap``): (carry, y, dx, what the I left its W or None). The
    schedule never has a backward read this round's forward (``schedules.time_rounds``), so the
    backward's residuals and output gradient are read before anything is written."""
    on, j = r["b_on"] == 1, r["b_chunk"]
    stashed = [buf[r["b_res"]] for buf in c.res]
    (y, aux), res, out, dx = env.forward_backward(
        r["f_chunk"], _forward_input(env, c, r), env.microbatch(r["f_mb"]), j, stashed,
        c.grads[r["b_grad"]], on, input_only)
    c = _forward_kept(env, c, r, aux, res)
    if input_only:
        waits = [put(buf, r["b_wait"], leaf) for buf, leaf in zip(c.waits, out, strict=True)]
        return c._replace(waits=waits), y, dx, out
    return c._replace(layer_grads=added(c.layer_grads, on, j, out)), y, dx, None


def _head_slot(env: StageEnv, c: Carry, r: dict, y: jax.Array) -> Carry:
    on = r["head_on"] == 1
    y_last = sum_over_stages(jnp.where(r["head_last"] == 1, y, jnp.zeros_like(y)),
                             env.stages.handover_dtype)
    norm_params = {k: a for k, a in env.shared.items() if k not in ("embedding", "lm_head")}
    loss, dy, d_head, d_norm = head_and_loss(env.stages, norm_params, env.head(), env.piece,
                                              y_last, env.microbatch(r["head_mb"]),
                                              env.loss_scale)
    if not env.train_shared:  # frozen (LoRA): d_head and d_norm unused (XLA drops them)
        return c._replace(loss=c.loss + jnp.where(on, loss, 0.0),
                          grads=put(c.grads, r["head_dy"], dy))
    shared_grads = _masked_add(on, c.shared_grads, _fill(c.shared_grads, dict(d_norm)))
    # The head piece's gradient into its rows of the sums (VocabPiece.added: in place)
    key, piece, axis = env.stages.edges.head_grad(d_head)
    shared_grads[key] = env.piece.added(shared_grads[key],
                                        jnp.where(on, piece, jnp.zeros_like(piece)), axis)
    return c._replace(loss=c.loss + jnp.where(on, loss, 0.0),
                      grads=put(c.grads, r["head_dy"], dy),
                      shared_grads=shared_grads)


def _stashed(c: Carry, r: dict, prefix: str, fresh: list | None) -> list:
    """The residuals a backward slot reads; if this round's forward wrote them, as made."""
    stashed = [buf[r[f"{prefix}_res"]] for buf in c.res]
    if fresh is not None:
        same = r[f"{prefix}_res"] == r["f_res"]
        stashed = [jnp.where(same, new, old) for new, old in zip(fresh, stashed, strict=True)]
    return stashed


def _backward_slot(env: StageEnv, c: Carry, r: dict, fresh: list | None,
                   ) -> tuple[Carry, jax.Array]:
    """A B: the whole backward of the slot's chunk, its weight gradients added to the sums."""
    on, j = r["b_on"] == 1, r["b_chunk"]
    stashed = rebuilt(env, j, _stashed(c, r, "b", fresh), r["b_mb"])
    layer_grads, dx = env.backward(j, stashed, c.grads[r["b_grad"]], on, c.layer_grads)
    return c._replace(layer_grads=layer_grads), dx


def _input_slot(env: StageEnv, c: Carry, r: dict, fresh: list | None,
                ) -> tuple[Carry, jax.Array, list]:
    """An I: the input gradient, and what its W needs written to the W stash."""
    on, j = r["b_on"] == 1, r["b_chunk"]
    dx, crossing = env.backward_input(j, _stashed(c, r, "b", fresh), c.grads[r["b_grad"]], on)
    waits = [put(buf, r["b_wait"], leaf) for buf, leaf in zip(c.waits, crossing, strict=True)]
    return c._replace(waits=waits), dx, crossing


def _weight_slot(env: StageEnv, c: Carry, r: dict, fresh: list | None,
                 fresh_crossing: list | None) -> Carry:
    """A W: the weight gradients from the residuals and what the I left (as made, if this
    round's I wrote them), added to the sums."""
    on, j = r["w_on"] == 1, r["w_chunk"]
    crossing = [buf[r["w_wait"]] for buf in c.waits]
    if fresh_crossing is not None:
        same = r["w_wait"] == r["b_wait"]
        crossing = [jnp.where(same, new, old)
                    for new, old in zip(fresh_crossing, crossing, strict=True)]
    return c._replace(layer_grads=env.backward_weights(j, _stashed(c, r, "w", fresh), crossing,
                                                       c.layer_grads, on))


def _embedding_backward(env: StageEnv, c: Carry, r: dict, dx: jax.Array) -> Carry:
    into_first = (r["b_on"] == 1) & (r["b_first"] == 1)
    dx0 = sum_over_stages(jnp.where(into_first, dx, jnp.zeros_like(dx)),
                          env.stages.handover_dtype)
    if env.stages.pre_embedded:  # handed back out: the pre-phase's VJP takes it from there
        on = r["eback_on"] == 1
        d_in = lax.dynamic_index_in_dim(c.d_inputs, r["eback_mb"], 0, keepdims=False)
        return c._replace(d_inputs=put(c.d_inputs, r["eback_mb"],
                                        d_in + jnp.where(on, dx0, jnp.zeros_like(dx0))))
    tokens = env.microbatch(r["eback_mb"])["inputs"]
    # The strided slices keep each tensor block's rows on its device (the piece's rows are
    # [shards, block] and the pieces divide the block).
    dx0 = env.stages.edges.scaled(dx0)  # the gradient of the scaled rows
    d_table = one_hot_weight_grad(env.piece.ids, tokens, dx0, env.stages.embedding_grad_pieces,
                                  jnp.float32)
    d_table = jnp.where(r["eback_on"] == 1, d_table, jnp.zeros_like(d_table))
    return c._replace(shared_grads={
        **c.shared_grads, "embedding": env.piece.added(c.shared_grads["embedding"], d_table)})


def run_program(env: StageEnv, program: Program, carry: Carry) -> Carry:
    """Every round of ``program``, stretch by stretch: each stretch one ``lax.scan`` over the
    repeats of its pattern, whose body runs the pattern's rounds in order."""
    for stretch in program.stretches:
        fields = {k: jnp.asarray(a) for k, a in stretch.fields.items()}

        def rounds(c: Carry, rows: dict, pattern: tuple = stretch.pattern) -> tuple[Carry, None]:
            for i, kinds in enumerate(pattern):
                c = run_round(env, kinds, c, {k: a[i] for k, a in rows.items()})
            return c, None

        carry, _ = lax.scan(rounds, carry, fields)
    return carry


def run_round(env: StageEnv, kinds: tuple[str, ...], c: Carry, row: dict) -> Carry:
    """One round of a stretch of ``kinds`` (the scan body): the slots in order, the head after
    the forward (in rounds where a stage's forward is the last chunk), then the sends. ``row``
    holds every field for every stage; each device reads its own column."""
    r = {k: a[env.stage] for k, a in row.items()}
    send_fwd = send_bwd = fresh = crossing = None
    if env.overlap and "F" in kinds and ("B" in kinds or "I" in kinds):
        c, send_fwd, send_bwd, crossing = _fused_slots(env, c, r, "I" in kinds)
        if "H" in kinds:
            c = _head_slot(env, c, r, send_fwd)
    else:
        if "F" in kinds:
            c, send_fwd, fresh = _forward_slot(env, c, r)
            if "H" in kinds:
                c = _head_slot(env, c, r, send_fwd)
        if "B" in kinds:
            c, send_bwd = _backward_slot(env, c, r, fresh)
        elif "I" in kinds:
            c, send_bwd, crossing = _input_slot(env, c, r, fresh)
    if send_bwd is not None and (env.train_shared or env.stages.pre_embedded):
        c = _embedding_backward(env, c, r, send_bwd)
    if "W" in kinds:
        c = _weight_slot(env, c, r, fresh, crossing)
    return _send(env, c, r, send_fwd, send_bwd)


def _send(env: StageEnv, c: Carry, r: dict, y: jax.Array | None, dx: jax.Array | None,
          ) -> Carry:
    """The round's sends over ``pipe``, and where what arrives is kept. On the ring, activations
    go on to the next device and input gradients back to the previous one (two ``ppermute``s).
    In the V (``dualpipe_v``) the first half of the chunks goes down the devices and the second
    back up, so each goes both ways, masked by where it is kept (four ``ppermute``s: twice the
    ring's bytes), and the device at the bottom hands its own output to itself. In one order
    on every device, since independent ppermutes can cross on XLA:CPU
    (parallel/point_to_point.py)."""
    p = env.piece.p
    ring = env.placement == "ring"

    def pairs(shift: int) -> list[tuple[int, int]]:
        return [(s, (s + shift) % p) for s in range(p) if ring or 0 <= s + shift < p]

    routes = [(y, 1, "acts", "recv_act"), (dx, -1, "grads", "recv_grad")]
    if not ring:
        routes += [(y, -1, "acts", "recv_act_back"), (dx, 1, "grads", "recv_grad_back")]
    routes = [route for route in routes if route[0] is not None]
    arrived = ppermute_in_order([x for x, *_ in routes], PIPE_AXIS,
                                [pairs(shift) for _, shift, *_ in routes])
    for (_, _, stash, field), x in zip(routes, arrived, strict=True):
        c = c._replace(**{stash: put(getattr(c, stash), r[field], x)})
    if not ring:  # the bottom of the V keeps its own (a spare slot everywhere else)
        if y is not None:
            c = c._replace(acts=put(c.acts, r["keep_act"], y))
        if dx is not None:
            c = c._replace(grads=put(c.grads, r["keep_grad"], dx))
    return c


def _fill(like: dict, some: dict) -> dict:
    """``some`` completed with zeros for the keys of ``like`` it lacks."""
    return {k: some[k] if k in some else jax.tree.map(jnp.zeros_like, a)
            for k, a in like.items()}


def finish(env: StageEnv, c: Carry) -> tuple:
    def stacked(a: jax.Array) -> jax.Array:
        return a.reshape(-1, *a.shape[2:])

    stages = env.stages
    layer_grads = jax.tree.map(stacked, c.layer_grads)
    shared_grads = c.shared_grads
    aux_sums = {k: lax.psum(a, PIPE_AXIS) for k, a in c.aux.items()
                if k not in stages.layer_stacked}
    aux_layers = {k: stacked(a) for k, a in c.aux.items() if k in stages.layer_stacked}
    return c.loss, shared_grads, layer_grads, aux_sums, aux_layers


