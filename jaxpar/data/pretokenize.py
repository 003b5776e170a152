"""``jaxpar tokenize``: sources in, a tokenized directory out (:mod:`jaxpar.data.shards`).

One process reads the documents in order and decides everything that shapes the output: each
document's split, and where each shard ends (after the document that brings it to
``shard_tokens``). Worker processes only turn batches of texts into token ids, and their results
are consumed in submission order, so the bytes written do not depend on the number of workers.
At most a few batches are in flight and tokens go to disk as they arrive: host memory holds a
few batches and one shard's document offsets, never the corpus.

Each finished shard is recorded in ``progress.json`` (:mod:`jaxpar.data.pretokenize_progress`); an
interrupted run keeps every finished shard, and ``resume`` goes on from them.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import multiprocessing
import os
import signal
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import numpy as np

from jaxpar.data import pretokenize_progress
from jaxpar.data.dataset import split_score
from jaxpar.data.shards import (
    SPLIT_NAMES,
    Shard,
    ShardWriter,
    TokenIndex,
    read_index,
    token_dtype,
    tokenizer_info,
)
from jaxpar.data.sources import Document, iter_documents
from jaxpar.data.tokenizer import Tokenizer, make_tokenizer

DEFAULT_SHARD_TOKENS = 2**27  # 256 MiB of uint16 ids: few files, and little to redo on resume


@dataclasses.dataclass(frozen=True)
class TokenizeOptions:
    sources: tuple[str, ...]  # each anything data.source accepts
    directory: Path
    tokenizer: str = "byte"
    text_field: str = "text"
    val_fraction: float = 0.01
    shard_tokens: int = DEFAULT_SHARD_TOKENS
    workers: int = 1  # 1: tokenize in this process
    resume: bool = False
    batch_documents: int = 512  # texts per tokenizer call; bounds a batch with batch_bytes
    batch_bytes: int = 1 << 22


@dataclasses.dataclass(frozen=True)
class TokenizeStats:
    """This run's work so far (a resumed run counts what it does, not what it found done)."""

    documents: int = 0
    text_bytes: int = 0  # UTF-8 bytes of the texts tokenized
    tokens: int = 0  # ids written, end-of-text ids included
    shards: int = 0  # shards finished, earlier runs' included
    skipped: int = 0  # documents already in finished shards


@dataclasses.dataclass(frozen=True)
class _Encoded:
    tokens: np.ndarray  # a batch's documents, each followed by the end-of-text id
    ends: np.ndarray  # where each document (with its end-of-text id) ends in `tokens`
    document_bytes: np.ndarray  # UTF-8 bytes of each document's text

    @property
    def text_bytes(self) -> int:
        return int(self.document_bytes.sum())


def tokenize(options: TokenizeOptions,
             on_progress: Callable[[TokenizeStats], None] | None = None) -> TokenIndex:
    """Tokenize `options.sources` into `options.directory`; its index. ValueError (one line)
    for bad options, sources or directories, before anything is written."""
    _check(options)
    tokenizer = make_tokenizer(options.tokenizer)
    settings = TokenIndex(
        tokenizer=tokenizer_info(tokenizer, options.tokenizer),
        dtype=token_dtype(tokenizer.vocab_size), sources=options.sources,
        text_field=options.text_field, val_fraction=options.val_fraction,
        shard_tokens=options.shard_tokens, splits={})
    state = pretokenize_progress.prepare(options.directory, settings, options.resume)
    if state is None:  # resumed a run that had already finished
        return read_index(options.directory, f"--to {options.directory}")
    if not state.complete:
        state = _stream(options, tokenizer, state, on_progress or (lambda stats: None))
    return pretokenize_progress.finish(options.directory, state)


def _check(options: TokenizeOptions) -> None:
    if not options.sources:
        raise ValueError("jaxpar tokenize: no SOURCE given")
    if not 0.0 <= options.val_fraction < 1.0:
        raise ValueError(f"--val-fraction must be in [0, 1), got {options.val_fraction}")
    for name in ("shard_tokens", "workers", "batch_documents", "batch_bytes"):
        if getattr(options, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(options, name)}")


