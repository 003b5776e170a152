"""Tokenized corpora (``jaxpar tokenize``, in this process): the format on disk, rows against the
in-memory ``build_dataset`` of the same corpus (the independent reference), the split, resume
after an interruption, document segments, and the errors. Worker processes are the integration
tier's (tests/integration/test_tokenize_cli.py): here everything runs in one process."""

from __future__ import annotations

import ast
import filecmp
import hashlib
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
from helpers import write_bpe_tokenizer, write_text_corpus

from jaxpar.data import DataIterator, build_dataset, make_tokenizer, open_tokenized
from jaxpar.data.dataset import dataset_line, split_score
from jaxpar.data.pretokenize import TokenizeOptions, tokenize
from jaxpar.data.shards import read_index, token_dtype
from jaxpar.data.split_rows import TokenizedDataset

BYTE = make_tokenizer("byte")
SEQ_LEN = 32


@pytest.fixture
def corpus(tmp_path) -> tuple[Path, dict[str, str]]:
    return tmp_path / "corpus", write_text_corpus(tmp_path / "corpus")


def _tokenize(source: Path | str, out: Path, **options) -> None:
    options = {"shard_tokens": 1000, **options}
    tokenize(TokenizeOptions(sources=(str(source),), directory=out, **options))


def _assert_same_rows(a, b) -> None:
    assert len(a) == len(b) > 0
    every = np.arange(len(a))
    rows_a, rows_b = a.rows(every), b.rows(every)
    for key in ("inputs", "targets", "mask"):
        assert rows_a[key].dtype == rows_b[key].dtype
        np.testing.assert_array_equal(rows_a[key], rows_b[key], err_msg=key)


def _stream(ds) -> np.ndarray:
    """The token stream, rebuilt from the rows' inputs plus the final target."""
    rows = ds.rows(np.arange(len(ds)))
    return np.concatenate([rows["inputs"].reshape(-1), rows["targets"][-1, -1:]])[: ds.n_tokens]


def _same_files(a: Path, b: Path) -> None:
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    _, mismatch, errors = filecmp.cmpfiles(a, b, names, shallow=False)
    assert not mismatch and not errors, (mismatch, errors)


# --- rows: the in-memory path is the reference -------------------------------------------------


@pytest.mark.parametrize("val_fraction", [0.0, 0.2])
def test_rows_equal_the_in_memory_rows_of_the_same_corpus(corpus, tmp_path, val_fraction):
    source, _ = corpus
    _tokenize(source, tmp_path / "tok", val_fraction=val_fraction)
    splits = ("train", "validation") if val_fraction else ("train",)
    for split in splits:
        reference = build_dataset(str(source), BYTE, SEQ_LEN, split=split,
                                  val_fraction=val_fraction, max_bytes=None)
        ds = open_tokenized(str(tmp_path / "tok"), split, SEQ_LEN, tokenizer="byte")
        assert len(ds.shards) > (1 if split == "train" else 0)  # rows cross shard boundaries
        assert (ds.n_tokens, ds.n_documents) == (reference.n_tokens, reference.n_documents)
        _assert_same_rows(ds, reference)


def test_rows_equal_the_in_memory_rows_with_a_bpe_tokenizer(corpus, tmp_path):
    pytest.importorskip("tokenizers")
    source, docs = corpus
    path = write_bpe_tokenizer(tmp_path / "tokenizer.json", list(docs.values()))
    _tokenize(source, tmp_path / "tok", tokenizer=str(path), shard_tokens=300)
    reference = build_dataset(str(source), make_tokenizer(str(path)), SEQ_LEN, max_bytes=None)
    ds = open_tokenized(str(tmp_path / "tok"), "train", SEQ_LEN, tokenizer=str(path))
    assert ds.index.tokenizer.vocab_size == 300 and ds.index.dtype == "uint16"
    _assert_same_rows(ds, reference)


