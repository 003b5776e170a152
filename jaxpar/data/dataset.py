"""From `data.source` to a packed train or validation split.

The split is by document, by a hash of its key (relative path, or path and line): the same on
every process, and stable as `max_bytes` admits more or fewer documents.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from jaxpar.config import DataConfig
from jaxpar.data.chat import ChatTemplate, encode_conversation, read_conversations
from jaxpar.data.packing import PackedDataset, pack_tokens, pack_weights
from jaxpar.data.shards import is_tokenized
from jaxpar.data.sources import Document, read_documents
from jaxpar.data.split_rows import TokenizedDataset, open_tokenized
from jaxpar.data.tokenizer import Tokenizer, make_tokenizer

SPLITS = ("train", "validation")


def build_dataset(
    source: str,
    tokenizer: Tokenizer,
    seq_len: int,
    *,
    split: str = "train",
    val_fraction: float = 0.01,
    max_bytes: int | None = 8_000_000,
    text_field: str = "text",
    loss_on: str = "all",
) -> PackedDataset:
    """Read, split, tokenize and pack `source` into rows of `seq_len` inputs and targets.

    ``loss_on="assistant"``: `source` is chat .jsonl, rendered with the tokenizer's chat
    template; the mask is 1 only on the assistant's tokens (data/chat.py)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if seq_len < 1:
        raise ValueError(f"train.seq_len must be positive, got {seq_len}")
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"data.val_fraction must be in [0, 1), got {val_fraction}")
    if loss_on not in ("all", "assistant"):
        raise ValueError(f"data.loss_on={loss_on!r}; allowed: all, assistant")
    chats = None
    if loss_on == "assistant":
        if not hasattr(tokenizer, "encode_offsets"):
            raise ValueError(f"data.loss_on=assistant needs data.tokenizer to be a tokenizer.json "
                             f"with a chat_template beside it, not {tokenizer.name!r}")
        template = ChatTemplate(tokenizer.name)
        # Every conversation is rendered, whichever split it falls in: a bad line is an error
        # for both splits' runs alike.
        chats = {c.key: encode_conversation(tokenizer, *template.assistant_text(c))
                 for c in read_conversations(source)}
        docs = [Document(key, "") for key in chats]
    else:
        docs = read_documents(source, max_bytes, text_field)
    if not docs:
        raise ValueError(f"data.source={source!r}: the corpus is empty (no non-empty documents)")
    in_validation = validation_mask([d.key for d in docs], val_fraction)
    chosen = [d for d, v in zip(docs, in_validation, strict=True) if v == (split == "validation")]
    if not chosen:
        raise ValueError(
            f"data.source={source!r}: the {split} split is empty ({len(docs)} documents, "
            f"val_fraction={val_fraction}; the split is by document, so add documents)"
        )
    weights = None
    if chats is None:
        encoded = tokenizer.encode_batch([d.text for d in chosen])
    else:
        pairs = [chats[d.key] for d in chosen]
        encoded = [ids for ids, _ in pairs]
    tokens, n_tokens = pack_tokens(encoded, tokenizer.eos_id, seq_len)
    if chats is not None:
        weights = pack_weights([w for _, w in pairs], len(tokens))
    # Document i + 1 starts after document i and its separator; the padding after the last
    # document's end-of-text (the first padding token), as in a tokenized directory.
    lengths = np.array([len(doc) + 1 for doc in encoded], dtype=np.int64)
    boundaries = np.append(np.cumsum(lengths)[:-1], n_tokens + 1)
    dataset = PackedDataset(
        tokens=tokens,
        n_tokens=n_tokens,
        seq_len=seq_len,
        source=source,
        split=split,
        tokenizer=tokenizer.name,
        documents=tuple(d.key for d in chosen),
        boundaries=boundaries,
        weights=weights,
    )
    if len(dataset) == 0:
        raise ValueError(
            f"data.source={source!r}: the {split} split has {n_tokens} token(s), "
            f"too few for one row of train.seq_len={seq_len}"
        )
    return dataset


def check_vocabulary(ids: int, vocab_size: int, label: str) -> None:
    """ValueError unless a tokenizer's ``ids`` fit the model's ``vocab_size``."""
    if ids > vocab_size:
        raise ValueError(f"{label}: its tokenizer has {ids} ids, more than the model's "
                         f"vocabulary (model.vocab_size={vocab_size})")


def open_source(data: DataConfig, source: str, split: str, seq_len: int, *, vocab_size: int,
                label: str | None = None) -> TokenizedDataset | PackedDataset:
    """``split`` of one source: a ``jaxpar tokenize`` directory (never scanned), or anything else
    ``data.source`` reads (tokenized and split here). ValueError when anything is off; before any
    work if the tokenizer has more ids than ``vocab_size``."""
    label = label or f"data.source={source!r}"
    if is_tokenized(source):
        ds = open_tokenized(source, split, seq_len, tokenizer=data.tokenizer,
                            checksums=data.verify, label=label)
        check_vocabulary(ds.vocab_size, vocab_size, label)
        return ds
    tokenizer = make_tokenizer(data.tokenizer)
    check_vocabulary(tokenizer.vocab_size, vocab_size, label)
    return build_dataset(source, tokenizer, seq_len, split=split,
                         val_fraction=data.val_fraction, max_bytes=data.max_bytes or None,
                         text_field=data.text_field, loss_on=data.loss_on)


def validation_mask(keys: Sequence[str], val_fraction: float) -> np.ndarray:
    """True for documents in the validation split (about `val_fraction`).

    With two or more documents neither split is empty: if the hash puts none (all) in validation,
    the lowest (highest) hash changes side.
    """
    scores = np.array([split_score(k) for k in keys])
    in_validation = scores < val_fraction
    if len(keys) >= 2 and val_fraction > 0:
        if not in_validation.any():
            in_validation[np.argmin(scores)] = True
        if in_validation.all():
            in_validation[np.argmax(scores)] = False
    return in_validation


def split_score(key: str) -> float:
    """A document's stable pseudo-random number in [0, 1); below `val_fraction`: validation.

    A keyed digest, as hash() is salted per process. `jaxpar tokenize` applies it per document,
    and :func:`validation_mask`'s correction at the end.
    """
    digest = hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2.0**64


def dataset_line(ds: PackedDataset | TokenizedDataset) -> str:
    """One train-log line: split, documents, tokens, rows, origin."""
    origin = f"source={ds.source}"
    if isinstance(ds, TokenizedDataset):
        origin += f", tokenized: {len(ds.shards)} shards of {ds.index.dtype}"
    return (
        f"data {ds.split}: {ds.n_documents:,} documents, {ds.n_tokens:,} tokens, "
        f"{len(ds):,} rows of {ds.seq_len} ({origin}, tokenizer={ds.tokenizer})"
    )
