"""Checks that need an NVIDIA GPU: cuDNN's fused attention (``model.attention=cudnn``, what
``auto`` picks on a GPU in bf16) against jax's XLA attention, output and gradients.

The test process itself runs on 8 virtual CPU devices (conftest.py), so the GPU work runs in a
subprocess with the CUDA backend. Without a CUDA build of jax (``pip install 'jax[cuda13]'``)
and a GPU the test skips, saying which is missing.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys

import pytest

CUDA_PLUGINS = ("jax_cuda13_plugin", "jax_cuda12_plugin")

CHECK = r"""
import jax, jax.numpy as jnp
from jaxpar.model.fused import attention_fn, resolve
assert jax.default_backend() == "gpu", jax.default_backend()
name = resolve("auto", "gpu", 1024, 512, "bfloat16")
assert name == "cudnn", name
kq, kk, kv, kw = jax.random.split(jax.random.key(0), 4)
q = 2 * jax.random.normal(kq, (2, 1024, 8, 128))  # peaked softmaxes: a wrong mask shows
k = 2 * jax.random.normal(kk, (2, 1024, 2, 128))
v = jax.random.normal(kv, (2, 1024, 2, 128))
w = jax.random.normal(kw, q.shape)

def xla(q, k, v, positions=None):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")

def run(fn, dtype):
    def loss(q, k, v):
        out = fn(*(a.astype(dtype) for a in (q, k, v)))
        return jnp.sum(out.astype(jnp.float32) * w), out.astype(jnp.float32)
    grads, out = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    return out, grads

out, grads = run(attention_fn(name, 512), jnp.bfloat16)
want_out, want_grads = run(xla, jnp.float32)
err = float(jnp.abs(out - want_out).max())
assert err < 0.05, err
for g, r in zip(grads, want_grads):
    rel = float(jnp.linalg.norm(g - r) / jnp.linalg.norm(r))
    assert rel < 0.02, rel
print("cudnn ok", err)
"""


def _missing_gpu() -> str | None:
    if not any(importlib.util.find_spec(p) for p in CUDA_PLUGINS):
        return "no CUDA build of jax installed (pip install 'jax[cuda13]')"
    if shutil.which("nvidia-smi") is None:
        return "no NVIDIA GPU on this machine (nvidia-smi not found)"
    return None


@pytest.mark.skipif(_missing_gpu() is not None, reason=str(_missing_gpu()))
def test_cudnn_attention_matches_xla_attention_on_a_gpu():
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["JAX_PLATFORMS"] = "cuda"
    result = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True,
                            timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "cudnn ok" in result.stdout