@pytest.mark.parametrize("val_fraction", [1e-6, 0.999999])
def test_a_split_left_empty_by_the_hash_gets_one_document_as_in_memory(corpus, tmp_path,
                                                                       val_fraction):
    # No key scores under 1e-6 (none over 0.999999): validation_mask then moves one document,
    # which the streamed run only knows at the end; it must move the same one.
    source, docs = corpus
    scores = [split_score(k) for k in docs]
    assert all(val_fraction <= s for s in scores) or all(s < val_fraction for s in scores)
    _tokenize(source, tmp_path / "tok", val_fraction=val_fraction, shard_tokens=400)
    for split in ("train", "validation"):
        reference = build_dataset(str(source), BYTE, SEQ_LEN, split=split,
                                  val_fraction=val_fraction, max_bytes=None)
        ds = open_tokenized(str(tmp_path / "tok"), split, SEQ_LEN, tokenizer="byte")
        _assert_same_rows(ds, reference)
    assert sorted(p.name for p in (tmp_path / "tok").iterdir() if p.suffix == ".tmp") == []


def test_the_iterator_reads_a_tokenized_split_like_the_in_memory_one(corpus, tmp_path):
    source, _ = corpus
    _tokenize(source, tmp_path / "tok", val_fraction=0.0)
    reference = build_dataset(str(source), BYTE, SEQ_LEN, val_fraction=0.0, max_bytes=None)
    ds = open_tokenized(str(tmp_path / "tok"), "train", SEQ_LEN, tokenizer="byte")
    ours, theirs = DataIterator(ds, 8, seed=3), DataIterator(reference, 8, seed=3)
    for _ in range(5):
        a, b = next(ours), next(theirs)
        for key in a:
            np.testing.assert_array_equal(a[key], b[key])
    assert ours.get_state() == theirs.get_state()
    line = dataset_line(ds)
    assert "tokenized" in line and f"{ds.n_tokens:,} tokens" in line and "\n" not in line



def test_a_resumed_tokenized_stream_gives_the_uninterrupted_batches_to_any_rows(corpus, tmp_path):
    """The iterator's state after 3 batches, restored under another split of the batch's rows
    (another mesh or process count), gives those rows of the batches the run would have had."""
    source, _ = corpus
    _tokenize(source, tmp_path / "tok", val_fraction=0.0)
    ds = open_tokenized(str(tmp_path / "tok"), "train", SEQ_LEN, tokenizer="byte")
    uninterrupted = DataIterator(ds, 8, seed=5)
    for _ in range(3):
        next(uninterrupted)
    saved = uninterrupted.get_state()
    expected = [next(uninterrupted) for _ in range(3)]
    rows = np.array([6, 1, 3])
    resumed = DataIterator(open_tokenized(str(tmp_path / "tok"), "train", SEQ_LEN,
                                          tokenizer="byte"), 8, seed=5, rows=rows)
    resumed.set_state(saved)
    for want in expected:
        got = next(resumed)
        for key in want:
            np.testing.assert_array_equal(got[key], want[key][rows])

# --- the format ---------------------------------------------------------------------------------


def test_index_and_shards_hold_each_document_then_eos(corpus, tmp_path):
    source, docs = corpus
    out = tmp_path / "tok"
    _tokenize(source, out, val_fraction=0.0)
    index = json.loads((out / "index.json").read_text())
    assert index["format"] == "jaxpar-tokens" and index["version"] == 1
    assert index["tokenizer"] == {"name": "byte", "sha256": "byte", "vocab_size": 256,
                                  "eos_id": 0}
    assert index["dtype"] == "uint16" and list(index["splits"]) == ["train"]
    shards = index["splits"]["train"]["shards"]
    assert index["total"]["documents"] == len(docs) == sum(s["documents"] for s in shards)
    texts = iter(docs[name] for name in sorted(docs))
    for shard in shards:
        tokens = (out / f"{shard['name']}.bin").read_bytes()
        offsets = np.frombuffer((out / f"{shard['name']}.offsets").read_bytes(), dtype="<u8")
        assert hashlib.sha256(tokens).hexdigest() == shard["sha256"]
        ids = np.frombuffer(tokens, dtype="<u2")
        assert len(ids) == shard["tokens"] and offsets[-1] == len(ids)
        assert len(offsets) == shard["documents"] + 1
        # A shard ends after the document that reaches shard_tokens, not before.
        assert shard["tokens"] >= 1000 or shard is shards[-1]
        assert shard["tokens"] - (offsets[-1] - offsets[-2]) < 1000
        for begin, end in zip(offsets[:-1], offsets[1:], strict=True):
            assert ids[end - 1] == 0 and BYTE.decode(ids[begin:end - 1]) == next(texts)


