"""Which Hugging Face tensor is which jaxpar parameter, and how their layouts differ.

Names (``L`` a layer, ``X`` an expert; jaxpar's layer weights are stacked on a leading
``layers`` axis, a mixture's expert weights on ``experts`` after it)::

    model.embed_tokens.weight                  embedding              [V, E]       same
    model.norm.weight                          final_norm/scale       [E]          same
    lm_head.weight [V, E]                      lm_head [E, V]                      transposed
    model.layers.L.input_layernorm.weight      layers/attn_norm/scale [L][E]       same
    model.layers.L.post_attention_layernorm.weight   layers/mlp_norm/scale         same
    model.layers.L.self_attn.q_proj.weight [H*D, E]  layers/attn/wq [L][E, H, D]   heads_in
    model.layers.L.self_attn.{k,v}_proj.weight       layers/attn/{wk,wv} [L][E, K, D]
    model.layers.L.self_attn.o_proj.weight [E, H*D]  layers/attn/wo [L][H, D, E]   heads_out
    model.layers.L.self_attn.{q,k,v}_proj.bias [H*D] layers/attn/{q,k,v}_bias [L][H, D] (qwen2)
    model.layers.L.self_attn.{q,k}_norm.weight [D]   layers/attn/{q,k}_norm/scale   (qwen3)
    model.layers.L.mlp.{gate,up,down}_proj.weight    layers/mlp/w_{gate,up,down}   transposed
    model.layers.L.block_sparse_moe.gate.weight [X, E]   layers/moe/router [L][E, X] (mixtral)
    model.layers.L.block_sparse_moe.experts.X.{w1,w3,w2}.weight
                                               layers/moe/w_{gate,up,down} [L][X][E, F] / [F, E]
    model.layers.L.mlp.gate.weight, model.layers.L.mlp.experts.X.{gate,up,down}_proj.weight
                                               the same, for qwen3_moe

Gemma 2/3 (``model.post_norms``): four norms a layer, ``input_layernorm`` -> ``attn_norm``,
``post_attention_layernorm`` -> ``attn_post_norm``, ``pre_feedforward_layernorm`` ->
``mlp_norm``, ``post_feedforward_layernorm`` -> ``mlp_post_norm``; every Gemma norm (the q/k and
final ones too) multiplies by ``1 + weight``, so jaxpar's scale is the weight plus one
(``PLUS_ONE``, float32 as transformers adds it). The multimodal Gemma 3 keeps the language
model under a prefix of its own (``language_model.model.`` as transformers 5 saves it).

DeepSeek-V3 (``deepseek_v3``; multi-head latent attention, :mod:`jaxpar.model.mla`): blocks
below ``first_k_dense_replace`` are ``dense_layers/...`` [L], the others ``layers/...``
[L - first_k_dense_replace]::

    self_attn.q_a_proj.weight [Rq, E]          attn/wq_a [E, Rq]                   transposed
    self_attn.q_a_layernorm.weight             attn/q_norm/scale                   same
    self_attn.q_b_proj.weight [H*(N+P), Rq]    attn/wq_b [Rq, H, N+P]              heads_in
    self_attn.q_proj.weight [H*(N+P), E]       attn/wq [E, H, N+P] (q_lora_rank 0) heads_in
    self_attn.kv_a_proj_with_mqa.weight [R+P, E]   attn/wkv_a [E, R+P]             transposed
    self_attn.kv_a_layernorm.weight            attn/kv_norm/scale                  same
    self_attn.kv_b_proj.weight [H*(N+V), R]    attn/wkv_b [R, H, N+V]              heads_in
    self_attn.o_proj.weight [E, H*V]           attn/wo [H, V, E]                   heads_out
    mlp.gate.weight [X, E]                     moe/router [E, X]                   transposed
    mlp.gate.e_score_correction_bias [X]       moe/router_bias (a buffer)          same
    mlp.experts.X.{gate,up,down}_proj.weight   moe/w_{gate,up,down} [X][E, F]      transposed
    mlp.shared_experts.{gate,up,down}_proj.weight  moe/shared/w_{gate,up,down}     transposed

RoPE: jaxpar rotates the two halves of each head (``rotate_half``, like Hugging Face's Llama
code), with the same frequencies, so q and k projections map unpermuted; only the layout of the
matrices changes (PyTorch stores ``[out, in]``, jaxpar ``[in, out]`` with heads split out).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxpar.config import ModelConfig

# How the Hugging Face array relates to the jaxpar one (one layer's / expert's slice of it).
SAME, TRANSPOSED, HEADS_IN, HEADS_OUT, HEADS_BIAS, PLUS_ONE = (
    "same", "transposed", "heads_in", "heads_out", "heads_bias", "plus_one")
# Where a checkpoint keeps the language model -> its output head's name (untied).
TEXT_PREFIXES = {"model.": "lm_head.weight",
                 "language_model.model.": "language_model.lm_head.weight",
                 "model.language_model.": "lm_head.weight"}
GEMMA_NORMS = (("input_layernorm", "attn_norm"), ("post_attention_layernorm", "attn_post_norm"),
               ("pre_feedforward_layernorm", "mlp_norm"),
               ("post_feedforward_layernorm", "mlp_post_norm"))


@dataclass(frozen=True)
class Tensor:
    hf: str  # the Hugging Face name
    path: tuple[str, ...]  # the jaxpar parameter ("layers", "attn", "wq")
    index: tuple[int, ...]  # its slice of the stacked parameter: (), (layer,), (layer, expert)
    layout: str  # SAME, TRANSPOSED, HEADS_IN, HEADS_OUT, HEADS_BIAS or PLUS_ONE
    buffer: bool = False  # a model buffer (MoE router bias), not a parameter


def hf_tensors(m: ModelConfig, prefix: str = "model.") -> list[Tensor]:
    """Every tensor of the Hugging Face model that ``m`` is, in the order save_pretrained
    writes (global ones first, then layer by layer), the language model's under ``prefix``
    (one of :data:`TEXT_PREFIXES`). MoE models: ``moe.every == 1`` only."""
    norm = PLUS_ONE if m.post_norms else SAME
    out = [Tensor(f"{prefix}embed_tokens.weight", ("embedding",), (), SAME)]
    for layer in range(m.n_layers):
        out += _layer_tensors(m, layer, prefix)
    out.append(Tensor(f"{prefix}norm.weight", ("final_norm", "scale"), (), norm))
    if not m.tie_embeddings:
        out.append(Tensor(TEXT_PREFIXES[prefix], ("lm_head",), (), TRANSPOSED))
    return out


def _layer_tensors(m: ModelConfig, layer: int, prefix: str) -> list[Tensor]:
    if m.mla.enabled:
        return _deepseek_layer_tensors(m, layer, prefix)
    p, i = f"{prefix}layers.{layer}.", (layer,)
    norm = PLUS_ONE if m.post_norms else SAME

    def t(name: str, *path: str, layout: str, index: tuple[int, ...] = i) -> Tensor:
        return Tensor(p + name, ("layers", *path), index, layout)

    if m.post_norms:
        out = [t(f"{hf}.weight", name, "scale", layout=PLUS_ONE) for hf, name in GEMMA_NORMS]
    else:
        out = [t("input_layernorm.weight", "attn_norm", "scale", layout=SAME),
               t("post_attention_layernorm.weight", "mlp_norm", "scale", layout=SAME)]
    for proj, name in (("q", "wq"), ("k", "wk"), ("v", "wv")):
        out.append(t(f"self_attn.{proj}_proj.weight", "attn", name, layout=HEADS_IN))
        if m.qkv_bias:
            out.append(t(f"self_attn.{proj}_proj.bias", "attn", f"{proj}_bias",
                         layout=HEADS_BIAS))
    out.append(t("self_attn.o_proj.weight", "attn", "wo", layout=HEADS_OUT))
    if m.qk_norm:
        out += [t("self_attn.q_norm.weight", "attn", "q_norm", "scale", layout=norm),
                t("self_attn.k_norm.weight", "attn", "k_norm", "scale", layout=norm)]
    if not m.moe.enabled:
        return out + [t(f"mlp.{hf}_proj.weight", "mlp", f"w_{hf}", layout=TRANSPOSED)
                      for hf in ("gate", "up", "down")]
    # qwen3_moe (the mixture with q/k norms) names its experts as an MLP; mixtral its own way.
    block, names = (("mlp", ("gate_proj", "up_proj", "down_proj")) if m.qk_norm else
                    ("block_sparse_moe", ("w1", "w3", "w2")))
    out.append(t(f"{block}.gate.weight", "moe", "router", layout=TRANSPOSED))
    for x in range(m.moe.num_experts):
        out += [t(f"{block}.experts.{x}.{hf}.weight", "moe", name, layout=TRANSPOSED,
                  index=(layer, x)) for hf, name in zip(names, ("w_gate", "w_up", "w_down"),
                                                        strict=True)]
    return out


def _deepseek_layer_tensors(m: ModelConfig, layer: int, prefix: str) -> list[Tensor]:
    """One DeepSeek-V3 block: MLA, then a dense MLP (``dense_layers``) or a mixture."""
    first = m.moe.first_dense
    stack, i = ("dense_layers", (layer,)) if layer < first else ("layers", (layer - first,))
    p = f"{prefix}layers.{layer}."

    def t(name: str, *path: str, layout: str = TRANSPOSED, index: tuple[int, ...] = i,
          buffer: bool = False) -> Tensor:
        return Tensor(p + name, (stack, *path), index, layout, buffer)

    out = [t("input_layernorm.weight", "attn_norm", "scale", layout=SAME),
           t("post_attention_layernorm.weight", "mlp_norm", "scale", layout=SAME)]
    if m.mla.q_lora_rank:
        out += [t("self_attn.q_a_proj.weight", "attn", "wq_a"),
                t("self_attn.q_a_layernorm.weight", "attn", "q_norm", "scale", layout=SAME),
                t("self_attn.q_b_proj.weight", "attn", "wq_b", layout=HEADS_IN)]
    else:
        out.append(t("self_attn.q_proj.weight", "attn", "wq", layout=HEADS_IN))
    out += [t("self_attn.kv_a_proj_with_mqa.weight", "attn", "wkv_a"),
            t("self_attn.kv_a_layernorm.weight", "attn", "kv_norm", "scale", layout=SAME),
            t("self_attn.kv_b_proj.weight", "attn", "wkv_b", layout=HEADS_IN),
            t("self_attn.o_proj.weight", "attn", "wo", layout=HEADS_OUT)]
    projections = (("gate_proj", "w_gate"), ("up_proj", "w_up"), ("down_proj", "w_down"))
    if layer < first:
        return out + [t(f"mlp.{hf}.weight", "mlp", name) for hf, name in projections]
    out += [t("mlp.gate.weight", "moe", "router"),
            t("mlp.gate.e_score_correction_bias", "moe", "router_bias", layout=SAME,
              buffer=True)]
    for x in range(m.moe.num_experts):
        out += [t(f"mlp.experts.{x}.{hf}.weight", "moe", name, index=(*i, x))
                for hf, name in projections]
    if m.moe.num_shared_experts:
        out += [t(f"mlp.shared_experts.{hf}.weight", "moe", "shared", name)
                for hf, name in projections]
    return out


def param_at(params: dict, path: tuple[str, ...]) -> Any:
    """The (stacked) parameter at ``path`` of nested ``params``."""
    node = params
    for key in path:
        node = node[key]
    return node


def slice_shape(params: dict, t: Tensor) -> tuple[int, ...]:
    """The shape of the jaxpar slice ``t`` names (its stacked parameter less the stack axes)."""
    return tuple(param_at(params, t.path).shape[len(t.index):])


def hf_shape(layout: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The Hugging Face shape of a jaxpar slice of ``shape``."""
    if layout in (SAME, PLUS_ONE):
        return shape
    if layout == TRANSPOSED:
        return shape[::-1]
    if layout == HEADS_IN:  # [E, H, D] -> [H*D, E]
        return (shape[1] * shape[2], shape[0])
    if layout == HEADS_OUT:  # [H, D, E] -> [E, H*D]
        return (shape[2], shape[0] * shape[1])
    return (shape[0] * shape[1],)  # HEADS_BIAS: [H, D] -> [H*D]


