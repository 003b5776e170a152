"""Tokenizers: a built-in byte-level one and HuggingFace `tokenizer.json` files.

The byte tokenizer needs no files or downloads, so the default corpus trains out of the box; a
real `tokenizer.json` is loaded through the optional `tokenizers` package. Both expose the same
small interface (`Tokenizer`), which is all that packing and the train loop rely on.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Protocol

import numpy as np

# Names that tokenizer.json files commonly give their end-of-text token, most specific first.
_EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[EOS]", "[SEP]")


class Tokenizer(Protocol):
    """What the data pipeline needs from a tokenizer."""

    name: str
    vocab_size: int
    eos_id: int

    def encode(self, text: str) -> np.ndarray: ...

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]: ...

    def decode(self, ids: Iterable[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, and NUL (0) separates documents.

    NUL never occurs in the text files this library reads, so it is free to act as end-of-text.
    """

    name = "byte"
    vocab_size = 256
    eos_id = 0

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        ids = np.asarray(list(ids) if not isinstance(ids, np.ndarray) else ids)
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            raise ValueError(
                f"byte tokenizer ids must be in [0, 256), got {ids.min()}..{ids.max()}"
            )
        # A window of bytes may cut a multi-byte character; show it rather than fail.
        return ids.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


class HFTokenizer:
    """A HuggingFace `tokenizer.json`, used without its own special-token or length handling.

    Packing inserts its own separator between documents and cuts rows itself, so the file's
    post-processor (BOS/EOS insertion), truncation and padding are all switched off.
    """

    def __init__(self, path: str):
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
        self.eos_id = self._find_eos(path)

    def _find_eos(self, path: str) -> int:
        for token in _EOS_NAMES:
            token_id = self._tok.token_to_id(token)
            if token_id is not None:
                return token_id
        names = ", ".join(_EOS_NAMES)
        raise ValueError(f"data.tokenizer={path!r}: no end-of-text token (looked for {names})")

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int32)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        # encode_batch tokenizes in parallel on the Rust side.
        encodings = self._tok.encode_batch(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int32) for e in encodings]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


def make_tokenizer(spec: str = "byte") -> Tokenizer:
    """'byte' for the built-in byte tokenizer, otherwise a path to a HuggingFace tokenizer.json."""
    if spec == "byte":
        return ByteTokenizer()
    path = os.path.expanduser(spec)
    if not os.path.isfile(path):
        raise ValueError(
            f"data.tokenizer={spec!r}: no such file (use 'byte' or a path to a tokenizer.json)"
        )
    return HFTokenizer(path)
