"""A stage's backward pass cut in two without recomputing anything: I, then W.

Zero-bubble schedules split a chunk's backward ``B`` into ``I`` (the input gradient, which the
previous stage waits for) and ``W`` (the weight gradients, which nobody waits for). For
``y = x w``, I computes ``dx = dy wᵀ`` and W ``dw = xᵀ dy``; W needs ``dy``, which only I
makes, so such *crossing* values wait in a stash between a microbatch's I and its W.

The backward is traced once to a jaxpr and its equations sorted; loops are cut through. Every
matmul runs in exactly one part, so ``zero_bubble``'s matmul flops are 1F1B's. It works on any
layer, but walks jaxpr structures a new jax may change (``scripts/newest_jax.py`` tests the
newest). :func:`split_backward` reports the crossing shapes (the executor's stash, ``jaxpar
plan``). Sorting rules: docs/pipelines.md, "Zero bubble: I and W apart, nothing recomputed".
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
from jax import lax
from jax.extend import core as jcore

# Equations whose work W exists to defer, and which are never computed twice.
HEAVY = frozenset({"dot_general", "ragged_dot_general", "conv_general_dilated"})
# Inlined before the sort: they only wrap equations (remat's recomputation, nested jit).
INLINED = frozenset({"remat2", "checkpoint", "pjit", "jit", "closed_call", "core_call"})
# Never run twice (communication), whatever their size.
COLLECTIVES = frozenset({"psum", "pmax", "pmin", "ppermute", "all_gather", "all_to_all",
                         "psum_scatter", "reduce_scatter", "ragged_all_to_all",
                         "all_gather_invariant", "psum_invariant", "pbroadcast"})


# --------------------------------------------------------------------------------------------
# A jaxpr, flattened: inlined wrappers, every variable named by a key unique in the whole tree


@dataclass(frozen=True, eq=False)  # compared and hashed by identity
class _Lit:
    val: Any


@dataclass
class _Op:
    eqn: Any  # the jaxpr equation (primitive, params)
    ins: list  # keys or _Lit
    outs: list  # keys (None: dropped)
    body: _Body | None = None  # a scan's flattened body


@dataclass
class _Body:
    ins: list  # keys of the inputs (a scan body's: consts, carries, xs)
    outs: list  # keys or _Lit
    ops: list[_Op]
    consts: dict  # key -> value of the jaxpr's constants
    in_avals: dict  # key -> abstract value of each input


_keys = itertools.count()


def _flatten(jaxpr: Any, consts: Sequence) -> _Body:
    env: dict = {}

    def key_of(v: Any) -> Any:
        if isinstance(v, jcore.Literal):
            return _Lit(v.val)
        return env[v]

    def new(v: Any) -> Any:
        if isinstance(v, jcore.DropVar):
            return None
        env[v] = k = next(_keys)
        return k

    const_keys = [new(v) for v in jaxpr.constvars]
    ins = [new(v) for v in jaxpr.invars]
    ops: list[_Op] = []
    _inline_into(jaxpr.eqns, env, key_of, new, ops)
    return _Body(ins, [key_of(v) for v in jaxpr.outvars], ops,
                 dict(zip(const_keys, consts, strict=True)),
                 {k: v.aval for k, v in zip(ins, jaxpr.invars, strict=True)})


def _inline_into(eqns: Sequence, env: dict, key_of: Callable, new: Callable, ops: list,
                 ) -> None:
    for eqn in eqns:
        name = eqn.primitive.name
        if name in INLINED:
            inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
            inner_jaxpr, inner_consts = ((inner.jaxpr, inner.consts)
                                         if hasattr(inner, "consts") else (inner, []))
            sub_env: dict = {}
            for v, c in zip(inner_jaxpr.constvars, inner_consts, strict=True):
                sub_env[v] = _Lit(c)
            for v, outer in zip(inner_jaxpr.invars, eqn.invars, strict=True):
                sub_env[v] = key_of(outer)

            def sub_key(v, sub_env=sub_env):
                return _Lit(v.val) if isinstance(v, jcore.Literal) else sub_env[v]

            def sub_new(v, sub_env=sub_env):
                if isinstance(v, jcore.DropVar):
                    return None
                sub_env[v] = k = next(_keys)
                return k

            _inline_into(inner_jaxpr.eqns, sub_env, sub_key, sub_new, ops)
            for v, inner_out in zip(eqn.outvars, inner_jaxpr.outvars, strict=True):
                if not isinstance(v, jcore.DropVar):
                    env[v] = sub_key(inner_out)
            continue
        ins = [key_of(v) for v in eqn.invars]
        body = None
        if name == "scan":
            closed = eqn.params["jaxpr"]
            body = _flatten(closed.jaxpr, closed.consts)
        ops.append(_Op(eqn, ins, [new(v) for v in eqn.outvars], body))


def _heavy(op: _Op) -> bool:
    """Matmuls, loops and anything holding a matmul: never computed twice."""
    name = op.eqn.primitive.name
    if name in HEAVY or name in COLLECTIVES or op.body is not None:
        return True
    return any(_jaxpr_has_heavy(v) for v in op.eqn.params.values())


def _jaxpr_has_heavy(value: Any) -> bool:
    jaxpr = getattr(value, "jaxpr", value)
    if not hasattr(jaxpr, "eqns"):
        return False
    return any(e.primitive.name in HEAVY | COLLECTIVES
               or any(_jaxpr_has_heavy(v) for v in e.params.values()) for e in jaxpr.eqns)


def _scan_layout(op: _Op) -> tuple[int, int]:
    return op.eqn.params["num_consts"], op.eqn.params["num_carry"]


# --------------------------------------------------------------------------------------------
# Liveness: which inputs an output needs (loops to a fixed point over their carries)


def _needed_ins(body: _Body, needed_outs: Sequence[bool]) -> tuple[list[bool], dict]:
    """Which ``body.ins`` the ``needed_outs`` read, and per op (by id) which outputs they read."""
    needed = {k for k, want in zip(body.outs, needed_outs, strict=True)
              if want and not isinstance(k, _Lit)}
    live_outs: dict[int, list[bool]] = {}
    for op in reversed(body.ops):
        outs_needed = [k is not None and k in needed for k in op.outs]
        if not any(outs_needed):
            continue
        live_outs[id(op)] = outs_needed
        for k, want in zip(op.ins, _op_needed_ins(op, outs_needed), strict=True):
            if want and not isinstance(k, _Lit):
                needed.add(k)
    return [k in needed for k in body.ins], live_outs


def _op_needed_ins(op: _Op, outs_needed: Sequence[bool]) -> list[bool]:
    if op.body is None:
        return [True] * len(op.ins)
    n_consts, n_carry = _scan_layout(op)
    carries, ins_needed = _needed_carries(op, outs_needed)
    return ins_needed[:n_consts] + carries + ins_needed[n_consts + n_carry:]


def _needed_carries(op: _Op, outs_needed: Sequence[bool]) -> tuple[list[bool], list[bool]]:
    """A scan's carries the marked outputs need (to a fixed point: its output is needed, or a
    needed output reads its input), and the body inputs they read."""
    n_consts, n_carry = _scan_layout(op)
    carries = list(outs_needed[:n_carry])
    ys = list(outs_needed[n_carry:])
    while True:
        ins_needed, _ = _needed_ins(op.body, carries + ys)
        grown = [c or i for c, i in zip(carries, ins_needed[n_consts:n_consts + n_carry],
                                        strict=True)]
        if grown == carries:
            return carries, ins_needed
        carries = grown


# --------------------------------------------------------------------------------------------
# The plan: which ops run in I, in W, in both; what crosses


@dataclass
class _ScanSplit:
    """How a scan is cut: its carries by part, and its body's plan."""

    i_carry: list[bool]  # carries I runs (the rest: W's)
    i_ys: list[bool]  # outputs (ys) I makes
    w_ys: list[bool]  # outputs (ys) W makes
    plan: _Plan


