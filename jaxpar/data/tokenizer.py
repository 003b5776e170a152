"""Tokenizers: a built-in byte-level one and HuggingFace `tokenizer.json` files.

The byte tokenizer needs no files, so the default corpus trains out of the box; a
`tokenizer.json` loads through the optional `tokenizers` package. Packing and the train loop
use only the shared interface (`Tokenizer`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

# Names that tokenizer.json files commonly give their end-of-text token, most specific first.
_EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[EOS]", "[SEP]")


class Tokenizer(Protocol):
    """What the data pipeline needs from a tokenizer."""

    name: str
    vocab_size: int
    eos_id: int

    def encode(self, text: str, special_tokens: bool = False) -> np.ndarray: ...

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]: ...

    def decode(self, ids: Iterable[int]) -> str: ...

    def token_id(self, token: str) -> int | None: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256; NUL (0), absent from the text files read,
    separates documents."""

    name = "byte"
    vocab_size = 256
    eos_id = 0

    def encode(self, text: str, special_tokens: bool = False) -> np.ndarray:
        """``special_tokens``: the byte tokenizer adds none either way."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]

    def token_id(self, token: str) -> int | None:
        """Bytes have no named tokens."""
        return None

    def decode(self, ids: Iterable[int]) -> str:
        ids = np.asarray(list(ids) if not isinstance(ids, np.ndarray) else ids)
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            raise ValueError(
                f"byte tokenizer ids must be in [0, 256), got {ids.min()}..{ids.max()}"
            )
        # A window of bytes may cut a multi-byte character; show it rather than fail.
        return ids.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


class HFTokenizer:
    """A HuggingFace `tokenizer.json` without its own special-token or length handling.

    Packing separates documents and cuts rows itself, so post-processor (BOS/EOS), truncation
    and padding are off; only a prompt of a model trained with them asks for the post-processor
    (``special_tokens``). ``eos``: the end-of-text token if the caller knows it (an id, or its
    text as ``tokenizer_config.json`` names it); None: the first usual end-of-text name the file
    holds, else the ``eos_token`` of the ``tokenizer_config.json`` beside it (DeepSeek's
    ``<｜end▁of▁sentence｜>``).
    """

    def __init__(self, path: str, eos: int | str | None = None):
        try:
            import tokenizers  # optional dependency, only needed for this class
        except ImportError as e:
            raise ImportError(
                f"data.tokenizer={path!r} needs the HuggingFace tokenizers package: "
                "pip install tokenizers"
            ) from e
        try:
            self._tok = tokenizers.Tokenizer.from_file(path)
        except Exception as e:  # the Rust side raises plain Exception for bad files
            raise ValueError(f"data.tokenizer={path!r}: not a valid tokenizer.json ({e})") from e
        self._tok.no_truncation()
        self._tok.no_padding()
        self.name = path
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        if eos is None:  # the usual names, else the one its tokenizer_config.json gives
            named = named_special_tokens(path).get("eos_token")
            names = _EOS_NAMES if named is None else (*_EOS_NAMES, named)
        else:
            names = () if isinstance(eos, int) else (eos,)
        self.eos_id = eos if isinstance(eos, int) else self._find_eos(path, names)

    def _find_eos(self, path: str, names: Sequence[str]) -> int:
        for token in names:
            token_id = self._tok.token_to_id(token)
            if token_id is not None:
                return token_id
        names = ", ".join(names)
        raise ValueError(f"data.tokenizer={path!r}: no end-of-text token (looked for {names})")

    def token_id(self, token: str) -> int | None:
        """The id of ``token`` (a special token's text, ``</s>``); None if absent."""
        return self._tok.token_to_id(token)

    def encode(self, text: str, special_tokens: bool = False) -> np.ndarray:
        """``special_tokens``: the post-processor adds its own (a BOS)."""
        ids = self._tok.encode(text, add_special_tokens=special_tokens).ids
        return np.asarray(ids, dtype=np.int32)

    def encode_offsets(self, text: str) -> tuple[np.ndarray, list[tuple[int, int]]]:
        """``text``'s ids (special tokens recognised, none added) and each token's [start, end)
        characters (chat data: which tokens are the assistant's)."""
        encoding = self._tok.encode(text, add_special_tokens=False)
        return np.asarray(encoding.ids, dtype=np.int32), list(encoding.offsets)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        # encode_batch tokenizes in parallel on the Rust side.
        encodings = self._tok.encode_batch(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int32) for e in encodings]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


def make_tokenizer(spec: str = "byte", eos: int | str | None = None) -> Tokenizer:
    """'byte' for the byte tokenizer, else a HuggingFace tokenizer.json path (``eos``: see
    :class:`HFTokenizer`)."""
    if spec == "byte":
        return ByteTokenizer()
    path = os.path.expanduser(spec)
    if not os.path.isfile(path):
        raise ValueError(
            f"data.tokenizer={spec!r}: no such file (use 'byte' or a path to a tokenizer.json)"
        )
    return HFTokenizer(path, eos)


def named_special_tokens(spec: str) -> dict[str, str]:
    """``bos_token``/``eos_token`` texts the ``tokenizer_config.json`` beside a tokenizer.json
    names, else its ``special_tokens_map.json`` (older saves); {} for none."""
    found: dict[str, str] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the later one wins
        path = Path(spec).expanduser().with_name(name)
        if spec == "byte" or not path.is_file():
            continue
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            raise ValueError(f"{path}: cannot read it as JSON ({err})") from None
        for key in ("bos_token", "eos_token"):
            token = config.get(key) if isinstance(config, dict) else None
            token = token.get("content") if isinstance(token, dict) else token
            if isinstance(token, str):
                found[key] = token
    return found
