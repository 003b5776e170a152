"""Which Hugging Face tensor is which jaxpar parameter, and how their layouts differ.

Each tensor maps to one jaxpar parameter, or a slice of one stacked on ``layers`` (and ``experts``).
PyTorch stores ``[out, in]``, jaxpar ``[in, out]`` with heads split out. RoPE needs no permutation.
Gemma's norms store ``weight`` for jaxpar's ``1 + weight`` (``PLUS_ONE``). The table:
docs/hugging-face.md, "Names and layouts".
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
    """Every tensor of ``m``'s Hugging Face model, in save_pretrained's order, under ``prefix``.

    Global tensors first, then layer by layer; ``prefix`` is one of :data:`TEXT_PREFIXES`. MoE
    models: ``moe.every == 1`` only.
    """
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
    """The shape of the jaxpar slice ``t`` names: its parameter less the stack axes."""
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
    """A view of ``target`` whose rows (``False``) or columns (``True``) are the HF array's rows.

    Reading a tensor in row blocks fills ``target`` in place.
    """
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
