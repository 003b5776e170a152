"""Packing: documents become one token stream, cut into fixed-length training rows.

Documents are joined by the end-of-text id, so only the end is padded. Row `i` is
`stream[i*L : i*L + L + 1]` (L = seq_len): first L tokens inputs, last L targets. Rows share
one boundary token, so every token after the first is a target once. Only the last row can
run past the stream; its padded targets get mask 0. Rows are views of one flat array.

Document ids (:meth:`PackedDataset.segment_ids`) count a row's documents from 0; a separator
belongs to its document, the trailing padding is one more. Chat data
(``data.loss_on=assistant``) packs a weight per token (:func:`pack_weights`): a target's mask
is 1 on the assistant's tokens, 0 elsewhere (separators, padding).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np


def pack_tokens(docs: Sequence[np.ndarray], eos_id: int, seq_len: int) -> tuple[np.ndarray, int]:
    """(padded stream, number of real tokens): `docs` joined by `eos_id`, padded to whole rows."""
    separator = np.array([eos_id], dtype=np.int32)
    pieces = []
    for i, doc in enumerate(docs):
        if i:
            pieces.append(separator)
        pieces.append(np.asarray(doc, dtype=np.int32))
    stream = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int32)
    n_tokens = len(stream)
    padded = np.full(num_rows(n_tokens, seq_len) * seq_len + 1, eos_id, dtype=np.int32)
    padded[:n_tokens] = stream
    return padded, n_tokens


def pack_weights(weights: Sequence[np.ndarray], padded_len: int) -> np.ndarray:
    """float32 [padded_len]: per-token weights laid out as :func:`pack_tokens` lays out tokens, 0
    on separators and padding."""
    out = np.zeros(padded_len, dtype=np.float32)
    at = 0
    for w in weights:
        out[at: at + len(w)] = w
        at += len(w) + 1  # the separator after it
    return out


def num_rows(n_tokens: int, seq_len: int) -> int:
    """Rows needed so that every token but the first is a target once."""
    return max(0, -(-(n_tokens - 1) // seq_len))


@dataclasses.dataclass(frozen=True, eq=False)
class PackedDataset:
    """A split of a corpus as packed rows: `ds[i]` -> inputs, targets, mask of length seq_len."""

    tokens: np.ndarray  # int32 stream padded to len(self) * seq_len + 1
    n_tokens: int  # real (unpadded) tokens in `tokens`
    seq_len: int
    source: str  # the data.source it came from, for messages
    split: str
    tokenizer: str  # tokenizer name, for describe()
    documents: tuple[str, ...]  # keys of the documents in this split, in stream order
    # Stream positions where the second, third, ... document begins, and where the padding
    # does (n_tokens + 1: the last document's end-of-text is the first padding token, which
    # belongs to it): what segment_ids counts. None: one document.
    boundaries: np.ndarray | None = None
    # float32 per stream token, its weight as a target (chat data: 1 on the assistant's tokens);
    # None: 1 on every real token.
    weights: np.ndarray | None = None

    @property
    def n_documents(self) -> int:
        return len(self.documents)

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"row {index} out of range for {len(self)} rows")
        row = self.rows(np.array([index % len(self)]))
        return {name: value[0] for name, value in row.items()}

    def rows(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        """Rows `indices` stacked: int32 inputs/targets and float32 mask, each [n, seq_len]."""
        starts = np.asarray(indices, dtype=np.int64)[:, None] * self.seq_len
        window = self.tokens[starts + np.arange(self.seq_len + 1)]
        target_positions = starts + np.arange(1, self.seq_len + 1)
        mask = (target_positions < self.n_tokens).astype(np.float32)
        if self.weights is not None:
            mask *= self.weights[target_positions]
        return {
            "inputs": np.ascontiguousarray(window[:, :-1]),
            "targets": np.ascontiguousarray(window[:, 1:]),
            "mask": mask,
        }

    def segment_ids(self, indices: np.ndarray) -> np.ndarray:
        """int32 [n, seq_len]: the document of each input position of rows `indices`, from 0 at the
        row's start."""
        positions = np.asarray(indices, dtype=np.int64)[:, None] * self.seq_len + np.arange(
            self.seq_len)
        boundaries = (np.array([self.n_tokens + 1]) if self.boundaries is None
                      else self.boundaries)
        ids = np.searchsorted(boundaries, positions, side="right")
        return (ids - ids[:, :1]).astype(np.int32)
