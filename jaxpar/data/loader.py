"""The per-process batch iterator: endless, seeded, checkpointable.

Grain does the index bookkeeping: a seeded shuffle of row indices that is redrawn each epoch,
endless repetition, batching into global batches, and an iterator whose state is one integer.
Each process then gathers only its own slice of every global batch.

Grain's own sharding (`slice`, `ShardByJaxProcess`) splits the *records* between processes, so
each process would batch a different sub-stream and the union of the per-process batches would
not be the batch a 1-process run sees. Slicing the global batch of indices instead keeps the
stream independent of the process count (the correctness tests compare layouts against a single
device), and it makes a checkpoint resumable with a different number of processes.
"""

from __future__ import annotations

from typing import Any

import grain
import numpy as np

from jaxpar.data.packing import PackedDataset


class DataIterator:
    """`next(it)` -> this process's rows of the next global batch: dict of [B/P, seq_len] arrays.

    Process p gets rows p*B/P : (p+1)*B/P of the global batch of B rows. The stream depends only
    on the dataset, `global_batch`, `seed` and `shuffle`; batches run on across epoch ends.
    """

    def __init__(
        self,
        ds: PackedDataset,
        global_batch: int,
        seed: int,
        process_index: int = 0,
        process_count: int = 1,
        shuffle: bool = True,
    ):
        if global_batch < 1 or global_batch % process_count:
            raise ValueError(
                f"train.batch_size={global_batch} must be a positive multiple of the "
                f"process count {process_count}"
            )
        if not 0 <= process_index < process_count:
            raise ValueError(f"process_index={process_index} not in [0, {process_count})")
        if not 0 <= seed < 2**32:  # grain's shuffle takes a 32-bit seed
            raise ValueError(f"train.seed must be in [0, 2**32), got {seed}")
        if len(ds) < global_batch:
            raise ValueError(
                f"data.source={ds.source!r}: the {ds.split} split has {len(ds)} rows of "
                f"seq_len {ds.seq_len}, fewer than one batch (train.batch_size={global_batch})"
            )
        self._config = {
            "rows": len(ds),
            "global_batch": global_batch,
            "seed": seed,
            "shuffle": shuffle,
        }
        per_process = global_batch // process_count
        lo, hi = process_index * per_process, (process_index + 1) * per_process

        indices = grain.MapDataset.range(len(ds))
        if shuffle:
            indices = indices.shuffle(seed=seed)
        batches = indices.repeat().batch(global_batch, drop_remainder=True)
        local = batches.map(lambda global_rows: ds.rows(global_rows[lo:hi]))
        # Gathering rows from memory takes microseconds: no worker threads or prefetch, which
        # also keeps the iterator state exactly "batches handed out so far".
        options = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
        self._iter = iter(local.to_iter_dataset(options))

    def __iter__(self) -> DataIterator:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        return next(self._iter)

    def get_state(self) -> dict[str, Any]:
        """A small JSON-serializable dict; the same for every process at the same step."""
        return {"grain": self._iter.get_state(), **self._config}

    def set_state(self, state: dict[str, Any]) -> None:
        """Resume so that the next batch is the one the saved iterator would have produced."""
        saved = {k: state.get(k) for k in self._config}
        if saved != self._config:
            raise ValueError(
                f"data iterator checkpoint was made for {saved}, but this run has {self._config}"
            )
        self._iter.set_state(state["grain"])