def _stream(options: TokenizeOptions, tokenizer: Tokenizer, state: pretokenize_progress.RunState,
            on_progress: Callable[[TokenizeStats], None]) -> pretokenize_progress.RunState:
    """Read, tokenize and write every document not yet in a finished shard."""
    documents = _documents(options)
    first = next(documents, None)  # an empty corpus is an error before the directory exists
    if first is None:
        sources = " ".join(options.sources)
        raise ValueError(f"{sources}: the corpus is empty (no non-empty documents)")
    options.directory.mkdir(parents=True, exist_ok=True)
    writer = _SplitWriter(options.directory, state)
    stats = TokenizeStats(shards=writer.finished_shards)
    tally = _Tally()
    batches = _batches(itertools.chain([first], documents), state, options, tally)
    try:
        with _Encoder(options, tokenizer) as encoder:
            for metas, encoded in encoder.encode(batches):
                for (position, split, score), end, length, size in zip(
                        metas, encoded.ends, np.diff(encoded.ends, prepend=0),
                        encoded.document_bytes, strict=True):
                    writer.add(position, split, score, encoded.tokens[end - length:end],
                               int(size))
                stats = dataclasses.replace(
                    stats, documents=stats.documents + len(metas),
                    text_bytes=stats.text_bytes + encoded.text_bytes,
                    tokens=stats.tokens + len(encoded.tokens), skipped=tally.skipped,
                    shards=writer.finished_shards)
                on_progress(stats)
        state = writer.close(total=tally.documents)
    finally:
        writer.abandon()  # after an interruption: the open shards stay unrecorded temporaries
    on_progress(dataclasses.replace(stats, shards=writer.finished_shards))
    return state


def _documents(options: TokenizeOptions) -> Iterator[Document]:
    # iter_documents checks each source (it exists, it holds readable files) as it is called:
    # every source before the first document is read.
    streams = [iter_documents(s, text_field=options.text_field) for s in options.sources]
    return itertools.chain.from_iterable(streams)


Meta = tuple[int, str, float]  # (stream position, split, split score) of one document


@dataclasses.dataclass
class _Tally:
    """Documents read from the stream so far, and how many of them were already done."""

    documents: int = 0
    skipped: int = 0


def _batches(documents: Iterator[Document], state: pretokenize_progress.RunState,
             options: TokenizeOptions, tally: _Tally) -> Iterator[tuple[list[Meta], list[str]]]:
    """(metas, texts) per batch of documents still to tokenize."""
    metas: list[Meta] = []
    texts: list[str] = []
    size = 0
    for position, document in enumerate(documents):
        tally.documents = position + 1
        score = split_score(document.key)
        split = "validation" if score < options.val_fraction else "train"
        if position < state.next_document[split]:  # in a finished shard (resume)
            tally.skipped += 1
            continue
        metas.append((position, split, score))
        texts.append(document.text)
        size += len(document.text)
        if len(texts) >= options.batch_documents or size >= options.batch_bytes:
            yield metas, texts
            metas, texts, size = [], [], 0
    if texts:
        yield metas, texts


class _SplitWriter:
    """Documents into the shards of their split; a shard is finished after the document that
    brings it to ``shard_tokens``, and recorded (``progress.json``) at once."""

    def __init__(self, directory: Path, state: pretokenize_progress.RunState):
        self._directory, self._state = directory, state
        self._limit = state.settings.shard_tokens
        self._open: dict[str, ShardWriter | None] = {s: None for s in SPLIT_NAMES}
        self._shards = {s: list(state.shards[s]) for s in SPLIT_NAMES}
        # Documents of the split so far: the finished shards hold exactly those before
        # next_document, and a resumed run goes on from there.
        self._count = {s: sum(x.documents for x in state.shards[s]) for s in SPLIT_NAMES}
        self._next = dict(state.next_document)
        self._lowest, self._highest = state.lowest_train, state.highest_validation

    @property
    def finished_shards(self) -> int:
        return sum(len(v) for v in self._shards.values())

    def add(self, position: int, split: str, score: float, tokens: np.ndarray,
            text_bytes: int) -> None:
        extreme = (score, position, self._count[split])
        self._count[split] += 1
        # validation_mask's argmin/argmax: the first of equal scores wins.
        if split == "train" and (self._lowest is None or extreme[:2] < self._lowest[:2]):
            self._lowest = extreme
        if split == "validation" and (self._highest is None or
                                      (score, -position) > (self._highest[0], -self._highest[1])):
            self._highest = extreme
        if self._open[split] is None:
            self._open[split] = ShardWriter(self._directory, split, len(self._shards[split]),
                                            self._state.settings.dtype)
        self._open[split].add(tokens, text_bytes=text_bytes)
        if self._open[split].tokens >= self._limit:
            self._finish(split, position + 1)
            pretokenize_progress.save(self._directory, self._snapshot())

    def _finish(self, split: str, next_document: int) -> Shard:
        shard = self._open[split].finish()
        self._open[split] = None
        self._shards[split].append(shard)
        self._next[split] = next_document
        return shard

    def _snapshot(self, **changes) -> pretokenize_progress.RunState:
        return dataclasses.replace(
            self._state, shards={k: tuple(v) for k, v in self._shards.items()},
            next_document=dict(self._next), lowest_train=self._lowest,
            highest_validation=self._highest, **changes)

    def close(self, total: int) -> pretokenize_progress.RunState:
        """Finish the open shards: the stream of `total` documents is done."""
        for split in SPLIT_NAMES:
            if self._open[split] is not None:
                self._finish(split, total)
        state = self._snapshot(documents=total, complete=True)
        pretokenize_progress.save(self._directory, state)
        return state

    def abandon(self) -> None:
        for split in SPLIT_NAMES:
            if self._open[split] is not None:
                self._open[split].close()
                self._open[split] = None


