"""Attention by fused kernels (cuDNN's, Pallas splash), and the choice of implementation.

``cudnn``: ``jax.nn.dot_product_attention(implementation="cudnn")``; GPU, bfloat16 or float16.
``splash``: JAX's Pallas splash-attention kernel (TPU), one multi-query call per kv head. Both are
causal by storage order. Neither takes per-layer windows; cuDNN takes no document ids and no soft
cap (:func:`resolve`). The parallel layer wraps splash in ``shard_map``
(:mod:`jaxpar.parallel.hooks`). Off a TPU, splash runs in Pallas' interpreter, as the CPU tests do.
Details: docs/attention-and-loss.md, "Splash attention on a TPU" and "Sliding windows and
soft-capped scores".
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxpar.config import ConfigError, ModelConfig
from jaxpar.model.attention import blockwise_attention, dense_attention, group
from jaxpar.model.mask import as_mask

IMPLEMENTATIONS = ("auto", "dense", "blockwise", "cudnn", "splash")
SPLASH_TILE = 128  # the TPU kernel's blocks are multiples of the 128-lane vector width


def resolve(name: str, platform: str, seq_len: int, block: int, dtype,
            splash_possible: bool = True, documents: bool = False,
            model: ModelConfig | None = None) -> str:
    """The implementation ``model.attention=name`` means here.

    ``auto``: cuDNN on a GPU in a 16-bit dtype, without document masks, soft cap or per-layer
    windows. Else splash on a TPU where the sequence tiles into 128-token blocks and
    :func:`jaxpar.platform.splash_possible`. Else blockwise over several blocks, dense within one.
    """
    native = {"cudnn": "gpu", "splash": "tpu"}
    if name in native and platform != native[name]:
        allowed = ", ".join(n for n in IMPLEMENTATIONS if native.get(n, platform) == platform)
        raise ConfigError(f"model.attention={name} needs a {native[name].upper()} (this backend: "
                          f"{platform}); allowed here: {allowed}")
    if name == "splash":
        _check_splash_blocks(seq_len, block)
    if name == "cudnn" and documents:
        raise ConfigError("model.attention=cudnn with data.document_mask=true: cuDNN's JAX API "
                          "takes no document ids; use model.attention=blockwise (or auto), or "
                          "data.document_mask=false")
    per_layer, softcap = _variants(model)
    if name in native and per_layer:
        raise ConfigError(f"model.attention={name} with model.global_every="
                          f"{model.global_every}: its window is static, one for every layer; "
                          "use model.attention=blockwise (or auto), or model.global_every=0")
    if name == "cudnn" and softcap:
        raise ConfigError(f"model.attention=cudnn with model.attn_softcap={model.attn_softcap}: "
                          "cuDNN's JAX API takes no soft cap; use model.attention=blockwise "
                          "(or auto)")
    if name != "auto":
        return name
    if (platform == "gpu" and jnp.dtype(dtype).itemsize == 2 and not documents
            and not per_layer and not softcap):
        return "cudnn"
    size = min(block, seq_len)
    if (platform == "tpu" and splash_possible and not per_layer and seq_len % size == 0
            and size % SPLASH_TILE == 0):
        return "splash"
    return "blockwise" if seq_len > block else "dense"


def _variants(model: ModelConfig | None) -> tuple[bool, bool]:
    """(windows that differ between layers, soft-capped scores) of ``model``."""
    if model is None:
        return False, False
    return model.sliding_window is not None and model.global_every > 0, model.attn_softcap > 0


def static_window(model: ModelConfig | None) -> int | None:
    """The one window every layer shares (what the fused kernels take), else None."""
    if model is None or model.sliding_window is None or model.global_every:
        return None
    return model.sliding_window


def _check_splash_blocks(seq_len: int, block: int) -> None:
    size = min(block, seq_len)
    if seq_len % size or size % SPLASH_TILE:
        raise ConfigError(f"model.attention=splash tiles train.seq_len={seq_len} into blocks of "
                          f"min(model.attention_block={block}, seq_len) = {size} tokens: that "
                          f"block must divide the sequence and be a multiple of {SPLASH_TILE}")


def cudnn_attention(window: int | None = None) -> Callable:
    """cuDNN's fused causal attention (GPU): storage order, one document, no soft cap.

    ``window``: its ``local_window_size=(window - 1, 0)``.
    """
    local = None if window is None else (window - 1, 0)

    def attend(q, k, v, positions=None):
        if positions is not None and as_mask(positions).segments is not None:
            raise ValueError("cudnn attention takes no document ids (data.document_mask=false)")
        if positions is not None and as_mask(positions).softcap:
            raise ValueError("cudnn attention takes no soft cap (model.attn_softcap=0)")
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn",
                                            local_window_size=local)
    return attend


def splash_attention(block: int, interpret: bool = False, window: int | None = None
                     ) -> Callable:
    """``attention(q, k, v, positions)`` by the Pallas splash kernel on one device's arrays.

    ``block``: the tile; ``window``: its ``LocalMask``; ``interpret``: Pallas' interpreter.
    """
    from jax.experimental.pallas.ops.tpu.splash_attention import (  # noqa: PLC0415 (TPU only)
        splash_attention_kernel as splash,
    )
    from jax.experimental.pallas.ops.tpu.splash_attention import (  # noqa: PLC0415
        splash_attention_mask as masks,
    )

    def attend(q, k, v, positions=None):
        b, s, h, d = q.shape
        kv_heads = k.shape[2]
        size = min(block, s)
        sizes = splash.BlockSizes(block_q=size, block_kv=size, block_q_dkv=size,
                                  block_kv_dkv=size, use_fused_bwd_kernel=True)
        # A LocalMask reaching window - 1 keys back and none ahead is causal and windowed.
        one = (masks.CausalMask((s, s)) if window is None else
               masks.LocalMask((s, s), window_size=(window - 1, 0), offset=0))
        causal = masks.MultiHeadMask([one] * (h // kv_heads))
        cap = as_mask(positions).softcap if positions is not None else 0.0
        kernel = splash.make_splash_mqa(causal, block_sizes=sizes, head_shards=1,
                                        q_seq_shards=1, interpret=interpret,
                                        attn_logits_soft_cap=cap or None)
        # [B, S, K, G, D] -> [B, K, G, S, D]: one multi-query call per (sequence, kv head);
        # the kernel does not scale the scores, so the queries are scaled first.
        scaled = q * jnp.asarray(1.0 / math.sqrt(d), q.dtype)
        qg = jnp.transpose(group(scaled, kv_heads), (0, 2, 3, 1, 4))
        kt, vt = (jnp.transpose(x, (0, 2, 1, 3)) for x in (k, v))
        segments = None if positions is None else as_mask(positions).segments
        if segments is None:
            out = jax.vmap(jax.vmap(kernel))(qg, kt, vt)
        else:  # one SegmentIds per sequence, shared by its kv heads
            def one_row(qr, kr, vr, seg):
                ids = splash.SegmentIds(q=seg, kv=seg)
                return jax.vmap(lambda a, b, c: kernel(a, b, c, segment_ids=ids))(qr, kr, vr)
            out = jax.vmap(one_row)(qg, kt, vt, segments)
        return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, s, h, d)
    return attend


def attention_fn(name: str, block: int, model: ModelConfig | None = None) -> Callable:
    """The function of a resolved implementation name (:func:`resolve`).

    The fused kernels take :func:`static_window`.
    """
    if name == "blockwise":
        return blockwise_attention(block)
    if name == "cudnn":
        return cudnn_attention(static_window(model))
    if name == "splash":
        return splash_attention(block, window=static_window(model))
    return dense_attention