@dataclass
class _Plan:
    body: _Body
    role: dict  # id(op) -> "I", "W", "IW" (both: cheap, of the residuals alone) or "split"
    splits: dict  # id(op) -> _ScanSplit
    crossing: list  # keys I makes and W reads, in order (a split scan's: its stacked ones)
    w_reads: set  # keys of body.ins that W reads
    i_reads: set  # keys of body.ins that I reads
    extra: dict = field(default_factory=dict)  # id(split op) -> keys of its stacked crossing


def _plan(body: _Body, i_outs: Sequence[bool], w_outs: Sequence[bool],
          w_inputs: set) -> _Plan:
    """Sort ``body``'s ops: I makes ``i_outs``, W ``w_outs``. ``w_inputs``: ``body.ins`` keys W
    has; the rest (the cotangent, a carry I runs) are I's, and what W needs of them crosses."""
    _, i_live = _needed_ins(body, i_outs)
    _, w_live = _needed_ins(body, w_outs)
    role: dict = {}
    splits: dict = {}
    made_by: dict = {}  # key -> op
    # Values that need none of I's work, and those computed from them cheaply: W may
    # recompute these rather than wait for them in the stash.
    cheap = set(w_inputs) | set(body.consts)
    w_made: set = set()
    for op in body.ops:
        for k in op.outs:
            if k is not None:
                made_by[k] = op
        ins = [k for k in op.ins if not isinstance(k, _Lit)]
        if not _heavy(op) and not op.eqn.effects and all(k in cheap for k in ins):
            cheap.update(k for k in op.outs if k is not None)
        i_needed = i_live.get(id(op))
        w_needed = w_live.get(id(op)) or [False] * len(op.outs)
        if i_needed is not None:
            w_only = [w and not i for w, i in zip(w_needed, i_needed, strict=True)]
            if op.body is not None and any(w_only):
                splits[id(op)] = _split_scan(op, i_needed, w_only)
                role[id(op)] = "split"
                w_made.update(_w_outs_of(op, splits[id(op)]))
            else:
                role[id(op)] = "I"
        elif any(w_needed):
            if _heavy(op) or all(k in cheap or k in w_made for k in ins) or any(
                    k in w_made for k in ins):
                role[id(op)] = "W"
                w_made.update(k for k in op.outs if k is not None)
            else:  # a small leftover of I's values (a reduction): its result crosses
                role[id(op)] = "I"
    plan = _Plan(body, role, splits, [], set(), set())
    _close(plan, made_by, cheap, i_outs, w_outs, w_inputs)
    return plan


