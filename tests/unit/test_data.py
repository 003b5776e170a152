"""Data pipeline: tokenizers, sources, packing, splits and the per-process iterator."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
import time

import numpy as np
import pytest

from jaxpar.data import DataIterator, build_dataset, dataset_line, make_tokenizer

BYTE = make_tokenizer("byte")


def _write_docs(directory, docs: dict[str, str]) -> None:
    for name, text in docs.items():
        path = directory / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


@pytest.fixture
def corpus(tmp_path):
    """A small directory corpus: 40 documents of ~300 bytes each."""
    docs = {
        f"doc{i:02d}.txt": f"document {i}: " + "lorem ipsum dolor " * (10 + i % 7)
        for i in range(40)
    }
    _write_docs(tmp_path, docs)
    return tmp_path, docs


def _stream(ds) -> np.ndarray:
    """The packed token stream, rebuilt from the rows' inputs plus the final target."""
    rows = ds.rows(np.arange(len(ds)))
    return np.concatenate([rows["inputs"].reshape(-1), rows["targets"][-1, -1:]])[: ds.n_tokens]


def _take(it, n: int) -> list[dict[str, np.ndarray]]:
    return [next(it) for _ in range(n)]


def _assert_same_batches(a, b) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys()
        for k in x:
            np.testing.assert_array_equal(x[k], y[k])


# --- tokenizers -------------------------------------------------------------------------------


def test_byte_tokenizer_roundtrip():
    text = "def f(x):\n    return x ** 2  # ünïcødé ✓"
    ids = BYTE.encode(text)
    assert BYTE.vocab_size == 256 and BYTE.eos_id == 0
    assert ids.min() >= 0 and ids.max() < 256 and 0 not in ids
    assert BYTE.decode(ids) == text
    assert BYTE.decode(list(ids)) == text


def test_tokenizer_json_roundtrip_and_packing(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    words = ["hello", "world", "foo", "bar", "[UNK]", "</s>"]
    tok = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]")
    )
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.decoder = tokenizers.decoders.WordPiece()  # joins word tokens with spaces
    tok.add_special_tokens(["</s>"])
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    _write_docs(tmp_path / "corpus", {"a.txt": "hello world", "b.txt": "foo bar baz"})

    hf = make_tokenizer(str(path))
    assert hf.vocab_size == 6 and hf.eos_id == 5
    assert list(hf.encode("hello world foo")) == [0, 1, 2]
    assert hf.decode([0, 1, 3]) == "hello world bar"
    ds = build_dataset(str(tmp_path / "corpus"), hf, seq_len=2, val_fraction=0.0)
    assert list(_stream(ds)) == [0, 1, 5, 2, 3, 4]


def test_an_end_of_text_token_of_its_own_name_comes_from_tokenizer_config(tmp_path):
    """A model's own tokenizer (DeepSeek's ``<｜end▁of▁sentence｜>``) packs and trains with the
    end-of-text token its tokenizer_config.json names; without one, a one-line error."""
    tokenizers = pytest.importorskip("tokenizers")
    words = ["hello", "world", "[UNK]", "<｜end▁of▁sentence｜>"]
    tok = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.add_special_tokens(["<｜end▁of▁sentence｜>"])
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    with pytest.raises(ValueError, match=r"^data\.tokenizer=.*no end-of-text token[^\n]*$"):
        make_tokenizer(str(path))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": {"content": "<｜end▁of▁sentence｜>", "special": True}}))
    assert make_tokenizer(str(path)).eos_id == 3


def test_missing_tokenizer_file_is_one_line_error(tmp_path):
    with pytest.raises(ValueError, match=r"^data\.tokenizer=.*no such file[^\n]*$"):
        make_tokenizer(str(tmp_path / "nope.json"))


# --- packing ----------------------------------------------------------------------------------


def test_packing_rows_are_contiguous_text_with_eos_between_documents(corpus):
    directory, docs = corpus
    ds = build_dataset(str(directory), BYTE, seq_len=64, val_fraction=0.0)
    expected = "\0".join(docs[name] for name in sorted(docs))
    assert BYTE.decode(_stream(ds)) == expected
    assert ds.n_tokens == len(expected.encode())
    assert ds.documents == tuple(sorted(docs))


