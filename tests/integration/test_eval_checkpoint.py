"""``jaxpar eval CKPT --data DIR``: the loss of a checkpoint on a tokenized split, the same on
one device and on ``data=2 tensor=2``, equal to transformers' on the exported model and the same
rows; bits per byte from the text bytes ``jaxpar tokenize`` records; bad input as one line,
exit 2, before anything compiles."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
from helpers import assert_one_line_error, env_without_device_flags, run_jaxpar
from hf_models import scorable_checkpoint

from jaxpar.data.pretokenize import TokenizeOptions, tokenize
from jaxpar.data.shards import DTYPES
from jaxpar.data.split_rows import TokenizedDataset

pytest.importorskip("transformers")

SHAPE = ["train.seq_len=32", "train.batch_size=4"]


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    return scorable_checkpoint(tmp_path_factory.mktemp("eval"))


def eval_json(made, out, *args: str) -> dict:
    result = run_jaxpar("eval", str(made["checkpoint"]), "--data", str(made["data"]), *SHAPE,
                        "--json", str(out), *args, env=env_without_device_flags())
    assert result.returncode == 0, result.stderr[-3000:]
    assert "loss " in result.stdout and "bits_per_byte " in result.stdout
    return json.loads(out.read_text())


def transformers_loss(made) -> tuple[float, int]:
    """(summed nats, targets) of the exported model on every row of the validation split."""
    import torch
    from transformers import AutoModelForCausalLM

    ds = TokenizedDataset.open(str(made["data"]), "validation", 32)
    rows = ds.rows(np.arange(len(ds)))
    model = AutoModelForCausalLM.from_pretrained(made["hf"], dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor(rows["inputs"], dtype=torch.long)).logits.double()
    nats = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), torch.tensor(rows["targets"]).long().reshape(-1),
        reduction="none").numpy()
    mask = rows["mask"].reshape(-1)
    return float((nats * mask).sum()), int(mask.sum())


def test_the_loss_is_the_same_on_any_mesh_and_equals_transformers(made, tmp_path):
    """1 device, data=2 tensor=2, and a two-stage pipeline (its own step) agree."""
    one = eval_json(made, tmp_path / "one.json")
    four = eval_json(made, tmp_path / "four.json", "--mesh", "data=2,tensor=2",
                     "host_devices=4")
    piped = eval_json(made, tmp_path / "piped.json", "--mesh", "pipe=2", "host_devices=2",
                      "train.grad_accum=2")
    nats, targets = transformers_loss(made)
    index = json.loads((made["data"] / "index.json").read_text())
    split = index["splits"]["validation"]
    # Every target of the split: every token but the first and the trailing end-of-text id.
    assert one["tokens"] == four["tokens"] == targets == split["tokens"] - 2
    assert one["rows"] == one["split_rows"] == math.ceil(targets / 32)
    assert abs(one["loss"] - nats / targets) <= 1e-5 * nats / targets
    for other in (four, piped):
        assert abs(other["loss"] - one["loss"]) <= 1e-5 * one["loss"]
    assert one["perplexity"] == pytest.approx(math.exp(one["loss"]), rel=1e-12)
    assert one["text_bytes"] == split["text_bytes"] > 0
    assert one["bits_per_byte"] == pytest.approx(
        one["loss"] * one["tokens"] / math.log(2) / split["text_bytes"], rel=1e-12)


def test_the_index_records_the_text_bytes_of_each_split(made, tmp_path):
    index = json.loads((made["data"] / "index.json").read_text())
    corpus = sum(len(p.read_text(encoding="utf-8").encode()) for p in made["corpus"].iterdir())
    assert sum(s["text_bytes"] for s in index["splits"].values()) == corpus
    # A corpus too small for its validation fraction: one document is moved to validation
    # after the run, its bytes recounted from its ids (here with the BPE tokenizer).
    small = tokenize(TokenizeOptions(sources=(str(made["corpus"]),), directory=tmp_path / "t",
                                     tokenizer=str(made["checkpoint"] / "tokenizer.json"),
                                     val_fraction=1e-6))
    (moved,) = small.splits["validation"]
    ds = TokenizedDataset.open(str(tmp_path / "t"), "validation", 8)
    texts = {p.read_text(encoding="utf-8") for p in made["corpus"].iterdir()}
    from jaxpar.data.tokenizer import make_tokenizer

    ids = np.fromfile(tmp_path / "t" / moved.tokens_file, dtype=DTYPES[ds.index.dtype])
    text = make_tokenizer(str(made["checkpoint"] / "tokenizer.json")).decode(ids[:-1].tolist())
    assert text in texts and moved.text_bytes == len(text.encode())
    assert sum(s.text_bytes for v in small.splits.values() for s in v) == corpus


def test_part_of_the_split_or_an_old_index_gives_no_bits_per_byte(made, tmp_path):
    part = eval_json(made, tmp_path / "part.json", "--batches", "2")
    assert part["rows"] == 8 and part["tokens"] == 8 * 32
    assert part["bits_per_byte"] is None and "--batches covers 8 of" in part["bits_per_byte_note"]
    old = tmp_path / "old"
    shutil.copytree(made["data"], old)
    index = json.loads((old / "index.json").read_text())
    for split in index["splits"].values():
        del split["text_bytes"]
        for shard in split["shards"]:
            del shard["text_bytes"]
    (old / "index.json").write_text(json.dumps(index))
    result = run_jaxpar("eval", str(made["checkpoint"]), "--data", str(old), *SHAPE,
                        env=env_without_device_flags())
    assert result.returncode == 0, result.stderr[-3000:]
    assert "bits_per_byte  - (the data's index.json records no text bytes" in result.stdout


def test_bad_input_is_one_line_before_anything_compiles(made, tmp_path):
    ckpt, data = str(made["checkpoint"]), str(made["data"])
    byte_data = tmp_path / "bytes"
    tokenize(TokenizeOptions(sources=(str(made["corpus"]),), directory=byte_data,
                             val_fraction=0.2))
    cases = [
        ((str(tmp_path / "nope"), "--data", data), ("no complete checkpoint",)),
        ((ckpt, "--data", str(tmp_path / "missing")), ("--data", "missing")),
        ((ckpt, "--data", str(byte_data)), ("not the tokenizer", "byte")),
        ((ckpt, "--data", data, "model.vocab_size=256"), ("300 ids", "model.vocab_size=256")),
        ((ckpt, "--data", data, "--json", str(tmp_path / "no" / "e.json")), ("--json",)),
        ((ckpt, "--data", data, "--mesh", "data=16"), ("16 devices asked for",)),
    ]
    for args, needles in cases:
        result = run_jaxpar("eval", *args, *SHAPE)
        assert_one_line_error(result, *needles, empty_stdout=True)


def test_the_text_files_score_as_their_tokenized_directory(made, tmp_path):
    """``--data`` the corpus itself: tokenized and split here as training does, the same rows
    as ``jaxpar tokenize`` wrote, so the same loss; no bits per byte (no byte counts)."""
    tokenized = eval_json(made, tmp_path / "tok.json")
    result = run_jaxpar("eval", str(made["checkpoint"]), "--data", str(made["corpus"]), *SHAPE,
                        "data.val_fraction=0.2", "--json", str(tmp_path / "text.json"),
                        env=env_without_device_flags())
    assert result.returncode == 0, result.stderr[-3000:]
    text = json.loads((tmp_path / "text.json").read_text())
    assert (text["rows"], text["tokens"]) == (tokenized["rows"], tokenized["tokens"])
    assert abs(text["loss"] - tokenized["loss"]) <= 1e-6 * tokenized["loss"]
    assert text["bits_per_byte"] is None and "jaxpar tokenize" in text["bits_per_byte_note"]


def test_a_config_that_masks_documents_is_scored_with_its_masks_on_any_mesh(made, tmp_path):
    """With data.document_mask the eval batches carry the split's document ids: the loss moves
    (rows cross documents) and stays the same on another mesh."""
    plain = eval_json(made, tmp_path / "plain.json", "data.document_mask=false")
    masked = eval_json(made, tmp_path / "masked.json", "data.document_mask=true")
    masked4 = eval_json(made, tmp_path / "masked4.json", "data.document_mask=true",
                        "--mesh", "data=2,tensor=2", "host_devices=4")
    assert masked["tokens"] == plain["tokens"]
    assert masked["loss"] != plain["loss"]
    assert abs(masked4["loss"] - masked["loss"]) <= 1e-5 * masked["loss"]
