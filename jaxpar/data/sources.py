"""Where documents come from: the standard library, the user's files, or a Hugging Face
`datasets` directory (`save_to_disk`).

`iter_documents` streams a `data.source` deterministically, each document with a stable key
(relative path, plus line/row in multi-document files), one document or Parquet/Arrow batch
at a time, so `jaxpar tokenize` reads corpora larger than memory. Keys decide the split, so
it does not depend on how much was read. User errors: one-line `ValueError` naming
`data.source`.
"""

from __future__ import annotations

import codecs
import glob
import json
import os
import sysconfig
from collections.abc import Iterator
from typing import NamedTuple

PLAIN_TEXT = (".txt", ".md", ".py")
SUPPORTED = (*PLAIN_TEXT, ".jsonl", ".parquet")
_FIELD_HINT = " (the text field: data.text_field, or jaxpar tokenize --field)"


class Document(NamedTuple):
    key: str  # stable identity: relative path, or "path:row" in a .jsonl/.parquet/datasets table
    text: str


def read_documents(
    source: str, max_bytes: int | None = None, text_field: str = "text"
) -> list[Document]:
    """:func:`iter_documents` as a list."""
    return list(iter_documents(source, max_bytes, text_field))


def iter_documents(
    source: str, max_bytes: int | None = None, text_field: str = "text"
) -> Iterator[Document]:
    """Documents of `source` in a fixed order, stopping at `max_bytes` of UTF-8 text.

    The crossing document is cut to fit, even a single huge file. Empty documents are dropped.
    `text_field`: the JSON field or Parquet/`datasets` column with the text. The source is
    checked (exists, known file kinds) before the first document.
    """
    if max_bytes is not None and max_bytes <= 0:
        raise _error(source, f"max_bytes must be positive or None, got {max_bytes}")
    if not text_field:
        raise _error(source, "data.text_field is empty (the JSON field or column with the text)")
    # The stdlib holds a few files in legacy encodings (encoding tests); skip them, whereas a
    # user's own file that cannot be read is an error worth reporting.
    lenient = source == "stdlib"
    files = _stdlib_files() if lenient else user_files(source)
    return _stream(source, files, max_bytes, text_field, lenient)


def _stream(
    source: str, files: list[tuple[str, str]], max_bytes: int | None, field: str, lenient: bool
) -> Iterator[Document]:
    total = 0
    for path, key in files:
        remaining = None if max_bytes is None else max_bytes - total
        for doc in _read_file(source, path, key, remaining, lenient, field):
            size = len(doc.text.encode("utf-8")) if max_bytes is not None else 0
            if max_bytes is not None and total + size > max_bytes:
                text = doc.text.encode("utf-8")[: max_bytes - total].decode("utf-8", "ignore")
                doc, size = Document(doc.key, text), max_bytes - total
            if doc.text:
                yield doc
                total += size
            if max_bytes is not None and total >= max_bytes:
                return


def _error(source: str, message: str) -> ValueError:
    return ValueError(f"data.source={source!r}: {message}")


def _stdlib_files() -> list[tuple[str, str]]:
    """The interpreter's standard-library .py files, without site-packages."""
    root = sysconfig.get_paths()["stdlib"]
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in ("site-packages", "dist-packages")]
        found += [os.path.join(dirpath, f) for f in filenames if f.endswith(".py")]
    return [(p, os.path.relpath(p, root)) for p in sorted(found)]


def user_files(source: str) -> list[tuple[str, str]]:
    """Sorted (path, key) pairs for a file, a directory (recursively) or a glob."""
    path = os.path.expanduser(source)
    if os.path.isfile(path):
        if not path.endswith(SUPPORTED):
            raise _error(source, f"unsupported file type (use one of {', '.join(SUPPORTED)})")
        return [(path, os.path.basename(path))]
    if os.path.isdir(path) and _saved_by_datasets(source, path):
        return [(path, os.path.basename(os.path.normpath(path)))]
    if os.path.isdir(path):
        found = []
        for dirpath, dirnames, filenames in os.walk(path):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            found += [os.path.join(dirpath, f) for f in filenames if not f.startswith(".")]
        matched = [(p, os.path.relpath(p, path)) for p in sorted(found)]
        where = "in this directory"
    elif any(c in path for c in "*?["):
        matched = [(p, p) for p in sorted(glob.glob(path, recursive=True)) if os.path.isfile(p)]
        where = "matching this pattern"
    else:
        raise _error(source, "no such file, directory or glob match")
    # Inside a directory or glob, other files (READMEs without .md, licenses...) are skipped.
    files = [(p, k) for p, k in matched if p.endswith(SUPPORTED)]
    if not files:
        raise _error(source, f"no {', '.join(SUPPORTED)} files {where}")
    return files


