"""A split of a tokenized directory (``jaxpar tokenize``) as training rows, read on demand.

The rows are those of :mod:`jaxpar.data.packing` over the split's token stream: its shards laid
end to end. The shards store every document followed by the end-of-text id, so the stream reads
as packing's ``doc eos doc eos ... doc``, plus one trailing end-of-text id that packing would add
as padding anyway (it is masked the same way). Row ``i`` is ``stream[i*L : i*L + L + 1]``; a row
that crosses a shard boundary is read from both shards, located by the shards' cumulative token
counts.

Opening reads ``index.json``, checks each file's size and opens the shards; nothing scans the
corpus, and what stays in host memory grows with the number of shards, not with their size or
the rows read: each row is read (``pread``) into a fresh array as it is asked for. The
documents' offsets give, per row, which document each position belongs to
(:meth:`TokenizedDataset.segment_ids`).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import BinaryIO

import numpy as np

from jaxpar.data.packing import num_rows
from jaxpar.data.shards import (
    DTYPES,
    OFFSETS_DTYPE,
    Shard,
    TokenIndex,
    check_shards,
    read_index,
    tokenizer_digest,
)


@dataclasses.dataclass(frozen=True, eq=False)
class TokenizedDataset:
    """``ds.rows(indices)`` -> inputs, targets, mask of the rows, each [n, seq_len]; the same
    interface as :class:`~jaxpar.data.packing.PackedDataset`, so :class:`DataIterator` (and a
    mixture drawing rows from several of these by index) reads it alike."""

    source: str  # the directory, as data.source gave it, for messages
    split: str
    seq_len: int
    directory: Path
    index: TokenIndex
    # Per shard, its ids' file, open for reads at an offset (pread). Not memory maps: every
    # page a map touches counts in the process's resident memory until the kernel reclaims it,
    # so a long run's RSS would grow toward the corpus's size (scripts/data_speed.py measured
    # +0.67 GiB after 480 rows of a 2 GB corpus); pread's pages stay in the page cache only.
    # The document offsets (needed only by segment_ids) are mapped when asked for.
    files: tuple[BinaryIO, ...]
    token_starts: np.ndarray  # [shards + 1] position of each shard's first token in the stream

    @classmethod
    def open(cls, directory: str, split: str, seq_len: int, *, checksums: bool = False,
             label: str | None = None) -> TokenizedDataset:
        """Read the index, check the split's files (their sizes; with `checksums` every byte
        against its sha256) and map them; ValueError naming `label` when anything is off."""
        label = label or f"data.source={directory!r}"
        if seq_len < 1:
            raise ValueError(f"train.seq_len must be positive, got {seq_len}")
        path = Path(directory).expanduser()
        index = read_index(path, label)
        shards = index.splits.get(split, ())
        if not shards:
            have = ", ".join(f"{n} ({sum(s.documents for s in v):,} documents)"
                             for n, v in index.splits.items())
            raise ValueError(f"{label}: no {split} split (the directory holds {have}; the split "
                             f"is by document, val_fraction={index.val_fraction})")
        check_shards(path, index, split, checksums, label)
        ds = cls(source=directory, split=split, seq_len=seq_len, directory=path, index=index,
                 files=tuple(open(path / s.tokens_file, "rb", buffering=0)  # noqa: SIM115
                             for s in shards),
                 token_starts=np.cumsum([0] + [s.tokens for s in shards], dtype=np.int64))
        if len(ds) == 0:
            raise ValueError(f"{label}: the {split} split has {ds.n_tokens} token(s), too few "
                             f"for one row of train.seq_len={seq_len}")
        return ds

    @property
    def shards(self) -> tuple[Shard, ...]:
        return self.index.splits[self.split]

    @property
    def tokenizer(self) -> str:
        return self.index.tokenizer.name

    @property
    def vocab_size(self) -> int:
        return self.index.tokenizer.vocab_size

    @property
    def n_documents(self) -> int:
        return sum(s.documents for s in self.shards)

    @property
    def n_tokens(self) -> int:
        """Real tokens of the stream: the stored ones but the trailing end-of-text id."""
        return int(self.token_starts[-1]) - 1

    def __len__(self) -> int:
        return num_rows(self.n_tokens, self.seq_len)

    def rows(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        """Rows `indices` stacked: int32 inputs/targets and float32 mask, each [n, seq_len]."""
        starts = self._starts(indices)
        window = np.empty((len(starts), self.seq_len + 1), dtype=np.int32)
        for r, a in enumerate(starts):
            window[r] = self._read(int(a), self.seq_len + 1)
        target_positions = starts[:, None] + np.arange(1, self.seq_len + 1)
        return {
            "inputs": np.ascontiguousarray(window[:, :-1]),
            "targets": np.ascontiguousarray(window[:, 1:]),
            "mask": (target_positions < self.n_tokens).astype(np.float32),
        }

    def target_counts(self, indices: np.ndarray) -> np.ndarray:
        """int64 [n]: the mask's sum of rows `indices` (the real targets), without reading them:
        row i's targets are stream positions i*L+1 .. i*L+L, real below n_tokens."""
        starts = self._starts(indices)
        return np.clip(self.n_tokens - 1 - starts, 0, self.seq_len)

    def segment_ids(self, indices: np.ndarray) -> np.ndarray:
        """int32 [n, seq_len]: per input position of rows `indices`, which document it is in,
        counted from 0 at the row's first position. A document's end-of-text id belongs to it;
        the padding after the stream is one more segment."""
        starts = self._starts(indices)
        out = np.empty((len(starts), self.seq_len), dtype=np.int32)
        for r, a in enumerate(starts):
            boundaries = self._document_starts(int(a), int(a) + self.seq_len)
            positions = np.arange(a, a + self.seq_len)
            out[r] = np.searchsorted(boundaries, positions, side="right")
        return out

    def _starts(self, indices: np.ndarray) -> np.ndarray:
        indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        if indices.size and (indices.min() < 0 or indices.max() >= len(self)):
            raise IndexError(f"rows {indices.min()}..{indices.max()} out of range for "
                             f"{len(self)} rows")
        return indices * self.seq_len

    def _read(self, start: int, length: int) -> np.ndarray:
        """stream[start : start + length] as int32; past the stream's end, end-of-text ids."""
        out = np.full(length, self.index.tokenizer.eos_id, dtype=np.int32)
        stop = min(start + length, int(self.token_starts[-1]))
        shard = int(np.searchsorted(self.token_starts, start, side="right")) - 1
        position, dtype = start, np.dtype(DTYPES[self.index.dtype])
        while position < stop:
            base = int(self.token_starts[shard])
            take = min(stop, int(self.token_starts[shard + 1])) - position
            ids = np.empty(take, dtype=dtype)
            got = os.preadv(self.files[shard].fileno(), [ids], (position - base) * dtype.itemsize)
            if got != ids.nbytes:  # the size was checked at open: the file changed since
                raise ValueError(f"{self.directory / self.shards[shard].tokens_file}: "
                                 f"{got} of {ids.nbytes} bytes read (the file was truncated)")
            out[position - start:position - start + take] = ids
            position += take
            shard += 1
        return out

    def _document_starts(self, start: int, stop: int) -> np.ndarray:
        """Stream positions in (start, stop) where a document, or the padding, begins."""
        found = []
        shard = int(np.searchsorted(self.token_starts, start, side="right")) - 1
        while shard < len(self.files) and self.token_starts[shard] < stop:
            base = int(self.token_starts[shard])
            offsets = np.memmap(self.directory / self.shards[shard].offsets_file,
                                dtype=OFFSETS_DTYPE, mode="r")  # sorted: two binary searches
            lo = np.searchsorted(offsets, start - base, side="right")
            hi = np.searchsorted(offsets, stop - base, side="left")
            found.append(np.asarray(offsets[lo:hi], dtype=np.int64) + base)
            shard += 1
        # A shard's closing offset is the next shard's first document (or the padding): once.
        return np.unique(np.concatenate(found)) if found else np.zeros(0, dtype=np.int64)


def open_tokenized(directory: str, split: str, seq_len: int, *, tokenizer: str,
                   checksums: bool = False, label: str | None = None) -> TokenizedDataset:
    """:meth:`TokenizedDataset.open` for training: `tokenizer` (``data.tokenizer``) must be the
    one the shards were made with, compared by content (the file may have moved). `label`
    names the directory in messages (default ``data.source=DIR``)."""
    label = label or f"data.source={directory!r}"
    ds = TokenizedDataset.open(directory, split, seq_len, checksums=checksums, label=label)
    check_tokenizer(ds, tokenizer, label)
    return ds


def check_tokenizer(ds: TokenizedDataset, tokenizer: str, label: str) -> None:
    """ValueError unless `tokenizer` (``data.tokenizer``) is the one `ds` was made with."""
    made_with = ds.index.tokenizer
    if tokenizer_digest(tokenizer) != made_with.sha256:
        which = ("the byte tokenizer: set data.tokenizer=byte" if made_with.sha256 == "byte"
                 else f"{made_with.name}, sha256 {made_with.sha256[:12]}...: set data.tokenizer "
                 "to that file")
        raise ValueError(f"data.tokenizer={tokenizer!r} is not the tokenizer {label} was made "
                         f"with ({which})")