def _split_scan(op: _Op, i_needed: Sequence[bool], w_only: Sequence[bool]) -> _ScanSplit:
    n_consts, n_carry = _scan_layout(op)
    carries, _ = _needed_carries(op, i_needed)  # the carries I runs
    ys_i = list(i_needed[n_carry:])
    w_carry = [not c and w for c, w in zip(carries, w_only[:n_carry], strict=True)]
    body = op.body
    # In the body W has the consts and xs (the scan passes them, or their crossing, in) and
    # its own carries; I's carries it has only where they cross, stacked per iteration.
    w_inputs = {k for i, k in enumerate(body.ins)
                if i < n_consts or i >= n_consts + n_carry or w_carry[i - n_consts]}
    plan = _plan(body, carries + ys_i, w_carry + list(w_only[n_carry:]), w_inputs)
    return _ScanSplit(carries, ys_i, list(w_only[n_carry:]), plan)


def _close(plan: _Plan, made_by: dict, cheap: set, i_outs: Sequence[bool],
           w_outs: Sequence[bool], w_inputs: set) -> None:
    """What W reads, back from its ops and outputs: cheap values of the residuals are recomputed
    ("IW"), anything else I made crosses. Then each part's reads of the body's inputs."""
    body, role, splits = plan.body, plan.role, plan.splits
    seen: set = set()

    def need(k: Any) -> None:
        if isinstance(k, _Lit) or k in seen or k in body.consts:
            return
        seen.add(k)
        if k in w_inputs:
            plan.w_reads.add(k)
            return
        op = made_by.get(k)
        r = None if op is None else role.get(id(op))
        if r in ("W", "IW") or (r == "split" and k in _w_outs_of(op, splits[id(op)])):
            return
        if r == "I" and k in cheap:
            role[id(op)] = "IW"
            for k2 in op.ins:
                need(k2)
            return
        plan.crossing.append(k)  # made by I (or an input only I has: the cotangent)

    for op in body.ops:
        r = role.get(id(op))
        if r == "W":
            for k in op.ins:
                need(k)
        elif r == "split":
            for k in _w_ins_of(op, splits[id(op)]):
                need(k)
            plan.extra[id(op)] = [next(_keys) for _ in splits[id(op)].plan.crossing]
            plan.crossing.extend(plan.extra[id(op)])
    for k, want in zip(body.outs, w_outs, strict=True):
        if want:
            need(k)
    read_by_i = set(plan.crossing)
    read_by_i.update(k for k, want in zip(body.outs, i_outs, strict=True) if want)
    for op in body.ops:
        r = role.get(id(op))
        if r in ("I", "IW"):
            read_by_i.update(op.ins)
        elif r == "split":
            read_by_i.update(_i_ins_of(op, splits[id(op)]))
    plan.i_reads.update(k for k in body.ins if k in read_by_i)