def _saved_by_datasets(source: str, path: str) -> bool:
    """Whether `path` is a directory written by `datasets.Dataset.save_to_disk`."""
    if os.path.isfile(os.path.join(path, "dataset_dict.json")):
        splits = sorted(e.name for e in os.scandir(path) if e.is_dir())
        raise _error(source, f"a Hugging Face DatasetDict with splits {', '.join(splits)}: "
                     f"name one split's directory, e.g. {os.path.join(path, splits[0])}"
                     if splits else "an empty Hugging Face DatasetDict")
    return all(os.path.isfile(os.path.join(path, f)) for f in ("state.json", "dataset_info.json"))


def _read_file(
    source: str, path: str, key: str, limit: int | None, lenient: bool, field: str
) -> Iterator[Document]:
    if os.path.isdir(path):
        yield from _read_saved_dataset(source, path, key, field)
    elif path.endswith(PLAIN_TEXT):
        try:
            yield Document(key, _read_text(path, limit))
        except (OSError, UnicodeDecodeError) as e:
            if not lenient:
                raise _error(source, f"cannot read {path} as UTF-8 text ({e})") from e
    elif path.endswith(".jsonl"):
        yield from _read_jsonl(source, path, key, field)
    else:
        yield from _read_parquet(source, path, key, field)


def _read_text(path: str, limit: int | None) -> str:
    """A UTF-8 file, or its first `limit` bytes (never a half character)."""
    with open(path, "rb") as f:
        data = f.read() if limit is None else f.read(limit)
    # When the limit cut the file, an incremental decoder holds back a trailing partial
    # character instead of failing on it; a whole file must decode completely.
    cut = limit is not None and len(data) == limit
    return codecs.getincrementaldecoder("utf-8")().decode(data, final=not cut)


def _read_jsonl(source: str, path: str, key: str, field: str) -> Iterator[Document]:
    try:
        with open(path, encoding="utf-8") as f:
            for line_no, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise _error(source, f"{path} line {line_no}: invalid JSON ({e.msg})") from e
                if not isinstance(record, dict) or not isinstance(record.get(field), str):
                    raise _error(source, f'{path} line {line_no}: no string field "{field}"'
                                 f"{_FIELD_HINT}")
                yield Document(f"{key}:{line_no}", record[field])
    except (OSError, UnicodeDecodeError) as e:
        raise _error(source, f"cannot read {path} as UTF-8 JSON lines ({e})") from e


def _read_parquet(source: str, path: str, key: str, field: str) -> Iterator[Document]:
    try:
        import pyarrow.parquet as pq  # optional dependency, only needed for .parquet sources
    except ImportError as e:
        raise ImportError(
            f"data.source={source!r}: reading .parquet files needs pyarrow: pip install pyarrow"
        ) from e
    try:
        parquet = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises its own error types for corrupt files
        raise _error(source, f"cannot read {path} as Parquet ({e})") from e
    _require_column(source, path, field, parquet.schema_arrow.names)
    texts = (b.column(0).to_pylist() for b in parquet.iter_batches(columns=[field],
                                                                    batch_size=1024))
    yield from _rows(key, texts)


def _read_saved_dataset(source: str, path: str, key: str, field: str) -> Iterator[Document]:
    try:
        import datasets  # optional dependency, only needed for save_to_disk directories
    except ImportError as e:
        raise ImportError(
            f"data.source={source!r}: a Hugging Face datasets directory needs the datasets "
            "package: pip install datasets"
        ) from e
    try:
        # Memory-maps the Arrow files: rows are read batch by batch, never all at once.
        dataset = datasets.load_from_disk(path)
    except Exception as e:  # datasets raises its own error types for damaged directories
        raise _error(source, f"cannot load {path} as a Hugging Face dataset ({e})") from e
    _require_column(source, path, field, dataset.column_names)
    texts = (b[field] for b in dataset.select_columns([field]).iter(batch_size=1024))
    yield from _rows(key, texts)


def _require_column(source: str, path: str, field: str, columns: list[str]) -> None:
    if field not in columns:
        raise _error(source, f'{path} has no column "{field}" (columns: {", ".join(columns)})'
                     f"{_FIELD_HINT}")


def _rows(key: str, batches: Iterator[list]) -> Iterator[Document]:
    """Documents "key:row" of a table's text column, by batch; null rows skipped."""
    row = 0
    for texts in batches:
        for text in texts:
            if text is not None:
                yield Document(f"{key}:{row}", text)
            row += 1