def test_targets_are_inputs_shifted_by_one(corpus):
    ds = build_dataset(str(corpus[0]), BYTE, seq_len=32, val_fraction=0.0)
    row, next_row = ds[3], ds[4]
    np.testing.assert_array_equal(row["targets"][:-1], row["inputs"][1:])
    assert row["targets"][-1] == next_row["inputs"][0]
    assert row["inputs"].dtype == np.int32 and row["mask"].dtype == np.float32
    assert row["inputs"].shape == row["targets"].shape == row["mask"].shape == (32,)


def test_padding_is_masked(corpus):
    ds = build_dataset(str(corpus[0]), BYTE, seq_len=100, val_fraction=0.0)
    n_targets = ds.n_tokens - 1  # every token but the first is predicted once
    pad = len(ds) * ds.seq_len - n_targets
    assert 0 < pad < ds.seq_len, "pick a seq_len that leaves a partial last row"
    masks = ds.rows(np.arange(len(ds)))["mask"]
    assert masks[:-1].all()
    np.testing.assert_array_equal(masks[-1], [1.0] * (ds.seq_len - pad) + [0.0] * pad)
    assert masks.sum() == n_targets


def test_stdlib_default_corpus_packs_fast_and_respects_max_bytes():
    start = time.perf_counter()
    ds = build_dataset("stdlib", BYTE, seq_len=512)  # default max_bytes: 8 MB
    assert time.perf_counter() - start < 5.0
    assert 7_000_000 < ds.n_tokens <= 8_000_000
    small = build_dataset("stdlib", BYTE, seq_len=128, max_bytes=200_000)
    again = build_dataset("stdlib", BYTE, seq_len=128, max_bytes=200_000)
    assert small.documents == again.documents
    np.testing.assert_array_equal(small.tokens, again.tokens)
    assert not any("site-packages" in key for key in ds.documents)
    line = dataset_line(small)
    assert "\n" not in line and "documents" in line and "tokens" in line and "rows" in line


# --- splits -----------------------------------------------------------------------------------


def test_validation_split_is_disjoint_from_train():
    kwargs = dict(seq_len=64, val_fraction=0.1, max_bytes=400_000)
    train = build_dataset("stdlib", BYTE, split="train", **kwargs)
    val = build_dataset("stdlib", BYTE, split="validation", **kwargs)
    every = build_dataset("stdlib", BYTE, val_fraction=0.0, seq_len=64, max_bytes=400_000)
    assert val.documents and not set(train.documents) & set(val.documents)
    assert set(train.documents) | set(val.documents) == set(every.documents)


def test_document_split_does_not_depend_on_max_bytes():
    kwargs = dict(split="validation", seq_len=64, val_fraction=0.2)
    smaller = build_dataset("stdlib", BYTE, max_bytes=200_000, **kwargs)
    larger = build_dataset("stdlib", BYTE, max_bytes=1_000_000, **kwargs)
    # The last document may be cut short by max_bytes, but it keeps its key and its split.
    assert set(smaller.documents) <= set(larger.documents)
    assert len(larger.documents) > len(smaller.documents)


# --- sources ----------------------------------------------------------------------------------


def test_jsonl_and_text_sources(tmp_path):
    _write_docs(tmp_path, {"a.md": "# title", "sub/b.py": "x = 1", "notes.csv": "ignored"})
    lines = [json.dumps({"text": "first"}), "", json.dumps({"text": "second", "id": 7})]
    (tmp_path / "c.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")

    ds = build_dataset(str(tmp_path), BYTE, seq_len=4, val_fraction=0.0)
    assert ds.documents == ("a.md", "c.jsonl:1", "c.jsonl:3", "sub/b.py")
    assert BYTE.decode(_stream(ds)) == "# title\0first\0second\0x = 1"

    one_file = build_dataset(str(tmp_path / "c.jsonl"), BYTE, seq_len=4, val_fraction=0.0)
    assert BYTE.decode(_stream(one_file)) == "first\0second"
    globbed = build_dataset(str(tmp_path / "**" / "*.py"), BYTE, seq_len=2, val_fraction=0.0)
    assert BYTE.decode(_stream(globbed)) == "x = 1"