def test_the_dtype_is_the_narrowest_that_holds_the_vocabulary():
    assert [token_dtype(v) for v in (256, 65536, 65537, 200_000)] == \
        ["uint16", "uint16", "uint32", "uint32"]


def test_batches_do_not_change_the_bytes_written(corpus, tmp_path):
    # Worker processes get the same batches as the in-process path: if the batching changes
    # nothing, neither does the number of workers (the integration tier runs 1 and 2).
    source, _ = corpus
    _tokenize(source, tmp_path / "a", val_fraction=0.1)
    _tokenize(source, tmp_path / "b", val_fraction=0.1, batch_documents=1)
    _tokenize(source, tmp_path / "c", val_fraction=0.1, batch_bytes=50)
    _same_files(tmp_path / "a", tmp_path / "b")
    _same_files(tmp_path / "a", tmp_path / "c")


def test_data_modules_import_neither_jax_nor_grain():
    # Tokenizing runs without jax: no module of the package imports jax or grain when it is
    # imported, but the iterator's own (loader.py), which jaxpar.data imports on first use.
    package = Path(importlib.util.find_spec("jaxpar.data").origin).parent
    found = []
    for path in sorted(package.glob("*.py")):
        if path.name == "loader.py":
            continue
        for node in ast.parse(path.read_text()).body:  # module level, not inside functions
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{path.name}: {n}" for n in names
                      if n.split(".")[0] in ("jax", "grain", "flax") or n.endswith(".loader")]
    assert not found, found


# --- resume -------------------------------------------------------------------------------------


def test_resume_after_an_interruption_writes_what_an_uninterrupted_run_writes(corpus, tmp_path):
    source, _ = corpus
    _tokenize(source, tmp_path / "whole", val_fraction=0.1, shard_tokens=600)

    def interrupt(stats):
        if stats.shards >= 3:
            raise KeyboardInterrupt

    out = tmp_path / "resumed"
    with pytest.raises(KeyboardInterrupt):
        tokenize(TokenizeOptions(sources=(str(source),), directory=out, val_fraction=0.1,
                                 shard_tokens=600, batch_documents=2), interrupt)
    progress = json.loads((out / "progress.json").read_text())
    finished = [s["name"] for shards in progress["shards"].values() for s in shards]
    assert len(finished) >= 3 and not (out / "index.json").exists()
    assert any(p.suffix == ".tmp" for p in out.iterdir())  # the shard being written
    kept = {name: (out / f"{name}.bin").stat() for name in finished}

    seen = []
    tokenize(TokenizeOptions(sources=(str(source),), directory=out, val_fraction=0.1,
                             shard_tokens=600, resume=True), seen.append)
    _same_files(tmp_path / "whole", out)
    for name, before in kept.items():  # finished shards are not written again
        after = (out / f"{name}.bin").stat()
        assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert seen[-1].skipped > 0 and seen[-1].shards == len(read_index(out, "x").splits["train"]) \
        + len(read_index(out, "x").splits["validation"])

    again = tokenize(TokenizeOptions(sources=(str(source),), directory=out, val_fraction=0.1,
                                     shard_tokens=600, resume=True))
    assert again == read_index(out, "x")  # finished: nothing to do


@pytest.mark.parametrize(("first", "second", "message"), [
    ({}, {}, "already holds a tokenized corpus"),
    ({"interrupt": True}, {}, "continue it with --resume"),
    ({"interrupt": True}, {"resume": True, "shard_tokens": 999}, "shard_tokens: 600 then, 999"),
    ({"interrupt": True}, {"resume": True, "val_fraction": 0.5}, "val_fraction"),
])
def test_a_directory_in_use_is_refused(corpus, tmp_path, first, second, message):
    source, _ = corpus
    out = tmp_path / "tok"

    def interrupt(stats):
        if first.get("interrupt") and stats.shards >= 1:
            raise KeyboardInterrupt

    options = {"sources": (str(source),), "directory": out, "shard_tokens": 600,
               "batch_documents": 2}
    try:
        tokenize(TokenizeOptions(**options), interrupt)
    except KeyboardInterrupt:
        pass
    with pytest.raises(ValueError, match=message):
        tokenize(TokenizeOptions(**{**options, **second}))


