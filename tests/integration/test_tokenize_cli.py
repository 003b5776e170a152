"""``jaxpar tokenize`` and training from its shards, through the command line: worker processes
write the same bytes as one process, Ctrl-C keeps the finished shards and ``--resume`` completes
them into what an uninterrupted run writes, ``jaxpar train`` reads the directory, and bad input
is one line and exit 2 before anything compiles (``JAX_LOG_COMPILES=1`` would add lines)."""

from __future__ import annotations

import filecmp
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import (
    CORPUS_WORDS,
    assert_one_line_error,
    env_without_device_flags,
    run_jaxpar,
    write_bpe_tokenizer,
    write_text_corpus,
)

TRAIN = ["train.steps=3", "logging.every=1", "logging.progress=false", "host_devices=2",
         "checkpoint.enabled=false"]
ERROR_ENV = dict(os.environ, JAX_LOG_COMPILES="1")


def _same_files(a: Path, b: Path) -> None:
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    _, mismatch, errors = filecmp.cmpfiles(a, b, names, shallow=False)
    assert not mismatch and not errors, (mismatch, errors)


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> tuple[Path, Path]:
    """(a corpus of 200 documents with a .jsonl beside its .txt files, a BPE tokenizer.json
    of 300 ids trained on it)."""
    pytest.importorskip("tokenizers")
    root = tmp_path_factory.mktemp("bpe")
    docs = write_text_corpus(root / "corpus", documents=200)
    lines = [json.dumps({"body": f"record {i}: " + " ".join(CORPUS_WORDS)}) for i in range(20)]
    (root / "extra.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return root, write_bpe_tokenizer(root / "tokenizer.json", list(docs.values()))


def test_workers_write_the_same_bytes_and_train_reads_them(bpe, tmp_path):
    root, tokenizer = bpe
    args = [str(root / "corpus"), str(root / "extra.jsonl"), "--field", "body", "--tokenizer",
            str(tokenizer), "--shard-tokens", "2000", "--val-fraction", "0.05"]
    # One worker in a plain interpreter: tokenizing never imports jax.
    code = ("import sys; from jaxpar.cli.main import main; code = main(sys.argv[1:]); "
            "assert 'jax' not in sys.modules, 'jax imported'; sys.exit(code)")
    one = subprocess.run([sys.executable, "-c", code, "tokenize", *args, "--to",
                          str(tmp_path / "one"), "--workers", "1"],
                         capture_output=True, text=True, timeout=120)
    assert one.returncode == 0, one.stderr[-3000:]
    two = run_jaxpar("tokenize", *args, "--to", str(tmp_path / "two"), "--workers", "2",
                     timeout=120)
    assert two.returncode == 0, two.stderr[-3000:]
    _same_files(tmp_path / "one", tmp_path / "two")
    index = json.loads((tmp_path / "two" / "index.json").read_text())
    assert index["total"]["documents"] == 220 and len(index["splits"]["train"]["shards"]) > 2
    verify = run_jaxpar("tokenize", "--verify", str(tmp_path / "two"), timeout=60)
    assert verify.returncode == 0 and "every size and sha256 matches" in verify.stdout

    run_dir = tmp_path / "run"
    trained = run_jaxpar("train", "tiny", f"data.source={tmp_path / 'two'}",
                         f"data.tokenizer={tokenizer}", "model.vocab_size=320", *TRAIN,
                         f"run_dir={run_dir}", env=env_without_device_flags(), timeout=300)
    assert trained.returncode == 0, trained.stderr[-4000:]
    assert "tokenized: " in trained.stdout and "data train: " in trained.stdout
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(np.isfinite(r["loss"]) for r in rows)


def test_ctrl_c_keeps_the_finished_shards_and_resume_completes_them(bpe, tmp_path):
    root, tokenizer = bpe
    rng = np.random.default_rng(1)
    with open(tmp_path / "big.jsonl", "w", encoding="utf-8") as f:
        for i in range(12_000):  # about 6 MB: seconds of tokenizing, the first shard in 0.1 s
            f.write(json.dumps({"text": f"{i} " + " ".join(rng.choice(CORPUS_WORDS, 80))}) + "\n")
    args = ["tokenize", str(tmp_path / "big.jsonl"), "--tokenizer", str(tokenizer),
            "--shard-tokens", "20000", "--workers", "2"]
    out = tmp_path / "interrupted"
    # A terminal's Ctrl-C signals the whole process group: the workers as well as the main one.
    # SIGINT back to its default in the child (no fork: the test process runs threads): a process
    # started with SIGINT ignored (as the
    # test process may have been, by something that ran before in it) keeps ignoring it, and
    # then the run was never interrupted (twice in full-suite runs, never alone).
    restore = ("import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
               "runpy.run_module('jaxpar.cli', run_name='__main__')")
    run = subprocess.Popen([sys.executable, "-c", restore, *args, "--to", str(out)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           start_new_session=True)
    deadline = time.monotonic() + 120
    while not (out / "progress.json").exists() and run.poll() is None:
        assert time.monotonic() < deadline, "no shard finished in 120 s"
        time.sleep(0.01)
    os.killpg(run.pid, signal.SIGINT)
    stdout, stderr = run.communicate(timeout=60)
    assert run.returncode == 1, (run.returncode, "finished before the signal?", stderr[-2000:])
    assert stderr.startswith("jaxpar: interrupted: ") and len(stderr.splitlines()) == 1, stderr
    assert "finished shard(s) kept" in stderr and "--resume" in stderr
    assert not (out / "index.json").exists()
    progress = json.loads((out / "progress.json").read_text())
    finished = [s for shards in progress["shards"].values() for s in shards]
    assert finished
    for shard in finished:  # each finished shard is on disk, whole
        digest = hashlib.sha256((out / f"{shard['name']}.bin").read_bytes()).hexdigest()
        assert digest == shard["sha256"]

    resumed = run_jaxpar(*args, "--to", str(out), "--resume", timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    whole = run_jaxpar(*args, "--to", str(tmp_path / "whole"), timeout=300)
    assert whole.returncode == 0, whole.stderr[-3000:]
    _same_files(tmp_path / "whole", out)


@pytest.fixture
def byte_shards(tmp_path) -> Path:
    write_text_corpus(tmp_path / "corpus", documents=60)
    result = run_jaxpar("tokenize", str(tmp_path / "corpus"), "--to", str(tmp_path / "tok"),
                        "--shard-tokens", "3000", "--workers", "1", timeout=60)
    assert result.returncode == 0, result.stderr
    return tmp_path / "tok"


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _train_error(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    run_dir = tmp_path / "run"
    result = run_jaxpar("train", "tiny", *TRAIN, f"run_dir={run_dir}", *overrides,
                        env=ERROR_ENV, timeout=120)
    assert not run_dir.exists()  # nothing written
    return result


def test_a_damaged_shard_is_one_line_before_any_compile(byte_shards, tmp_path):
    shard = byte_shards / "train-00001.bin"
    _flip_a_byte(shard)
    verify = run_jaxpar("tokenize", "--verify", str(byte_shards), timeout=60)
    assert_one_line_error(verify, "train-00001.bin", "sha256")
    result = _train_error(tmp_path, f"data.source={byte_shards}", "data.verify=true")
    assert_one_line_error(result, "data.source=", "train-00001.bin does not match its sha256")
    shard.write_bytes(shard.read_bytes()[:-10])
    result = _train_error(tmp_path, f"data.source={byte_shards}")
    assert_one_line_error(result, "train-00001.bin has", "bytes, index.json says")


def test_a_missing_index_is_one_line_before_any_compile(byte_shards, tmp_path):
    (byte_shards / "index.json").unlink()
    result = _train_error(tmp_path, f"data.source={byte_shards}")
    assert_one_line_error(result, "no index.json", "shards without their index")
    verify = run_jaxpar("tokenize", "--verify", str(byte_shards), timeout=60)
    assert_one_line_error(verify, "no index.json")


def test_the_wrong_tokenizer_or_a_small_vocabulary_is_one_line(byte_shards, bpe, tmp_path):
    root, tokenizer = bpe
    result = _train_error(tmp_path, f"data.source={byte_shards}", f"data.tokenizer={tokenizer}")
    assert_one_line_error(result, "data.tokenizer=", "is not the tokenizer", "byte tokenizer")
    made = run_jaxpar("tokenize", str(root / "corpus"), "--to", str(tmp_path / "bpe"),
                      "--tokenizer", str(tokenizer), "--workers", "1", timeout=60)
    assert made.returncode == 0, made.stderr
    result = _train_error(tmp_path, f"data.source={tmp_path / 'bpe'}",
                          f"data.tokenizer={tokenizer}")  # tiny: model.vocab_size=256
    assert_one_line_error(result, "tokenizer has 300 ids", "model.vocab_size=256")


def test_an_empty_source_or_a_missing_field_is_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.txt").write_text("")
    result = run_jaxpar("tokenize", str(tmp_path / "empty"), "--to", str(tmp_path / "out"),
                        timeout=60)
    assert_one_line_error(result, "the corpus is empty", empty_stdout=True)
    assert not (tmp_path / "out").exists()
    (tmp_path / "c.jsonl").write_text(json.dumps({"text": "hello"}) + "\n")
    result = run_jaxpar("tokenize", str(tmp_path / "c.jsonl"), "--to", str(tmp_path / "out"),
                        "--field", "body", timeout=60)
    assert_one_line_error(result, 'no string field "body"', "--field", empty_stdout=True)
    result = _train_error(tmp_path, f"data.source={tmp_path / 'c.jsonl'}",
                          "data.text_field=body")
    assert_one_line_error(result, 'no string field "body"', "data.text_field")