def test_max_bytes_cuts_the_last_document(tmp_path):
    _write_docs(tmp_path, {"a.txt": "aaaa", "b.txt": "bbbbbbbb", "c.txt": "cccc"})
    ds = build_dataset(str(tmp_path), BYTE, seq_len=2, val_fraction=0.0, max_bytes=7)
    assert BYTE.decode(_stream(ds)) == "aaaa\0bbb"


@pytest.mark.skipif(importlib.util.find_spec("pyarrow") is None, reason="needs pyarrow")
def test_parquet_source(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["one", None, "two"], "n": [1, 2, 3]}), tmp_path / "d.parquet")
    ds = build_dataset(str(tmp_path / "d.parquet"), BYTE, seq_len=2, val_fraction=0.0)
    assert ds.documents == ("d.parquet:0", "d.parquet:2")
    assert BYTE.decode(_stream(ds)) == "one\0two"


@pytest.mark.skipif(importlib.util.find_spec("pyarrow") is not None, reason="pyarrow present")
def test_parquet_without_pyarrow_says_how_to_install(tmp_path):
    (tmp_path / "d.parquet").write_bytes(b"PAR1")
    with pytest.raises(ImportError, match="pip install pyarrow"):
        build_dataset(str(tmp_path / "d.parquet"), BYTE, seq_len=2)


def test_missing_source_is_one_line_error(tmp_path):
    with pytest.raises(ValueError, match=r"^data\.source='.*missing': no such file[^\n]*$"):
        build_dataset(str(tmp_path / "missing"), BYTE, seq_len=4)


@pytest.mark.parametrize(
    ("files", "source", "split", "message"),
    [
        ({"data.csv": "a,b"}, "data.csv", "train", "unsupported file type"),
        ({"data.csv": "a,b"}, ".", "train", r"no \.txt, .* files in this directory"),
        ({"empty.txt": ""}, "empty.txt", "train", "corpus is empty"),
        ({"bad.jsonl": "{not json"}, "bad.jsonl", "train", "line 1: invalid JSON"),
        ({"bad.jsonl": '{"body": "x"}'}, "bad.jsonl", "train", 'no string field "text"'),
        ({"a.txt": "a"}, "a.txt", "train", "too few for one row"),
        ({"a.txt": "abc"}, "a.txt", "validation", "validation split is empty"),
    ],
)
def test_bad_source_is_one_line_error(tmp_path, files, source, split, message):
    _write_docs(tmp_path, files)
    with pytest.raises(ValueError, match=r"^data\.source=") as error:
        build_dataset(str(tmp_path / source), BYTE, seq_len=4, split=split)
    assert "\n" not in str(error.value)
    assert re.search(message, str(error.value)), error.value


def test_non_utf8_user_file_is_an_error(tmp_path):
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    with pytest.raises(ValueError, match=r"^data\.source=.*UTF-8"):
        build_dataset(str(tmp_path / "latin1.txt"), BYTE, seq_len=2)


def test_corpus_too_small_for_one_batch_is_one_line_error(corpus):
    ds = build_dataset(str(corpus[0]), BYTE, seq_len=512, val_fraction=0.0)
    with pytest.raises(ValueError, match=r"^data\.source=.*fewer than one batch[^\n]*$"):
        DataIterator(ds, global_batch=len(ds) + 1, seed=0)


# --- iterator ---------------------------------------------------------------------------------


def test_iterator_is_deterministic_for_seed(corpus):
    ds = build_dataset(str(corpus[0]), BYTE, seq_len=16, val_fraction=0.0)
    first = _take(DataIterator(ds, global_batch=8, seed=3), 5)
    _assert_same_batches(first, _take(DataIterator(ds, global_batch=8, seed=3), 5))
    other = _take(DataIterator(ds, global_batch=8, seed=4), 5)
    assert not all(
        np.array_equal(a["inputs"], b["inputs"]) for a, b in zip(first, other, strict=True)
    )
    assert first[0]["inputs"].shape == (8, 16)


