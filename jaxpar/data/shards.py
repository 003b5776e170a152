"""The on-disk format of a tokenized corpus (``jaxpar tokenize``): shards of token ids, their
document offsets, and one ``index.json``.

Flat little-endian arrays read with ``pread`` give random access with numpy alone. The index
is written last: a directory with one is finished. The format: docs/data.md, "The format".
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from jaxpar.data.tokenizer import Tokenizer

FORMAT = "jaxpar-tokens"
VERSION = 1
INDEX_FILE = "index.json"
PROGRESS_FILE = "progress.json"  # an unfinished run's state (jaxpar tokenize --resume)
SPLIT_NAMES = ("train", "validation")
DTYPES = {"uint16": "<u2", "uint32": "<u4"}  # always little-endian, whatever the machine
OFFSETS_DTYPE = np.dtype("<u8")
_READ_CHUNK = 1 << 24


@dataclasses.dataclass(frozen=True)
class TokenizerInfo:
    """Which tokenizer made the ids: training compares its file's sha256 ("byte" for the byte
    tokenizer); the name is for messages."""

    name: str
    sha256: str
    vocab_size: int
    eos_id: int


@dataclasses.dataclass(frozen=True)
class Shard:
    name: str  # "train-00000": files name.bin (tokens) and name.offsets (document starts)
    tokens: int  # token ids in the shard, end-of-text ids included
    documents: int
    sha256: str  # of name.bin
    offsets_sha256: str  # of name.offsets
    # UTF-8 bytes of the shard's texts (bits per byte, jaxpar eval); None in an index written
    # before jaxpar recorded them.
    text_bytes: int | None = None

    @property
    def tokens_file(self) -> str:
        return self.name + ".bin"

    @property
    def offsets_file(self) -> str:
        return self.name + ".offsets"


@dataclasses.dataclass(frozen=True)
class TokenIndex:
    """``index.json``. ``splits``: split name -> its shards in stream order (empty splits
    absent)."""

    tokenizer: TokenizerInfo
    dtype: str  # a key of DTYPES
    sources: tuple[str, ...]
    text_field: str
    val_fraction: float
    shard_tokens: int
    splits: dict[str, tuple[Shard, ...]]

    def to_json(self) -> dict[str, Any]:
        splits = {name: {"tokens": sum(s.tokens for s in shards),
                         "documents": sum(s.documents for s in shards),
                         "text_bytes": split_text_bytes(shards),
                         "shards": [dataclasses.asdict(s) for s in shards]}
                  for name, shards in self.splits.items()}
        return {"format": FORMAT, "version": VERSION,
                "tokenizer": dataclasses.asdict(self.tokenizer), "dtype": self.dtype,
                "sources": list(self.sources), "text_field": self.text_field,
                "val_fraction": self.val_fraction, "shard_tokens": self.shard_tokens,
                "splits": splits,
                "total": {"tokens": sum(s["tokens"] for s in splits.values()),
                          "documents": sum(s["documents"] for s in splits.values())}}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TokenIndex:
        return cls(tokenizer=TokenizerInfo(**data["tokenizer"]), dtype=data["dtype"],
                   sources=tuple(data["sources"]), text_field=data["text_field"],
                   val_fraction=data["val_fraction"], shard_tokens=data["shard_tokens"],
                   splits={name: tuple(Shard(**s) for s in split["shards"])
                           for name, split in data["splits"].items()})


def split_text_bytes(shards: tuple[Shard, ...]) -> int | None:
    """UTF-8 bytes of a split's texts; None when a shard lacks them (an old index)."""
    counts = [s.text_bytes for s in shards]
    return None if None in counts else sum(counts)


def token_dtype(vocab_size: int) -> str:
    """The narrowest stored dtype that holds every id of the vocabulary."""
    return "uint16" if vocab_size <= 2**16 else "uint32"


def tokenizer_info(tokenizer: Tokenizer, spec: str) -> TokenizerInfo:
    return TokenizerInfo(name=spec, sha256=tokenizer_digest(spec),
                         vocab_size=tokenizer.vocab_size, eos_id=tokenizer.eos_id)


def tokenizer_digest(spec: str) -> str:
    """"byte", or the sha256 of `spec`'s tokenizer.json (its path may differ from the shards';
    its content may not)."""
    if spec == "byte":
        return "byte"
    path = Path(spec).expanduser()
    if not path.is_file():
        raise ValueError(
            f"data.tokenizer={spec!r}: no such file (use 'byte' or a path to a tokenizer.json)")
    return sha256_file(path)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_READ_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def write_json_atomically(path: Path, data: dict[str, Any]) -> None:
    """Write, flush to disk, then rename: a crash leaves the old file or the new one."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def has_index(path: str | Path) -> bool:
    """Whether `path` is a finished tokenized directory."""
    return (Path(path).expanduser() / INDEX_FILE).is_file()


def is_tokenized(path: str | Path) -> bool:
    """Whether ``data.source`` is a directory ``jaxpar tokenize`` wrote or began (so the error
    names its missing index)."""
    return has_index(path) or looks_unfinished(path)


def looks_unfinished(path: str | Path) -> bool:
    """Shards or a progress file but no index: a run stopped before writing it."""
    path = Path(path).expanduser()
    return path.is_dir() and not has_index(path) and (
        (path / PROGRESS_FILE).is_file() or any(path.glob("*-00000.bin")))


def read_index(directory: str | Path, label: str) -> TokenIndex:
    """A tokenized directory's index; missing or unreadable: a one-line error."""
    path = Path(directory).expanduser() / INDEX_FILE
    if not path.is_file():
        if (Path(directory).expanduser() / PROGRESS_FILE).is_file():
            hint = "an unfinished jaxpar tokenize: rerun it with --resume"
        elif looks_unfinished(directory):
            hint = "shards without their index: tokenize again into a new directory"
        else:
            hint = "write one with jaxpar tokenize"
        raise ValueError(f"{label}: no {INDEX_FILE} in {directory} ({hint})")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("format") != FORMAT or data.get("version") != VERSION:
            raise ValueError(f"format {data.get('format')!r} version {data.get('version')!r}, "
                             f"expected {FORMAT!r} version {VERSION}")
        index = TokenIndex.from_json(data)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{label}: {path} is not a jaxpar token index ({e})") from None
    if index.dtype not in DTYPES:
        raise ValueError(f"{label}: {path}: unknown dtype {index.dtype!r}")
    return index


