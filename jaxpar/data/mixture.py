"""A mixture of tokenized directories (``data.sources``): rows drawn from each by weight.

Row ``i`` of the endless mixture is a pure function of ``i``, the seed and the sources: every
process computes the same stream alone, and a checkpoint needs only the position. Each
source's epochs are seeded permutations (:func:`permute`, never materialized). Rules:
docs/data.md, "Mixtures".
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from jaxpar.data.shards import is_tokenized
from jaxpar.data.split_rows import TokenizedDataset, check_tokenizer

BLOCK = 4096  # rows per block: the weights hold to 1/BLOCK over every block
LENGTH = 2**62  # rows of the endless mixture, as the iterator sees them (never reached)
_ROUNDS = 4  # Feistel rounds: enough to mix, cheap in numpy
_CACHED_BLOCKS = 4  # a global batch spans a block or two; a few more for with_rows copies


def block_counts(weights: Sequence[float], block: int = BLOCK) -> np.ndarray:
    """Rows per source in a block: ``block * weight / sum`` by largest remainder (ties to the
    earlier source), summing to ``block``."""
    share = np.asarray(weights, dtype=np.float64)
    exact = block * share / share.sum()
    counts = np.floor(exact).astype(np.int64)
    order = np.argsort(-(exact - counts), kind="stable")
    counts[order[: block - int(counts.sum())]] += 1
    return counts


def permute(j: np.ndarray, n: int, key: Sequence[int]) -> np.ndarray:
    """A permutation of ``range(n)`` chosen by ``key``, applied to row numbers ``j``: a Feistel
    network with cycle walking, in numpy so versions cannot change it (docs/data.md,
    "Mixtures")."""
    half = max(1, (max(n - 1, 1).bit_length() + 1) // 2)
    mask = np.uint64((1 << half) - 1)
    keys = np.random.default_rng([*key]).integers(0, 2**63, size=_ROUNDS, dtype=np.uint64)
    x = np.asarray(j, dtype=np.uint64).copy()
    outside = np.ones(x.shape, dtype=bool)
    while outside.any():
        x[outside] = _feistel(x[outside], half, mask, keys)
        outside = x >= np.uint64(n)
    return x.astype(np.int64)


def _feistel(x: np.ndarray, half: int, mask: np.uint64, keys: np.ndarray) -> np.ndarray:
    shift = np.uint64(half)
    left, right = x >> shift, x & mask
    for k in keys:
        # splitmix64's finalizer as the round function: uint64 arithmetic wraps in numpy.
        f = (right ^ k) * np.uint64(0x9E3779B97F4A7C15)
        f ^= f >> np.uint64(31)
        f *= np.uint64(0xBF58476D1CE4E5B9)
        f ^= f >> np.uint64(29)
        left, right = right, left ^ (f & mask)
    return (left << shift) | right


def source_names(paths: Sequence[str]) -> tuple[str, ...]:
    """Short names for metrics: directory names; a repeated one gets ``-<index>``."""
    bases = [Path(p).expanduser().name or str(p) for p in paths]
    return tuple(b if bases.count(b) == 1 else f"{b}-{i}" for i, b in enumerate(bases))


class MixtureDataset:
    """Rows of several :class:`TokenizedDataset` by weight: a ``RowDataset``, plus
    ``count_tokens(indices)`` per source for metrics."""

    split = "train"

    def __init__(self, datasets: Sequence[TokenizedDataset], weights: Sequence[float],
                 names: Sequence[str], seed: int, shuffle: bool = True):
        self.datasets, self.names = tuple(datasets), tuple(names)
        self.weights = tuple(float(w) for w in weights)
        self.seed, self.shuffle = seed, shuffle
        self.seq_len = datasets[0].seq_len
        self.source = "data.sources=[" + ", ".join(d.source for d in datasets) + "]"
        self.counts = block_counts(self.weights)
        self._blocks: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def __len__(self) -> int:
        return LENGTH

    @property
    def tokenizer(self) -> str:
        return self.datasets[0].tokenizer

    @property
    def vocab_size(self) -> int:
        return self.datasets[0].vocab_size

    def locate(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, row in that source) of each mixture row in `indices`."""
        indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        sources = np.empty(len(indices), dtype=np.int64)
        rows = np.empty(len(indices), dtype=np.int64)
        blocks = indices // BLOCK
        for b in np.unique(blocks):
            at = blocks == b
            assign, rank = self._block(int(b))
            s = assign[indices[at] % BLOCK]
            sources[at] = s
            rows[at] = int(b) * self.counts[s] + rank[indices[at] % BLOCK]  # k: s's k-th row
        for s, ds in enumerate(self.datasets):
            at = sources == s
            epoch, j = np.divmod(rows[at], len(ds))
            if self.shuffle:
                for e in np.unique(epoch):
                    here = epoch == e
                    j[here] = permute(j[here], len(ds), (self.seed, s, int(e)))
            rows[at] = j
        return sources, rows

    def rows(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        """Rows `indices` stacked, as :meth:`TokenizedDataset.rows`."""
        sources, rows = self.locate(indices)
        out = {"inputs": np.empty((len(rows), self.seq_len), dtype=np.int32),
               "targets": np.empty((len(rows), self.seq_len), dtype=np.int32),
               "mask": np.empty((len(rows), self.seq_len), dtype=np.float32)}
        for s, ds in enumerate(self.datasets):
            at = np.flatnonzero(sources == s)
            if at.size:
                for key, value in ds.rows(rows[at]).items():
                    out[key][at] = value
        return out

    def segment_ids(self, indices: np.ndarray) -> np.ndarray:
        """Document ids of rows `indices`, as each source gives them."""
        sources, rows = self.locate(indices)
        out = np.empty((len(rows), self.seq_len), dtype=np.int32)
        for s, ds in enumerate(self.datasets):
            at = np.flatnonzero(sources == s)
            if at.size:
                out[at] = ds.segment_ids(rows[at])
        return out

    def count_tokens(self, indices: np.ndarray) -> np.ndarray:
        """int64 [sources]: real target tokens (mask sum) rows `indices` take from each."""
        sources, rows = self.locate(indices)
        return np.array([ds.target_counts(rows[sources == s]).sum()
                         for s, ds in enumerate(self.datasets)], dtype=np.int64)

    def describe(self) -> str:
        """One line for the train log."""
        parts = ", ".join(f"{n} {c / BLOCK:.1%} of {len(d):,} rows" for n, c, d
                          in zip(self.names, self.counts, self.datasets, strict=True))
        return (f"data train: a mixture of {len(self.datasets)} tokenized sources ({parts}); "
                f"rows of {self.seq_len}, tokenizer={self.tokenizer}")

    def _block(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """Block `b`: each position's source, and its rank among that source's positions."""
        if b not in self._blocks:
            if self.shuffle:
                sources = np.repeat(np.arange(len(self.counts)), self.counts)
                assign = np.random.default_rng([self.seed, b]).permutation(sources)
            else:  # evenly spread: source s at positions (k + 1/2) / count_s of the block
                key = np.concatenate([(np.arange(c) + 0.5) / c for c in self.counts if c])
                which = np.repeat(np.arange(len(self.counts)), self.counts)
                assign = which[np.argsort(key, kind="stable")]
            rank = np.empty(BLOCK, dtype=np.int64)
            for s, c in enumerate(self.counts):
                rank[assign == s] = np.arange(c)
            if len(self._blocks) >= _CACHED_BLOCKS:
                self._blocks.pop(next(iter(self._blocks)))
            self._blocks[b] = (assign, rank)
        return self._blocks[b]


def open_mixture(sources: Sequence[tuple[str, float]], seq_len: int, *, tokenizer: str,
                 seed: int, shuffle: bool = True, checksums: bool = False) -> MixtureDataset:
    """The ``train`` splits of ``(path, weight)`` pairs as one mixture. One-line ValueError
    naming ``data.sources[i]`` for a path not tokenized, mismatched tokenizers (or not
    ``tokenizer``), or a weight too small to draw."""
    datasets = []
    for i, (path, _) in enumerate(sources):
        label = f"data.sources[{i}].path={path!r}"
        if not is_tokenized(path):
            raise ValueError(f"{label} is not a directory written by jaxpar tokenize (it has no "
                             "index.json); a mixture reads tokenized directories only")
        ds = TokenizedDataset.open(path, "train", seq_len, checksums=checksums, label=label)
        made_with, first = ds.index.tokenizer, (datasets or [ds])[0].index.tokenizer
        if not datasets:  # the first must be data.tokenizer, the others the first's
            check_tokenizer(ds, tokenizer, label)
        elif made_with.sha256 != first.sha256:
            raise ValueError(f"{label} was tokenized with {made_with.name} but data.sources[0]."
                             f"path={sources[0][0]!r} with {first.name}: a mixture needs one "
                             "tokenizer")
        datasets.append(ds)
    weights = [w for _, w in sources]
    counts = block_counts(weights)
    for i, c in enumerate(counts):
        if c == 0:
            raise ValueError(f"data.sources[{i}].weight={weights[i]} is under 1/{BLOCK} of the "
                             f"weights' sum ({sum(weights)}): its rows would never be drawn")
    return MixtureDataset(datasets, weights, source_names([p for p, _ in sources]), seed,
                          shuffle)