def test_iterator_covers_every_row_each_epoch_with_a_fresh_shuffle(tmp_path):
    _write_docs(tmp_path, {"a.txt": "".join(chr(33 + i % 90) for i in range(20 * 16 + 1))})
    ds = build_dataset(str(tmp_path), BYTE, seq_len=16, val_fraction=0.0)
    assert len(ds) == 20
    in_order = [row.tobytes() for row in ds.rows(np.arange(20))["inputs"]]
    it = DataIterator(ds, global_batch=5, seed=0)
    epochs = []
    for _ in range(2):
        rows = np.concatenate([batch["inputs"] for batch in _take(it, 4)])
        epochs.append([row.tobytes() for row in rows])
    assert sorted(epochs[0]) == sorted(in_order) == sorted(epochs[1])
    assert epochs[0] != epochs[1] and in_order not in epochs


def test_unshuffled_iterator_walks_rows_in_order(corpus):
    ds = build_dataset(str(corpus[0]), BYTE, seq_len=16, val_fraction=0.0)
    batch = next(DataIterator(ds, global_batch=4, seed=0, shuffle=False))
    np.testing.assert_array_equal(batch["inputs"], ds.rows(np.arange(4))["inputs"])


def test_iterator_state_resumes_exactly(corpus):
    ds = build_dataset(str(corpus[0]), BYTE, seq_len=16, val_fraction=0.0)
    original = DataIterator(ds, global_batch=6, seed=1)
    _take(original, 7)
    state = json.loads(json.dumps(original.get_state()))
    expected = _take(original, 30)  # runs across an epoch boundary

    resumed = DataIterator(ds, global_batch=6, seed=1)
    resumed.set_state(state)
    _assert_same_batches(_take(resumed, 30), expected)


def test_state_from_a_different_stream_is_rejected(corpus):
    ds = build_dataset(str(corpus[0]), BYTE, seq_len=16, val_fraction=0.0)
    state = DataIterator(ds, global_batch=6, seed=1).get_state()
    with pytest.raises(ValueError, match="checkpoint was made for"):
        DataIterator(ds, global_batch=6, seed=2).set_state(state)


def test_rows_select_the_same_positions_of_every_global_batch(corpus):
    # Rows of a process need not be contiguous (a tensor axis straddling processes) and two
    # processes may read the same rows (an axis that replicates the batch spans them).
    ds = build_dataset(str(corpus[0]), BYTE, seq_len=16, val_fraction=0.0)
    single = _take(DataIterator(ds, global_batch=8, seed=5), 4)
    rows = np.array([0, 1, 4, 5])
    part = _take(DataIterator(ds, 8, 5, rows=rows), 4)
    for step, whole in enumerate(single):
        for key in whole:
            np.testing.assert_array_equal(part[step][key], whole[key][rows])


def test_state_resumes_with_other_rows(corpus):
    ds = build_dataset(str(corpus[0]), BYTE, seq_len=16, val_fraction=0.0)
    single = DataIterator(ds, global_batch=8, seed=5)
    _take(single, 3)
    state = single.get_state()
    half = DataIterator(ds, 8, 5, rows=np.arange(4, 8))
    half.set_state(state)
    np.testing.assert_array_equal(next(half)["inputs"], next(single)["inputs"][4:])


def test_with_rows_keeps_the_position(corpus):
    ds = build_dataset(str(corpus[0]), BYTE, seq_len=16, val_fraction=0.0)
    whole = DataIterator(ds, global_batch=8, seed=5)
    _take(whole, 2)
    part = whole.with_rows(np.array([6, 7]))
    np.testing.assert_array_equal(next(part)["inputs"], next(whole)["inputs"][6:])


def test_rows_outside_the_batch_are_rejected(corpus):
    ds = build_dataset(str(corpus[0]), BYTE, seq_len=16, val_fraction=0.0)
    with pytest.raises(ValueError, match="positions in a batch of 6"):
        DataIterator(ds, global_batch=6, seed=0, rows=np.array([5, 6]))


def test_tokenizer_json_without_tokenizers_package_says_how_to_install(tmp_path, monkeypatch):
    (tmp_path / "tokenizer.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # makes `import tokenizers` fail
    with pytest.raises(ImportError, match="pip install tokenizers"):
        make_tokenizer(str(tmp_path / "tokenizer.json"))
