"""Tiny random Hugging Face models built with transformers' own classes (no downloads), and
the logits of a model on both sides, for the Hugging Face tests (tests/integration/test_hf*.py,
tests/unit/test_hf_config.py)."""

from __future__ import annotations

import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SEQ = 512
VOCAB = 256
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1)
# DeepSeek-V3 in small: multi-head latent attention (values narrower than queries and keys, so
# the kernels' padding is exercised), the first block dense, 8 routed experts in 2 groups.
DEEPSEEK = dict(q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
                topk_group=1, n_shared_experts=1, moe_intermediate_size=32,
                first_k_dense_replace=1, routed_scaling_factor=2.5, num_key_value_heads=4)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def llama_config_5x() -> dict:
    """A Llama config.json as transformers 5 writes it (``rope_parameters``), read without
    transformers."""
    return {"model_type": "llama", "vocab_size": 256, "hidden_size": 64,
            "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_theta": 500000.0, **LLAMA3}}


def build_hf_model(kind: str, seed: int = 0, **overrides):
    """A random ``kind`` model (llama with llama3 RoPE scaling and GQA, qwen2 with q/k/v biases
    and tied embeddings, qwen3 with q/k norms, mistral (``mistral_window``: with a sliding window
    of 64 tokens), mixtral and qwen3_moe with 4 experts, the Gemmas of :func:`_gemma`),
    every norm scale and bias random too, so that a weight mapped to the wrong place cannot go
    unnoticed."""
    import torch
    import transformers as tr

    torch.manual_seed(seed)
    common = {**COMMON, **{k: overrides.pop(k) for k in list(overrides) if k in COMMON}}
    if kind.startswith("gemma"):
        model = _gemma(kind, common, overrides)
    elif kind == "llama":
        cfg = tr.LlamaConfig(**common, head_dim=16, rope_scaling=dict(LLAMA3), **overrides)
        model = tr.LlamaForCausalLM(cfg)
    elif kind == "qwen2":
        cfg = tr.Qwen2Config(**common, tie_word_embeddings=True, rope_theta=1e5, **overrides)
        model = tr.Qwen2ForCausalLM(cfg)
    elif kind in ("mistral", "mistral_window"):  # a window of 64 of the 512 tokens, or none
        window = overrides.pop("sliding_window", 64 if kind == "mistral_window" else None)
        cfg = tr.MistralConfig(**common, sliding_window=window, **overrides)
        model = tr.MistralForCausalLM(cfg)
    elif kind == "qwen3":
        cfg = tr.Qwen3Config(**common, head_dim=32, **overrides)
        model = tr.Qwen3ForCausalLM(cfg)
    elif kind == "qwen3_moe":  # experts of their own size, gates not renormalised
        cfg = tr.Qwen3MoeConfig(**common, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                moe_intermediate_size=48, norm_topk_prob=False, **overrides)
        model = tr.Qwen3MoeForCausalLM(cfg)
    elif kind == "deepseek_v3":
        cfg = tr.DeepseekV3Config(**{**common, "num_hidden_layers": 3, **DEEPSEEK,
                                     **overrides})
        model = tr.DeepseekV3ForCausalLM(cfg)
    else:
        cfg = tr.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2,
                               **overrides)
        model = tr.MixtralForCausalLM(cfg)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 1:  # norm scales (around 1) and biases (around 0)
                param.normal_(1.0 if "norm" in name else 0.0, 0.2)
        for _, buffer in model.named_buffers():  # DeepSeek's router correction bias
            if buffer.ndim == 1 and buffer.is_floating_point() and buffer.numel() == 8:
                buffer.normal_(0.0, 0.2)
    return model.eval()


def _gemma(kind: str, common: dict, overrides: dict):
    """gemma2 (final logits soft-capped at its default 30, scores at 2.0 so that the cap
    matters), gemma3_text (linear RoPE scaling in the global layer, a plain local base),
    gemma3 (multimodal, tiny vision tower). Each has a sliding and a global layer, local layers
    seeing 64 of the 512 test tokens, and its own query_pre_attn_scalar."""
    import transformers as tr

    text = {**common, "head_dim": 16, "sliding_window": overrides.pop("sliding_window", 64)}
    if kind == "gemma2":
        return tr.Gemma2ForCausalLM(tr.Gemma2Config(
            **text, query_pre_attn_scalar=24, attn_logit_softcapping=2.0, **overrides))
    layers = ["sliding_attention", "full_attention"]
    if kind == "gemma3_text":
        rope = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e5},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
        return tr.Gemma3ForCausalLM(tr.Gemma3TextConfig(
            **text, query_pre_attn_scalar=8, layer_types=layers, rope_parameters=rope,
            **overrides))
    rope = {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
    text.update(query_pre_attn_scalar=32, layer_types=layers, rope_parameters=rope, **overrides)
    vision = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=14)
    return tr.Gemma3ForConditionalGeneration(tr.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4))


