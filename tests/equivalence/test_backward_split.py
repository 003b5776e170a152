"""The backward pass cut into I and W by its equations (jaxpar/parallel/pipeline/backward_split.py),
on small functions shaped like a pipeline chunk: a scan over layers of custom-VJP matmuls and a
norm, under each remat policy. I then W must give exactly the whole backward's gradients; every
matmul of the backward must run in exactly one of the two (W only the weight-gradient ones); and
W must read nothing of the cotangent but what crosses. The executor's use of it (zero bubble,
DualPipe-V, against one device): test_pipeline.py."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from jaxpar.parallel.pipeline.backward_split import split_backward


@partial(jax.custom_vjp)
def _matmul(x, w):
    return x @ w


def _matmul_fwd(x, w):
    return x @ w, (x, w)


def _matmul_bwd(residuals, dy):
    x, w = residuals
    return dy @ w.T, jnp.einsum("bi,bo->io", x, dy)


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


def _layer(x, p):
    h = x * p["scale"]  # a norm's scale: its gradient is a reduction, not a matmul
    h = jnp.tanh(_matmul(h, p["w1"]))
    return x + _matmul(h, p["w2"]) + h @ p["w3"], None  # w3: autodiff's own transpose


POLICIES = {"none": None, "dots": jax.checkpoint_policies.dots_saveable,
            "full": jax.checkpoint_policies.nothing_saveable}
L, B, E = 3, 4, 8


def _chunk(policy):
    def run(params, x):
        if "shared" in params:  # closed over by every layer: a const of the loop, whose
            def layer(x, p):    # gradient the transposed loop carries
                y, _ = _layer(x, p)
                return _matmul(y, params["shared"]), None
            stacked = params["layers"]
        else:
            layer, stacked = _layer, params
        body = layer if policy is None else jax.checkpoint(layer, policy=policy)
        y, _ = lax.scan(body, x, stacked)
        return y
    return run


def _problem(policy, closed_over=False):
    keys = jax.random.split(jax.random.key(0), 5)
    params = {"scale": jax.random.normal(keys[0], (L, E)),
              "w1": jax.random.normal(keys[1], (L, E, E)) * 0.3,
              "w2": jax.random.normal(keys[2], (L, E, E)) * 0.3,
              "w3": jax.random.normal(keys[3], (L, E, E)) * 0.3}
    if closed_over:
        params = {"layers": params, "shared": jax.random.normal(keys[0], (E, E)) * 0.3}
    x = jax.random.normal(keys[4], (B, E))
    y, vjp = jax.vjp(_chunk(policy), params, x)
    leaves, treedef = jax.tree.flatten(vjp)

    def backward(primals, cotangents):
        return jax.tree.unflatten(treedef, primals)(cotangents)

    return backward, leaves, y


def _dots(jaxpr) -> int:
    count = 0
    for eqn in jaxpr.eqns:
        count += eqn.primitive.name == "dot_general"
        for value in eqn.params.values():
            inner = getattr(value, "jaxpr", value)
            if hasattr(inner, "eqns"):
                count += _dots(inner)
    return count


@pytest.mark.parametrize("closed_over", [False, True], ids=["stacked", "shared-weight"])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_i_then_w_give_the_whole_backwards_gradients(policy, closed_over):
    backward, primals, dy = _problem(POLICIES[policy], closed_over)
    split = split_backward(backward, primals, dy)
    dx, crossing = split.input_part(primals, dy)
    grads = split.weight_part(primals, crossing)
    want_grads, want_dx = backward(primals, dy)
    np.testing.assert_allclose(dx, want_dx, rtol=1e-6, atol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), grads,
                 want_grads)
    assert [tuple(c.shape) for c in crossing] == [c.shape for c in split.crossing_shapes]


@pytest.mark.parametrize("policy", list(POLICIES))
def test_every_matmul_of_the_backward_runs_once_and_w_runs_only_weight_gradients(policy):
    backward, primals, dy = _problem(POLICIES[policy])
    split = split_backward(backward, primals, dy)
    crossing = [jnp.zeros(c.shape, c.dtype) for c in split.crossing_shapes]
    whole = _dots(jax.make_jaxpr(backward)(primals, dy).jaxpr)
    i_part = _dots(jax.make_jaxpr(split.input_part)(primals, dy).jaxpr)
    w_part = _dots(jax.make_jaxpr(split.weight_part)(primals, crossing).jaxpr)
    assert i_part + w_part == whole
    assert w_part == 3  # w1, w2, w3: one weight-gradient matmul each, in the loop's body


def test_what_crosses_is_each_matmuls_output_gradient_and_under_full_remat_its_input():
    # Per layer: w1's and w2's (= w3's) output gradients, and the scales' gradients, which a
    # reduction of I's values makes; full remat adds the recomputed input of w2 and w3.
    none = split_backward(*_problem(None)).crossing_shapes
    full = split_backward(*_problem(POLICIES["full"])).crossing_shapes
    assert sorted(c.shape for c in none) == [(L, B, E), (L, B, E), (L, E)]
    assert sorted(c.shape for c in full) == [(L, B, E), (L, B, E), (L, B, E), (L, E)]


def test_w_reads_the_residuals_and_what_crosses_never_the_output_gradient_itself():
    backward, primals, dy = _problem(None)
    split = split_backward(backward, primals, dy)
    crossing = split.input_part(primals, dy)[1]
    # W traced without the cotangent: it has none to read.
    grads = jax.jit(split.weight_part)(primals, crossing)
    assert jax.tree.structure(grads) == jax.tree.structure(backward(primals, dy)[0])
    assert len(split.primal_reads) == len(primals) and any(split.primal_reads)
