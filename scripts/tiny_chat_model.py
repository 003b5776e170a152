"""A tiny random chat model built here, nothing downloaded: a Qwen2-style transformers model
and a byte-level tokenizer (one token per byte, no merges) with ChatML's special tokens and chat
template, saved as
``save_pretrained`` saves a model from the hub. docs/fine-tuning.md imports it with ``jaxpar
import-hf`` and fine-tunes it on ``jaxpar/data/toy_chat.jsonl``.

    python scripts/tiny_chat_model.py --to models/tiny-chat

Needs the ``hf`` and ``data`` extras (torch, transformers, tokenizers).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from jaxpar.data.chat import CHATML

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
VOCAB = 320  # 256 bytes and the specials, padded to a multiple of 64


def save_tokenizer(directory: Path) -> dict[str, int]:
    """tokenizer.json (GPT-2's byte-level alphabet, no merges: any text encodes, one token per
    UTF-8 byte) and tokenizer_config.json (ChatML's template; end of turn <|im_end|>); returns
    the special tokens' ids."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {t: i for i, t in enumerate([*alphabet, *SPECIALS])}
    tokenizer = Tokenizer(models.BPE(vocab, []))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in SPECIALS])
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "model_max_length": 2048, "chat_template": CHATML},
        indent=1))
    return {t: vocab[t] for t in SPECIALS}


def save_model(directory: Path, ids: dict[str, int], args: argparse.Namespace) -> None:
    """A random Qwen2 (grouped-query attention, biased q/k/v, untied head) of ``args``' sizes;
    a sequence ends at the end of a turn or of a text (generation_config.json)."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(args.seed)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=args.hidden,
                         intermediate_size=args.hidden * 11 // 4,
                         num_hidden_layers=args.layers, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=2048,
                         tie_word_embeddings=False, initializer_range=0.05,
                         bos_token_id=None, eos_token_id=ids["<|im_end|>"],
                         pad_token_id=ids["<|endoftext|>"])
    model = Qwen2ForCausalLM(config).eval()
    model.generation_config = GenerationConfig(
        eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]], pad_token_id=ids["<|endoftext|>"])
    model.save_pretrained(directory)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--to", required=True, metavar="DIR", help="where to save the model")
    parser.add_argument("--hidden", type=int, default=128, help="d_model (default 128)")
    parser.add_argument("--layers", type=int, default=4, help="layers (default 4)")
    parser.add_argument("--seed", type=int, default=0, help="torch's seed for the weights")
    args = parser.parse_args(argv)
    directory = Path(args.to).expanduser()
    directory.mkdir(parents=True, exist_ok=True)
    save_model(directory, save_tokenizer(directory), args)
    print(f"tiny chat model: {directory} (Qwen2, d_model {args.hidden}, {args.layers} layers, "
          f"{256 + len(SPECIALS)} tokens of a {VOCAB}-id vocabulary, ChatML)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