def save_hf_model(kind: str, directory: Path, **save_kwargs) -> Path:
    build_hf_model(kind).save_pretrained(directory, **save_kwargs)
    return directory


def tokens(rows: int = 1, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, (rows, SEQ)).astype(np.int32)


def hf_logits(directory: Path, ids: np.ndarray) -> np.ndarray:
    """float32 logits of the Hugging Face model saved in ``directory``."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor(ids, dtype=torch.long)).logits.numpy()


def imports_with_logits(root: Path, kinds: tuple[str, ...], save_kwargs: dict | None = None
                        ) -> dict:
    """kind -> (Hugging Face directory, jaxpar import of it, transformers' logits on
    ``tokens(rows=4)``), the models saved under ``root`` (``save_kwargs`` per kind)."""
    from jaxpar.hf.importer import import_hf

    ids, out = tokens(rows=4), {}
    for kind in kinds:
        source = save_hf_model(kind, root / kind, **(save_kwargs or {}).get(kind, {}))
        out[kind] = (source, import_hf(source, root / f"{kind}-jaxpar"), hf_logits(source, ids))
    return out


def import_logits_error(imported: tuple, overrides: list[str], devices: int) -> float:
    """The largest difference between jaxpar's logits of an import (``imported``, a value of
    :func:`imports_with_logits`) under ``overrides`` on ``devices`` and transformers'."""
    _, done, expected = imported
    trainer, state = trainer_from_import(done.config_yaml, overrides, devices)
    assert int(state.step) == 0
    got = jaxpar_logits(trainer, state, tokens(rows=4))
    assert np.abs(expected).max() > 1.0  # logits large enough that a wrong weight shows
    return float(np.abs(got - expected).max())


def next_token_ids(rows: int = 4, seed: int = 7) -> np.ndarray:
    """int32 [rows, SEQ + 1]: inputs ``[:, :-1]``, targets ``[:, 1:]``."""
    return np.random.default_rng(seed).integers(0, VOCAB, (rows, SEQ + 1)).astype(np.int32)


def hf_mean_loss(directory: Path, ids: np.ndarray) -> float:
    """The mean cross-entropy of transformers' logits on ``ids`` (:func:`next_token_ids`),
    in float64."""
    logits = hf_logits(directory, ids[:, :-1]).astype(np.float64)
    log_z = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    target = np.take_along_axis(logits, ids[:, 1:, None], axis=-1)[..., 0]
    return float(np.mean(log_z - target))


def step_loss(trainer, state, ids: np.ndarray) -> float:
    """The train step's loss of ``state`` on ``ids`` (:func:`next_token_ids`)."""
    rows = ids.shape[0]
    batch = trainer.put_batch({"inputs": ids[:, :-1], "targets": ids[:, 1:],
                               "mask": np.ones((rows, ids.shape[1] - 1), np.float32)})
    return float(trainer.loss_and_grads(state, batch)[0])


def losses_both_ways(imported: tuple, overrides: list[str], devices: int) -> tuple[float, float]:
    """(the train step's loss of an import, a value of :func:`imports_with_logits`, under
    ``overrides`` on ``devices``; the cross-entropy of transformers' logits) on one batch."""
    source, done, _ = imported
    ids = next_token_ids()
    trainer, state = trainer_from_import(done.config_yaml, overrides, devices)
    return step_loss(trainer, state, ids), hf_mean_loss(source, ids)


def greedy_both_ways(directory: Path, checkpoint: Path, model, new_tokens: int = 12
                     ) -> tuple[list, list]:
    """(transformers' greedy continuation of two 20-token prompts by the model saved in
    ``directory``, jaxpar's of the same prompts by the imported ``checkpoint`` of ``model``)."""
    import torch
    from transformers import AutoModelForCausalLM

    from jaxpar.checkpoint.weights_only import read_weights
    from jaxpar.config import Config
    from jaxpar.inference.generation import Generator

    prompts = tokens(rows=2)[:, :20]
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf.generate(torch.tensor(prompts, dtype=torch.long), max_new_tokens=new_tokens,
                          do_sample=False, eos_token_id=None, pad_token_id=0)
    params, buffers, _ = read_weights(checkpoint)
    generator = Generator(Config(model=model), params, buffers)
    return (out[:, prompts.shape[1]:].tolist(),
            generator.generate(prompts.tolist(), max_tokens=new_tokens))