def test_a_directory_with_other_files_is_refused(corpus, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"^--to .*out is not an empty directory$"):
        _tokenize(corpus[0], tmp_path / "out")
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["notes.txt"]


# --- document boundaries ------------------------------------------------------------------------


def test_segment_ids_count_documents_within_each_row(corpus, tmp_path):
    source, _ = corpus
    _tokenize(source, tmp_path / "tok", val_fraction=0.0, shard_tokens=500)
    ds = open_tokenized(str(tmp_path / "tok"), "train", SEQ_LEN, tokenizer="byte")
    reference = build_dataset(str(source), BYTE, SEQ_LEN, val_fraction=0.0, max_bytes=None)
    # Reference: the text holds no NUL, so a new document starts right after each eos (0).
    stream = reference.tokens
    for row in range(len(ds)):
        begin = row * SEQ_LEN
        window = stream[begin:begin + SEQ_LEN]
        expected = np.concatenate([[0], np.cumsum(window[:-1] == 0)])
        real = begin + np.arange(SEQ_LEN) <= ds.n_tokens  # the last eos included
        got = ds.segment_ids(np.array([row]))[0]
        np.testing.assert_array_equal(got[real], expected[real])
        if not real.all():  # the padding after the stream: one more segment
            assert set(got[~real]) == {got[real][-1] + 1}
    assert ds.segment_ids(np.arange(len(ds))).shape == (len(ds), SEQ_LEN)
    # The in-memory path counts the same documents (data.document_mask on a stdlib corpus).
    every = np.arange(len(ds))
    np.testing.assert_array_equal(reference.segment_ids(every), ds.segment_ids(every))
    batch = next(DataIterator(reference, 4, seed=0, segments=True))
    assert batch["segment_ids"].shape == (4, SEQ_LEN) and "segment_ids" not in next(
        DataIterator(reference, 4, seed=0))
    assert ds.rows(np.zeros(0, dtype=np.int64))["inputs"].shape == (0, SEQ_LEN)
    with pytest.raises(IndexError):
        ds.rows(np.array([len(ds)]))


# --- errors -------------------------------------------------------------------------------------


def test_start_up_checks_sizes_and_reads_checksums_only_when_asked(corpus, tmp_path):
    source, _ = corpus
    out = tmp_path / "tok"
    _tokenize(source, out, val_fraction=0.0)
    shard = out / "train-00001.bin"
    data = bytearray(shard.read_bytes())
    data[10] ^= 0xFF
    shard.write_bytes(bytes(data))
    open_tokenized(str(out), "train", SEQ_LEN, tokenizer="byte")  # sizes only: not a scan
    with pytest.raises(ValueError, match=r"train-00001\.bin does not match its sha256"):
        open_tokenized(str(out), "train", SEQ_LEN, tokenizer="byte", checksums=True)
    shard.write_bytes(bytes(data[:-2]))
    with pytest.raises(ValueError, match=r"train-00001\.bin has [\d,]+ bytes, index\.json says"):
        open_tokenized(str(out), "train", SEQ_LEN, tokenizer="byte")


def test_a_missing_index_is_named(corpus, tmp_path):
    source, _ = corpus
    out = tmp_path / "tok"
    with pytest.raises(KeyboardInterrupt):
        tokenize(TokenizeOptions(sources=(str(source),), directory=out, shard_tokens=600),
                 _interrupt_after_a_shard)
    with pytest.raises(ValueError, match=r"no index\.json in .*tok \(an unfinished jaxpar "
                                         r"tokenize: rerun it with --resume\)$"):
        open_tokenized(str(out), "train", SEQ_LEN, tokenizer="byte")
    (out / "progress.json").unlink()
    with pytest.raises(ValueError, match=r"no index\.json .*\(shards without their index"):
        open_tokenized(str(out), "train", SEQ_LEN, tokenizer="byte")


def _interrupt_after_a_shard(stats) -> None:
    if stats.shards >= 1:
        raise KeyboardInterrupt


