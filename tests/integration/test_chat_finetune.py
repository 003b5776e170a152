"""Fine-tuning an imported model on chat data: ``jaxpar import-hf`` of a tiny random qwen2
with a chat template beside its tokenizer, then the train step's loss on a batch of the chat
rows (``data.loss_on=assistant``, ``train.init_from`` the import) equals transformers' mean
cross-entropy over the same rows' assistant targets; and the docs' worked example in small
(docs/fine-tuning.md): LoRA fine-tuning under ``fsdp=2 tensor=2`` lowers the assistant tokens'
loss that ``jaxpar eval`` measures, and the merged export, loaded by transformers, gives that
loss too."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import env_without_device_flags, run_jaxpar, write_chat
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
    # The answers repeat (three of them), so a few steps can learn them: the loss must fall.
    answers = [text(n) for n in (8, 10, 9)]
    chat = write_chat(root / "chat.jsonl", [
        {"messages": [{"role": "user", "content": text(12)},
                      {"role": "assistant", "content": answers[0]},
                      {"role": "user", "content": text(6)},
                      {"role": "assistant", "content": answers[1]}]}
        if i % 2 else {"prompt": text(20), "completion": answers[2]} for i in range(40)])
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


# Attention across the packed conversations (no document mask), as transformers computes a row.
CHAT = ("data.loss_on=assistant", "data.document_mask=false", "train.seq_len=64",
        "train.batch_size=4")


@pytest.fixture(scope="module")
def tuned(imported, tmp_path_factory):
    """The worked example in small: ``jaxpar eval`` of the import, LoRA fine-tuning under
    ``fsdp=2 tensor=2`` from it, ``jaxpar eval`` of the result, the merged export."""
    ckpt, _, chat = imported
    root, env = tmp_path_factory.mktemp("tuned"), env_without_device_flags()
    run = root / "run"
    commands = {
        "train": ("train", str(ckpt / "config.yaml"), f"data.source={chat}", *CHAT,
                  "train.steps=8", "train.lr=0.02", "train.warmup_steps=0",
                  "train.lora.rank=8", "train.lora.alpha=16", "host_devices=4", "mesh.data=1",
                  "mesh.fsdp=2", "mesh.tensor=2", "logging.every=1", "logging.progress=false",
                  f"run_dir={run}"),
        "before": ("eval", str(ckpt), "--data", chat, "--split", "train", *CHAT,
                   "--json", str(root / "before.json")),
        "after": ("eval", str(run), "--data", chat, "--split", "train", *CHAT,
                  "--json", str(root / "after.json")),
        "export": ("export", str(run), "--to", str(root / "hf"), "--format", "hf"),
    }
    out = {}
    for name, args in commands.items():
        result = run_jaxpar(*args, env=env)
        assert result.returncode == 0, (name, result.stderr[-3000:])
        out[name] = result.stdout
    return root, out


def test_lora_fine_tuning_lowers_the_assistant_loss_jaxpar_eval_measures(tuned, imported):
    root, out = tuned
    assert f"weights from {imported[0]}" in out["train"]  # train.init_from: the import
    before, after = (json.loads((root / f"{n}.json").read_text()) for n in ("before", "after"))
    assert before["tokens"] == after["tokens"] > 0
    assert after["loss"] < 0.75 * before["loss"], (before["loss"], after["loss"])
    assert after["bits_per_byte"] is None and "assistant" in after["bits_per_byte_note"]


def test_the_merged_export_gives_the_fine_tuned_loss_in_transformers(tuned, imported):
    from jaxpar.config import load_config
    from jaxpar.data.dataset import build_dataset
    from jaxpar.data.tokenizer import make_tokenizer

    root, _ = tuned
    ckpt, _, chat = imported
    cfg = load_config(str(ckpt / "config.yaml"))
    ds = build_dataset(chat, make_tokenizer(cfg.data.tokenizer), 64, split="train",
                       val_fraction=cfg.data.val_fraction, loss_on="assistant")
    rows = ds.rows(np.arange(len(ds)))
    logits = hf_logits(root / "hf", rows["inputs"]).astype(np.float64)
    log_z = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    target = np.take_along_axis(logits, rows["targets"][..., None], axis=-1)[..., 0]
    mask = rows["mask"]
    expected = float(((log_z - target) * mask).sum() / mask.sum())
    after = json.loads((root / "after.json").read_text())
    assert int(mask.sum()) == after["tokens"]
    assert abs(after["loss"] - expected) <= 1e-4 * expected, (after["loss"], expected)
