"""Fine-tuning an imported model on chat data: ``jaxpar import-hf`` of a tiny random qwen2
with a chat template beside its tokenizer, then the train step's loss on a batch of the chat
rows (``data.loss_on=assistant``, ``train.init_from`` the import) equals transformers' mean
cross-entropy over the same rows' assistant targets, and a few steps train from it."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from helpers import env_without_device_flags, metrics, run_jaxpar, write_chat
from hf_models import (
    BOS,
    EOS,
    VOCAB,
    build_hf_model,
    char_text,
    hf_logits,
    save_char_tokenizer,
    trainer_from_import,
)

from jaxpar.cli.main import main
from jaxpar.train.loop import make_data_iterator

USER, ASSISTANT = char_text([3, 4]), char_text([5, 6])  # the role markers: ordinary tokens
TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}" + USER
    + "{% elif m['role'] == 'assistant' %}" + ASSISTANT
    + "{% else %}{{ raise_exception('Unknown role: ' + m['role']) }}{% endif %}"
    "{{ m['content'] }}</s>{% endfor %}{% if add_generation_prompt %}" + ASSISTANT
    + "{% endif %}"
)


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """(checkpoint directory, the model directory, a chat .jsonl of 40 conversations)."""
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("sft")
    source = root / "qwen2"
    build_hf_model("qwen2", bos_token_id=BOS, eos_token_id=EOS).save_pretrained(source)
    save_char_tokenizer(source, adds_bos=False)
    config = json.loads((source / "tokenizer_config.json").read_text())
    (source / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template":
                                                                       TEMPLATE}))
    assert main(["import-hf", str(source), "--to", str(root / "ckpt")]) == 0
    rng = np.random.default_rng(0)
    text = lambda n: char_text(rng.integers(7, VOCAB, n))  # noqa: E731
    chat = write_chat(root / "chat.jsonl", [
        {"messages": [{"role": "user", "content": text(12)},
                      {"role": "assistant", "content": text(8)},
                      {"role": "user", "content": text(6)},
                      {"role": "assistant", "content": text(10)}]}
        if i % 2 else {"prompt": text(20), "completion": text(9)} for i in range(40)])
    return root / "ckpt", source, chat


def test_the_chat_loss_of_an_import_is_transformers_masked_mean(imported, capsys):
    ckpt, source, chat = imported
    trainer, state = trainer_from_import(ckpt / "config.yaml", [
        f"data.source={chat}", "data.loss_on=assistant", "data.document_mask=false",
        "data.val_fraction=0.0", "data.shuffle=false"], 1)
    batch = next(make_data_iterator(trainer.cfg)[0])
    mask = batch["mask"]
    assert 0.2 < mask.mean() < 0.6  # the assistant's tokens only
    loss = float(trainer.loss_and_grads(state, trainer.put_batch(batch))[0])

    logits = hf_logits(source, batch["inputs"]).astype(np.float64)
    log_z = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    target = np.take_along_axis(logits, batch["targets"][..., None], axis=-1)[..., 0]
    expected = float(((log_z - target) * mask).sum() / mask.sum())
    assert abs(loss - expected) <= 1e-5 * expected, (loss, expected)


def test_a_few_steps_fine_tune_the_import(imported, tmp_path):
    ckpt, _, chat = imported
    result = run_jaxpar("train", str(ckpt / "config.yaml"), f"data.source={chat}",
                        "data.loss_on=assistant", "train.steps=3", "train.seq_len=64",
                        "train.batch_size=2", "logging.every=1", "logging.progress=false",
                        "host_devices=1", "mesh.data=-1", "checkpoint.enabled=false",
                        f"run_dir={tmp_path / 'run'}", env=env_without_device_flags())
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"weights from {ckpt}" in result.stdout  # train.init_from: the import
    assert "attention within each document" in result.stdout
    rows = [r for r in metrics(tmp_path / "run") if "loss" in r]
    assert len(rows) == 3 and all(math.isfinite(r["loss"]) for r in rows)