def jaxpar_view(layout: str, target: np.ndarray) -> tuple[np.ndarray, bool]:
    """A view of the jaxpar slice ``target`` whose rows (``False``) or columns (``True``) are
    the rows of the Hugging Face array: reading a tensor in row blocks fills ``target`` in
    place, without a whole copy of it."""
    if layout in (SAME, HEADS_BIAS, PLUS_ONE):  # PLUS_ONE: the reader adds the one
        return target.reshape(-1) if layout == HEADS_BIAS else target, False
    if layout == HEADS_IN:  # [E, H, D] viewed as [E, H*D]: HF's rows are its columns
        return target.reshape(target.shape[0], -1), True
    if layout == HEADS_OUT:  # [H, D, E] viewed as [H*D, E]
        return target.reshape(-1, target.shape[-1]), True
    return target, True  # TRANSPOSED


def to_hf(layout: str, array: np.ndarray) -> np.ndarray:
    """A jaxpar slice as the contiguous Hugging Face array (what :func:`jaxpar_view` fills)."""
    if layout == TRANSPOSED:
        array = array.T
    elif layout == HEADS_IN:
        array = array.reshape(array.shape[0], -1).T
    elif layout == HEADS_OUT:
        array = array.reshape(-1, array.shape[-1]).T
    elif layout == HEADS_BIAS:
        array = array.reshape(-1)
    elif layout == PLUS_ONE:
        array = array - np.float32(1.0)
    return np.ascontiguousarray(array)