def _w_outs_of(op: _Op, split: _ScanSplit) -> set:
    """A split scan's outputs W makes: W's carries and ys."""
    want = [not c for c in split.i_carry] + split.w_ys
    return {k for k, w in zip(op.outs, want, strict=True) if w and k is not None}


def _scan_part_ins(op: _Op, reads: set, carries: Sequence[bool]) -> list:
    """The scan operands one part reads: its consts and xs, and its carries' initial values."""
    n_consts, n_carry = _scan_layout(op)
    out = []
    for i, (k, inner) in enumerate(zip(op.ins, op.body.ins, strict=True)):
        if n_consts <= i < n_consts + n_carry:
            if carries[i - n_consts]:
                out.append(k)
        elif inner in reads:
            out.append(k)
    return out


def _w_ins_of(op: _Op, split: _ScanSplit) -> list:
    return _scan_part_ins(op, split.plan.w_reads, [not c for c in split.i_carry])


def _i_ins_of(op: _Op, split: _ScanSplit) -> list:
    return _scan_part_ins(op, split.plan.i_reads, split.i_carry)


# --------------------------------------------------------------------------------------------
# Running a part


def _read(env: dict, k: Any) -> Any:
    return k.val if isinstance(k, _Lit) else env[k]


def _bind(op: _Op, env: dict) -> None:
    eqn = op.eqn
    params = eqn.primitive.get_bind_params(eqn.params)
    out = eqn.primitive.bind(*[_read(env, k) for k in op.ins], **params)
    outs = out if eqn.primitive.multiple_results else [out]
    for k, value in zip(op.outs, outs, strict=True):
        if k is not None:
            env[k] = value


def _run(plan: _Plan, env: dict, part: str) -> None:
    """Run ``plan``'s ``part`` ("I" or "W") of its body's ops in ``env`` (keys -> values)."""
    env.update(plan.body.consts)
    for op in plan.body.ops:
        r = plan.role.get(id(op))
        if r == part or r == "IW":
            _bind(op, env)
        elif r == "split":
            _run_scan(plan, op, env, part)


def _run_scan(plan: _Plan, op: _Op, env: dict, part: str) -> None:
    """A split scan's ``part`` as a ``lax.scan`` of its body part; I also emits each iteration's
    crossing values (stacked), which W reads as more xs."""
    split = plan.splits[id(op)]
    sub = split.plan
    n_consts, n_carry = _scan_layout(op)
    body, length = op.body, op.eqn.params["length"]
    reads = sub.i_reads if part == "I" else sub.w_reads
    carried = split.i_carry if part == "I" else [not c for c in split.i_carry]
    made = split.i_ys if part == "I" else split.w_ys
    consts = {k: _read(env, o) for k, o in zip(body.ins[:n_consts], op.ins[:n_consts],
                                               strict=True) if k in reads}
    xs = [(k, _read(env, o)) for k, o in zip(body.ins[n_consts + n_carry:],
                                             op.ins[n_consts + n_carry:], strict=True)
          if k in reads]
    if part == "W":
        xs += list(zip(sub.crossing, [env[k] for k in plan.extra[id(op)]], strict=True))
    carries = [(k, o, out) for k, o, out, c in zip(
        body.ins[n_consts:n_consts + n_carry], op.ins[n_consts:n_consts + n_carry],
        body.outs[:n_carry], carried, strict=True) if c]
    ys_outs = [k for k, y in zip(body.outs[n_carry:], made, strict=True) if y]

    def iteration(carry: list, x: list) -> tuple:
        inner = {**consts, **dict(zip([k for k, _, _ in carries], carry, strict=True)),
                 **dict(zip([k for k, _ in xs], x, strict=True))}
        _run(sub, inner, part)
        ys = [_read(inner, k) for k in ys_outs]
        if part == "I":
            ys = [ys, [inner[k] for k in sub.crossing]]
        return [_read(inner, out) for _, _, out in carries], ys

    p = op.eqn.params
    carry, ys = lax.scan(iteration, [_read(env, o) for _, o, _ in carries], [v for _, v in xs],
                         length=length, reverse=p["reverse"], unroll=p["unroll"])
    if part == "I":
        ys, crossing = ys
        env.update(zip(plan.extra[id(op)], crossing, strict=True))
    outs = ([k for k, c in zip(op.outs[:n_carry], carried, strict=True) if c]
            + [k for k, y in zip(op.outs[n_carry:], made, strict=True) if y])
    env.update((k, v) for k, v in zip(outs, [*carry, *ys], strict=True) if k is not None)