class _Encoder:
    """Batches of texts to token ids, in this process or in worker processes; results come
    back in submission order, with at most two batches per worker in flight."""

    def __init__(self, options: TokenizeOptions, tokenizer: Tokenizer):
        self._options, self._tokenizer = options, tokenizer
        self._pool: ProcessPoolExecutor | None = None

    def __enter__(self) -> _Encoder:
        if self._options.workers > 1:
            # spawn, not fork: this process may run threads (a progress bar, the tokenizer's
            # own), and a forked child inherits their locks in whatever state they are.
            self._pool = ProcessPoolExecutor(self._options.workers,
                                             mp_context=multiprocessing.get_context("spawn"),
                                             initializer=_start_worker)
            _start_ignoring_ctrl_c(self._pool, self._options.workers)
        return self

    def __exit__(self, exc_type, *exc: object) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=exc_type is None, cancel_futures=True)

    def encode(self, batches: Iterator[tuple[object, list[str]]]
               ) -> Iterator[tuple[object, _Encoded]]:
        dtype, eos = self._dtype_and_eos()
        if self._pool is None:
            for tag, texts in batches:
                yield tag, _encode(self._tokenizer, texts, eos, dtype)
            return
        in_flight: collections.deque = collections.deque()
        for tag, texts in batches:
            in_flight.append((tag, self._pool.submit(_encode_in_worker, self._options.tokenizer,
                                                     texts, eos, dtype)))
            if len(in_flight) >= 2 * self._options.workers:
                yield _result(*in_flight.popleft())
        while in_flight:
            yield _result(*in_flight.popleft())

    def _dtype_and_eos(self) -> tuple[str, int]:
        return token_dtype(self._tokenizer.vocab_size), self._tokenizer.eos_id


def _result(tag: object, future: Future) -> tuple[object, _Encoded]:
    try:
        return tag, future.result()
    except BrokenProcessPool:
        raise RuntimeError("a tokenizer worker process died (out of memory?); the finished "
                           "shards are kept: rerun with --resume") from None


def _encode(tokenizer: Tokenizer, texts: list[str], eos_id: int, dtype: str) -> _Encoded:
    ids = tokenizer.encode_batch(texts)
    ends = np.cumsum([len(a) + 1 for a in ids], dtype=np.int64)
    tokens = np.full(int(ends[-1]), eos_id, dtype=np.dtype(dtype))
    for a, end in zip(ids, ends, strict=True):
        tokens[end - 1 - len(a):end - 1] = a
    return _Encoded(tokens, ends, np.array([len(t.encode("utf-8")) for t in texts], np.int64))


def _start_ignoring_ctrl_c(pool: ProcessPoolExecutor, workers: int) -> None:
    """Start ``pool``'s worker processes now (a spawn pool starts one per submitted task until
    it has them all) with SIGINT ignored, which a new process keeps from its parent: a Ctrl-C
    while they still import (before ``_start_worker`` runs) would print a worker's traceback.
    Ctrl-C is the main process's to handle; it is ignored here only while the processes start."""
    if threading.current_thread() is not threading.main_thread():
        return  # signal handlers can only be set from the main thread
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        for _ in range(workers):
            pool.submit(os.getpid)
    finally:
        signal.signal(signal.SIGINT, previous)


def _start_worker() -> None:
    # Ctrl-C is the main process's to handle (it keeps what is finished); several processes
    # already share the cores, so the tokenizer's own threads would only oversubscribe them.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


@functools.lru_cache(maxsize=1)
def _worker_tokenizer(spec: str) -> Tokenizer:
    # A worker process loads the tokenizer once, on its first batch, and keeps it.
    return make_tokenizer(spec)


def _encode_in_worker(spec: str, texts: list[str], eos_id: int, dtype: str) -> _Encoded:
    return _encode(_worker_tokenizer(spec), texts, eos_id, dtype)