def check_shards(directory: Path, index: TokenIndex, split: str | None, checksums: bool,
                 label: str) -> int:
    """Check each shard file of `split` (None: all) has the index's size, and with `checksums`
    its sha256 (reads every byte). Returns the number checked."""
    itemsize = np.dtype(DTYPES[index.dtype]).itemsize
    splits = index.splits if split is None else {split: index.splits.get(split, ())}
    checked = 0
    for shards in splits.values():
        for shard in shards:
            for name, size, digest in (
                    (shard.tokens_file, shard.tokens * itemsize, shard.sha256),
                    (shard.offsets_file, (shard.documents + 1) * OFFSETS_DTYPE.itemsize,
                     shard.offsets_sha256)):
                _check_file(directory / name, size, digest if checksums else None, label)
            checked += 1
    return checked


def _check_file(path: Path, size: int, digest: str | None, label: str) -> None:
    if not path.is_file():
        raise ValueError(f"{label}: shard file {path} is missing (rerun jaxpar tokenize)")
    actual = path.stat().st_size
    if actual != size:
        raise ValueError(f"{label}: shard file {path} has {actual:,} bytes, {INDEX_FILE} says "
                         f"{size:,} (a partial copy? copy it again or rerun jaxpar tokenize)")
    if digest is not None and sha256_file(path) != digest:
        raise ValueError(f"{label}: shard file {path} does not match its sha256 in "
                         f"{INDEX_FILE} (damaged: copy it again or rerun jaxpar tokenize)")


class ShardWriter:
    """Appends documents to one shard under temporary names; :meth:`finish` makes it final.

    Tokens go to disk as they come, hashed on the way (only offsets stay in memory); nothing is
    visible under the shard's name until all of it is on disk."""

    def __init__(self, directory: Path, split: str, number: int, dtype: str):
        self.name = f"{split}-{number:05d}"
        self._directory, self._dtype = directory, np.dtype(DTYPES[dtype])
        self._file = open(self._tmp(".bin"), "wb")  # noqa: SIM115  (closed by finish/close)
        self._hash = hashlib.sha256()
        self._starts: list[int] = []
        self.tokens = 0
        self.text_bytes = 0

    def _tmp(self, suffix: str) -> Path:
        return self._directory / f"{self.name}{suffix}.tmp"

    @property
    def documents(self) -> int:
        return len(self._starts)

    def add(self, tokens: np.ndarray, starts: np.ndarray | None = None, *,
            text_bytes: int = 0) -> None:
        """Append one document's ids (end-of-text included), or with `starts` several laid end to
        end, `starts` their first positions; `text_bytes`: their texts' UTF-8 size."""
        data = np.ascontiguousarray(tokens, dtype=self._dtype)
        first = [0] if starts is None else np.asarray(starts, dtype=np.int64).tolist()
        self._starts += [self.tokens + s for s in first]
        self._file.write(memoryview(data).cast("B"))
        self._hash.update(memoryview(data).cast("B"))
        self.tokens += len(data)
        self.text_bytes += text_bytes

    def finish(self, rename: bool = True) -> Shard:
        """Flush both files and, with `rename`, give their final names (else the caller does, with
        :func:`rename_shard`, after recording the shard)."""
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        offsets = np.asarray([*self._starts, self.tokens], dtype=OFFSETS_DTYPE)
        with open(self._tmp(".offsets"), "wb") as f:
            f.write(offsets.tobytes())
            f.flush()
            os.fsync(f.fileno())
        shard = Shard(name=self.name, tokens=self.tokens, documents=self.documents,
                      sha256=self._hash.hexdigest(),
                      offsets_sha256=hashlib.sha256(offsets.tobytes()).hexdigest(),
                      text_bytes=self.text_bytes)
        if rename:
            rename_shard(self._directory, shard)
        return shard

    def close(self) -> None:
        """Stop unfinished (interrupted run): the temporary file stays, unrecorded."""
        self._file.close()


def rename_shard(directory: Path, shard: Shard) -> None:
    """Give a finished shard's temporary files their final names; done ones are skipped, so a
    rerun after a crash completes the rest."""
    for name in (shard.tokens_file, shard.offsets_file):
        tmp = directory / (name + ".tmp")
        if tmp.exists():
            os.replace(tmp, directory / name)


def open_memmaps(directory: Path, index: TokenIndex,
                 shard: Shard) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, document offsets) of one shard, memory-mapped read-only."""
    tokens = np.memmap(directory / shard.tokens_file, dtype=DTYPES[index.dtype], mode="r")
    offsets = np.memmap(directory / shard.offsets_file, dtype=OFFSETS_DTYPE, mode="r")
    return tokens, offsets