# --------------------------------------------------------------------------------------------
# The two parts as functions


@dataclass(frozen=True)
class SplitBackward:
    """``bwd(primals, cotangents) -> (weight_grads, input_grad)`` cut in two:
    ``input_part(primals, cotangents) -> (input_grad, crossing)`` and
    ``weight_part(primals, crossing) -> weight_grads``; ``crossing``: arrays of
    ``crossing_shapes``."""

    plan: _Plan
    primal_tree: Any
    cotangent_tree: Any
    out_tree: Any
    n_weight_grads: int
    crossing_shapes: tuple
    primal_reads: tuple  # per leaf of the primals: whether W reads it

    def input_part(self, primals: Any, cotangents: Any) -> tuple[Any, list]:
        env = dict(zip(self.plan.body.ins, jax.tree.leaves((primals, cotangents)),
                       strict=True))
        _run(self.plan, env, "I")
        dx = [_read(env, k) for k in self.plan.body.outs[self.n_weight_grads:]]
        _, dx_tree = self.out_tree
        return jax.tree.unflatten(dx_tree, dx), [env[k] for k in self.plan.crossing]

    def weight_part(self, primals: Any, crossing: Sequence) -> Any:
        n_primal = len(jax.tree.leaves(primals))
        env = dict(zip(self.plan.body.ins[:n_primal], jax.tree.leaves(primals), strict=True))
        env.update(zip(self.plan.crossing, crossing, strict=True))
        _run(self.plan, env, "W")
        grads = [_read(env, k) for k in self.plan.body.outs[:self.n_weight_grads]]
        grads_tree, _ = self.out_tree
        return jax.tree.unflatten(grads_tree, grads)


def split_backward(bwd: Callable, primals: Any, cotangents: Any) -> SplitBackward:
    """Trace ``bwd(primals, cotangents) -> (weight_grads, input_grad)`` (abstract values suffice)
    and cut it into I and W. ``primals``: what both parts may read (stashed residuals, weights);
    ``cotangents``: what only I reads."""
    closed, out_shape = jax.make_jaxpr(bwd, return_shape=True)(primals, cotangents)
    grads_shape, dx_shape = out_shape
    n_grads = len(jax.tree.leaves(grads_shape))
    body = _flatten(closed.jaxpr, closed.consts)
    n_primal = len(jax.tree.leaves(primals))
    n_out = len(body.outs)
    plan = _plan(body, [i >= n_grads for i in range(n_out)], [i < n_grads for i in range(n_out)],
                 set(body.ins[:n_primal]))
    shapes = tuple(_shape_of(plan, k) for k in plan.crossing)
    return SplitBackward(plan, jax.tree.structure(primals), jax.tree.structure(cotangents),
                         (jax.tree.structure(grads_shape), jax.tree.structure(dx_shape)),
                         n_grads, shapes,
                         tuple(k in plan.w_reads for k in body.ins[:n_primal]))


def _shape_of(plan: _Plan, key: Any) -> jax.ShapeDtypeStruct:
    """A crossing value's shape: an input's, an op output's, or a split scan body's stacked over
    its iterations."""
    aval = plan.body.in_avals.get(key)
    for op in plan.body.ops:
        if aval is not None:
            break
        if key in op.outs:
            aval = op.eqn.outvars[op.outs.index(key)].aval
        elif key in plan.extra.get(id(op), ()):
            sub = plan.splits[id(op)].plan
            inner = _shape_of(sub, sub.crossing[plan.extra[id(op)].index(key)])
            return jax.ShapeDtypeStruct((op.eqn.params["length"], *inner.shape), inner.dtype)
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype)
