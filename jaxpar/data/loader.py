"""The per-process batch iterator: endless, seeded, checkpointable.

Grain shuffles row indices (redrawn each epoch), repeats and batches them into global batches;
its state is one integer. Each process gathers only its devices' rows of each global batch
(``rows``, from ``jaxpar.mesh.process_batch_rows``), so the stream does not depend on the
process count. Why not grain's sharding: docs/data.md, "Training from a tokenized directory".
"""

from __future__ import annotations

from typing import Any, Protocol

import grain
import numpy as np


class RowDataset(Protocol):
    """What the iterator reads: :class:`~jaxpar.data.packing.PackedDataset` (in memory) or
    :class:`~jaxpar.data.split_rows.TokenizedDataset` (on disk)."""

    source: str  # for messages
    split: str
    seq_len: int

    def __len__(self) -> int: ...

    def rows(self, indices: np.ndarray) -> dict[str, np.ndarray]: ...

    def segment_ids(self, indices: np.ndarray) -> np.ndarray: ...


class DataIterator:
    """`next(it)` -> rows `rows` of the next global batch: dict of [len(rows), seq_len] arrays.

    `rows` (default: all): positions in the global batch of `global_batch` rows, any subset in any
    order, the same every batch. The stream depends only on the dataset, `global_batch`, `seed`
    and `shuffle` (not `rows`: the state resumes under another process count); it runs on across
    epochs. `segments` (``data.document_mask``) adds int32 ``segment_ids`` per input position; not
    part of the state.
    """

    def __init__(
        self,
        ds: RowDataset,
        global_batch: int,
        seed: int,
        rows: np.ndarray | None = None,
        shuffle: bool = True,
        segments: bool = False,
    ):
        if global_batch < 1:
            raise ValueError(f"train.batch_size={global_batch} must be >= 1")
        rows = np.arange(global_batch) if rows is None else np.asarray(rows, dtype=np.int64)
        if rows.ndim != 1 or not np.all((0 <= rows) & (rows < global_batch)):
            raise ValueError(f"rows must be positions in a batch of {global_batch}, got {rows}")
        if not 0 <= seed < 2**32:  # grain's shuffle takes a 32-bit seed
            raise ValueError(f"train.seed must be in [0, 2**32), got {seed}")
        if len(ds) < global_batch:
            raise ValueError(
                f"data.source={ds.source!r}: the {ds.split} split has {len(ds)} rows of "
                f"seq_len {ds.seq_len}, fewer than one batch (train.batch_size={global_batch})"
            )
        self._ds, self._rows, self._segments = ds, rows, segments
        self._config = {
            "rows": len(ds),
            "global_batch": global_batch,
            "seed": seed,
            "shuffle": shuffle,
        }
        indices = grain.MapDataset.range(len(ds))
        if shuffle:
            indices = indices.shuffle(seed=seed)
        batches = indices.repeat().batch(global_batch, drop_remainder=True)
        # A mixture counts each source's tokens in the whole global batch (from row numbers,
        # without reading rows), so every process holds the same counts whatever it reads.
        count = getattr(ds, "count_tokens", None)
        self._names: tuple[str, ...] = tuple(getattr(ds, "names", ())) if count else ()
        self._seen = np.zeros(len(self._names), dtype=np.int64)
        local = batches.map(lambda global_rows: (
            self._read(global_rows[rows]),
            count(global_rows) if count else np.zeros(0, dtype=np.int64)))
        # Gathering rows from memory takes microseconds: no worker threads or prefetch, which
        # also keeps the iterator state exactly "batches handed out so far".
        options = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
        self._iter = iter(local.to_iter_dataset(options))

    def _read(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        out = self._ds.rows(indices)
        if self._segments:
            out["segment_ids"] = self._ds.segment_ids(indices)
        return out

    def __iter__(self) -> DataIterator:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        batch, counts = next(self._iter)
        self._seen += counts
        return batch

    def tokens_seen(self) -> dict[str, int]:
        """A mixture's real target tokens drawn per source in the batches handed out (checkpointed);
        empty for a single source."""
        return dict(zip(self._names, self._seen.tolist(), strict=True))

    def with_rows(self, rows: np.ndarray) -> DataIterator:
        """The same stream and position, yielding rows ``rows`` of each global batch."""
        other = DataIterator(self._ds, self._config["global_batch"], self._config["seed"], rows,
                             self._config["shuffle"], self._segments)
        other.set_state(self.get_state())
        return other

    def get_state(self) -> dict[str, Any]:
        """A small JSON-serializable dict, the same on every process at a step."""
        state = {"grain": self._iter.get_state(), **self._config}
        if self._names:
            state["tokens_seen"] = self.tokens_seen()
        return state

    def set_state(self, state: dict[str, Any]) -> None:
        """Resume so the next batch is the one the saved iterator would have produced."""
        saved = {k: state.get(k) for k in self._config}
        if saved != self._config:
            raise ValueError(
                f"data iterator checkpoint was made for {saved}, but this run has {self._config}"
            )
        self._iter.set_state(state["grain"])
        # By name: a source added on resume starts from 0, a dropped one is no longer shown.
        seen = state.get("tokens_seen", {})
        self._seen = np.array([seen.get(n, 0) for n in self._names], dtype=np.int64)