def test_another_tokenizer_than_the_shards_were_made_with_is_refused(corpus, tmp_path):
    pytest.importorskip("tokenizers")
    source, docs = corpus
    path = write_bpe_tokenizer(tmp_path / "tokenizer.json", list(docs.values()))
    _tokenize(source, tmp_path / "tok")
    with pytest.raises(ValueError, match=r"^data\.tokenizer=.*tokenizer\.json' is not the "
                                         r"tokenizer .* \(the byte tokenizer"):
        open_tokenized(str(tmp_path / "tok"), "train", SEQ_LEN, tokenizer=str(path))
    other = tmp_path / "moved.json"  # the same file elsewhere is the same tokenizer
    _tokenize(source, tmp_path / "bpe", tokenizer=str(path))
    other.write_bytes(path.read_bytes())
    open_tokenized(str(tmp_path / "bpe"), "train", SEQ_LEN, tokenizer=str(other))
    with pytest.raises(ValueError, match=r"^data\.tokenizer='byte' is not .*sha256 "):
        open_tokenized(str(tmp_path / "bpe"), "train", SEQ_LEN, tokenizer="byte")


def test_a_split_that_is_not_there_is_named(corpus, tmp_path):
    _tokenize(corpus[0], tmp_path / "tok", val_fraction=0.0)
    with pytest.raises(ValueError, match=r"no validation split \(the directory holds train "):
        TokenizedDataset.open(str(tmp_path / "tok"), "validation", SEQ_LEN)


def test_an_empty_corpus_is_refused_before_anything_is_written(tmp_path):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "empty.txt").write_text("")
    with pytest.raises(ValueError, match=r"the corpus is empty"):
        _tokenize(tmp_path / "corpus", tmp_path / "tok")
    assert not (tmp_path / "tok").exists()


def test_the_text_field_is_configurable_and_a_missing_one_named(tmp_path):
    lines = [json.dumps({"body": "first"}), json.dumps({"body": "second"})]
    (tmp_path / "c.jsonl").write_text("\n".join(lines) + "\n")
    ds = build_dataset(str(tmp_path / "c.jsonl"), BYTE, 2, val_fraction=0.0, text_field="body")
    assert ds.documents == ("c.jsonl:1", "c.jsonl:2")
    with pytest.raises(ValueError, match=r'c\.jsonl line 1: no string field "text" \(the text '
                                         r"field: data\.text_field"):
        _tokenize(tmp_path / "c.jsonl", tmp_path / "tok")
    _tokenize(tmp_path / "c.jsonl", tmp_path / "tok", text_field="body", val_fraction=0.0)
    assert read_index(tmp_path / "tok", "x").splits["train"][0].documents == 2


@pytest.mark.skipif(importlib.util.find_spec("pyarrow") is None, reason="needs pyarrow")
def test_a_parquet_column_that_is_not_there_is_named(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"content": ["one", None, "two"]}), tmp_path / "d.parquet")
    with pytest.raises(ValueError, match=r'd\.parquet has no column "text" \(columns: content\)'):
        _tokenize(tmp_path / "d.parquet", tmp_path / "tok")
    _tokenize(tmp_path / "d.parquet", tmp_path / "tok", text_field="content", val_fraction=0.0)
    ds = TokenizedDataset.open(str(tmp_path / "tok"), "train", 2)
    assert BYTE.decode(_stream(ds)) == "one\0two"


@pytest.mark.skipif(importlib.util.find_spec("datasets") is None,
                    reason="needs the datasets package (pip install datasets)")
def test_a_hugging_face_datasets_directory_is_a_source(tmp_path, corpus):
    import datasets

    _, docs = corpus
    texts = [docs[name] for name in sorted(docs)]
    saved = tmp_path / "saved"
    datasets.Dataset.from_dict({"content": texts, "n": list(range(len(texts)))}) \
        .save_to_disk(str(saved))
    _tokenize(saved, tmp_path / "tok", text_field="content", val_fraction=0.0)
    ds = open_tokenized(str(tmp_path / "tok"), "train", SEQ_LEN, tokenizer="byte")
    assert BYTE.decode(_stream(ds)) == "\0".join(texts)
    with pytest.raises(ValueError, match=r'saved has no column "text" \(columns: content, n\)'):
        _tokenize(saved, tmp_path / "other")
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["a"]})}) \
        .save_to_disk(str(tmp_path / "dict"))
    with pytest.raises(ValueError, match=r"DatasetDict with splits train: name one split's "):
        _tokenize(tmp_path / "dict", tmp_path / "third")
