"""Validation during training reads held-out documents only: the loop's training stream and its
validation batches, from the same corpus, in memory and from a ``jaxpar tokenize`` directory,
share no document (train/validation_loss.py; the split is data/dataset.py's, by document)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from helpers import write_text_corpus

from jaxpar.config import ConfigError, load_config, validate
from jaxpar.data.pretokenize import TokenizeOptions, tokenize
from jaxpar.train.loop import make_data_iterator
from jaxpar.train.validation_loss import eval_due, first_batches

SEQ_LEN, BATCH = 32, 4


def _config(source: Path, *overrides: str):
    return validate(load_config("tiny", [f"data.source={source}", "data.val_fraction=0.25",
                                         "data.shuffle=false", f"train.seq_len={SEQ_LEN}",
                                         f"train.batch_size={BATCH}", "mesh.data=1",
                                         *overrides]), 1)


def _text(batches: list[dict]) -> str:
    """The byte tokenizer's stream again: unshuffled rows are consecutive windows of it."""
    ids = np.concatenate([row for b in batches for row in b["inputs"]])
    return bytes(int(i) for i in ids if 0 < i < 256).decode("utf-8", errors="replace")


def _epoch(cfg, split: str) -> str:
    data, _ = make_data_iterator(cfg, split)
    state = data.get_state()
    return _text([next(data) for _ in range(state["rows"] // state["global_batch"])])


@pytest.mark.parametrize("tokenized", [False, True], ids=["in-memory", "tokenized"])
def test_validation_documents_never_appear_in_training_batches(tmp_path, tokenized):
    docs = write_text_corpus(tmp_path / "corpus", documents=40)
    source = tmp_path / "corpus"
    if tokenized:
        tokenize(TokenizeOptions(sources=(str(source),), directory=tmp_path / "tok",
                                 val_fraction=0.25, shard_tokens=1000))
        source = tmp_path / "tok"
    cfg = _config(source)
    train = _epoch(cfg, "train")
    data, _ = make_data_iterator(cfg, "validation")
    held_out = _text(first_batches(data, 1000))  # capped at the split's whole batches
    # Every document opens with its own header, "document <i>: ".
    headers = {name: text[:text.index(":") + 1] for name, text in docs.items()}
    in_train = {n for n, h in headers.items() if h + " " in train}
    in_val = {n for n, h in headers.items() if h + " " in held_out}
    assert in_val and len(in_train) > len(in_val), (in_train, in_val)
    assert not in_train & in_val
    # No training batch holds any stretch of a held-out document: its text is not a part of
    # the training stream, nor is its header.
    for name in set(docs) - in_train:
        assert headers[name] + " " not in train and docs[name][:SEQ_LEN] not in train


def test_first_batches_stop_at_the_end_of_the_split(tmp_path):
    write_text_corpus(tmp_path / "corpus", documents=40)
    cfg = _config(tmp_path / "corpus")
    data, _ = make_data_iterator(cfg, "validation")
    rows = data.get_state()["rows"]
    batches = first_batches(data, 10_000)
    assert len(batches) == rows // BATCH
    starts = [tuple(b["inputs"][0]) for b in batches]
    assert len(set(starts)) == len(starts)  # no batch twice


def test_eval_runs_every_eval_every_steps_and_at_the_end():
    cfg = validate(load_config("tiny", ["train.steps=10", "train.eval_every=4"]), 8)
    assert [s for s in range(1, 11) if eval_due(cfg, s)] == [4, 8, 10]
    off = validate(load_config("tiny", ["train.steps=10"]), 8)
    assert not any(eval_due(off, s) for s in range(1, 11))


@pytest.mark.parametrize("override, message", [
    ("train.eval_every=-1", "train.eval_every=-1: must be >= 0"),
    ("train.eval_batches=0", "train.eval_batches=0: must be >= 1"),
])
def test_bad_eval_settings_are_config_errors(override, message):
    with pytest.raises(ConfigError, match=message):
        validate(load_config("tiny", [override]), 8)