def jaxpar_logits(trainer, state, ids: np.ndarray) -> np.ndarray:
    """float32 logits of ``state``'s model under ``trainer``'s mesh, with the hooks training
    installs (tensor, expert parallel), the rows split over the batch axes."""
    from jaxpar.parallel.hooks import model_hooks

    cfg = trainer.cfg
    positions = np.broadcast_to(np.arange(ids.shape[1], dtype=np.int32), ids.shape)

    def forward(params, buffers, ids, positions):
        return nnx.merge(trainer.graphdef, params, buffers)(ids, positions)[0]

    with jax.set_mesh(trainer.mesh), model_hooks(cfg, cfg.mesh_shape, "cpu"):
        batch = trainer.batch_sharding
        out = jax.jit(forward)(state.params, state.buffers, jax.device_put(ids, batch),
                               jax.device_put(np.ascontiguousarray(positions), batch))
    return np.asarray(jnp.asarray(out, jnp.float32))


def trainer_from_import(config_yaml: Path, overrides: list[str], devices: int):
    """A Trainer of the config ``jaxpar import-hf`` wrote, on the first ``devices`` devices,
    and its state started from the imported weights (``train.init_from``)."""
    from jaxpar.checkpoint.weights_only import step_dir
    from jaxpar.config import load_config, validate
    from jaxpar.mesh import make_mesh
    from jaxpar.train.init_from import initial_state
    from jaxpar.train.step import build_trainer

    cfg = validate(load_config(str(config_yaml), [
        "host_devices=null", "mesh.data=-1", f"train.seq_len={SEQ}",
        f"train.batch_size={max(devices, 2)}", *overrides]), devices)
    trainer = build_trainer(cfg, make_mesh(cfg, devices=jax.devices()[:devices]))
    source = step_dir(Path(cfg.train.init_from))
    return trainer, initial_state(trainer, source)


def scorable_checkpoint(directory: Path) -> dict[str, Path]:
    """What jaxpar eval and lm-eval score, made on the spot: a random Llama (vocabulary 320)
    with a byte-level BPE tokenizer trained on a small corpus (``tokenizer_config.json`` naming
    its end-of-text token, for transformers), imported as a jaxpar checkpoint, the corpus
    tokenized with it (a fifth held out), and the checkpoint exported back to Hugging Face.
    Returns the paths: corpus, checkpoint (its run directory), data, hf."""
    import json

    from helpers import write_bpe_tokenizer, write_text_corpus

    from jaxpar.data.pretokenize import TokenizeOptions, tokenize
    from jaxpar.hf.exporter import export_hf
    from jaxpar.hf.importer import import_hf

    paths = {name: directory / name for name in ("corpus", "src", "checkpoint", "data", "hf")}
    texts = write_text_corpus(paths["corpus"], documents=40)
    paths["src"].mkdir(parents=True)
    write_bpe_tokenizer(paths["src"] / "tokenizer.json", list(texts.values()), vocab_size=300)
    (paths["src"] / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
        "bos_token": "<|endoftext|>", "model_max_length": 512}))
    build_hf_model("llama", vocab_size=320).save_pretrained(paths["src"])
    imported = import_hf(paths["src"], paths["checkpoint"])
    tokenize(TokenizeOptions(sources=(str(paths["corpus"]),), directory=paths["data"],
                             tokenizer=str(imported.tokenizer), val_fraction=0.2))
    export_hf(paths["checkpoint"], paths["hf"])
    return paths


# --------------------------------------------------------------------------------------------
# A tokenizer for the tiny models (tests/integration/test_generate_imported.py)

BOS, EOS, UNK = 0, 1, 2  # the special tokens of char_tokenizer, ids as in the models' configs
CHAR_BASE = 0x100  # token 3 + i is the character chr(CHAR_BASE + i): printable, one per token


def char_text(ids) -> str:
    """The text that ``char_tokenizer`` encodes as ``ids`` (ordinary tokens, 3..VOCAB-1)."""
    return "".join(chr(CHAR_BASE + int(i) - 3) for i in ids)


def save_char_tokenizer(directory: Path, adds_bos: bool) -> Path:
    """A tokenizer over the tiny models' 256 ids, as transformers saves one: ``<s>`` (BOS, 0),
    ``</s>`` (EOS, 1), ``<unk>`` (2), and one printable character per other id, decoded back
    without spaces. With ``adds_bos`` its post-processor puts ``<s>`` before every text (Llama
    2/3, Gemma); without, it adds nothing (Qwen). Writes tokenizer.json and
    tokenizer_config.json into ``directory``."""
    import json

    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
    )

    vocab = {"<s>": BOS, "</s>": EOS, "<unk>": UNK} | {char_text([i]): i for i in range(3, VOCAB)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in ("<s>", "</s>", "<unk>")])
    if adds_bos:
        tokenizer.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", BOS)])
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "model_max_length": SEQ}))
    return directory
