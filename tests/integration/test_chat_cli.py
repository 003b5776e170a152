"""``jaxpar train`` on chat data (``data.loss_on=assistant``): a few steps on the toy chat set
train with a finite loss, a chat file with a role the template does not know is one line and
exit 2 before anything compiles, and the rendering is transformers' ``apply_chat_template``'s."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from helpers import (
    CHATML,
    assert_one_line_error,
    env_without_device_flags,
    metrics,
    run_jaxpar,
    save_chat_tokenizer,
    write_chat,
)

from jaxpar.data.chat import ChatTemplate, read_conversations

TOY_CHAT = Path(__file__).parents[2] / "jaxpar" / "data" / "toy_chat.jsonl"
TRAIN = ["train.steps=3", "logging.every=1", "logging.progress=false", "host_devices=1",
         "checkpoint.enabled=false", "train.seq_len=64", "train.batch_size=4",
         "data.loss_on=assistant", "data.val_fraction=0.1"]


def test_a_few_steps_on_the_toy_chat_set(tmp_path):
    tok = save_chat_tokenizer(tmp_path / "tok")
    result = run_jaxpar("train", "tiny", f"data.source={TOY_CHAT}", f"data.tokenizer={tok}",
                        f"run_dir={tmp_path / 'run'}", *TRAIN, env=env_without_device_flags())
    assert result.returncode == 0, result.stderr[-3000:]
    assert "attention within each document" in result.stdout
    rows = [r for r in metrics(tmp_path / "run") if "loss" in r]
    assert len(rows) == 3 and all(math.isfinite(r["loss"]) for r in rows)


def test_an_unknown_role_is_one_line_and_exit_2(tmp_path):
    tok = save_chat_tokenizer(tmp_path / "tok")
    source = write_chat(tmp_path / "chat.jsonl", [
        {"prompt": "a", "completion": "b"},
        {"messages": [{"role": "narrator", "content": "x"},
                      {"role": "assistant", "content": "y"}]}])
    result = run_jaxpar("train", "tiny", f"data.source={source}", f"data.tokenizer={tok}",
                        f"run_dir={tmp_path / 'run'}", *TRAIN, env=env_without_device_flags())
    assert_one_line_error(result, "chat.jsonl:2", "Unknown role: narrator")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


TAGGED = CHATML.replace("{{ m['content'] }}<|im_end|>\n",
                        "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}"
                        "<|im_end|>\n{% endgeneration %}{% else %}{{ m['content'] }}"
                        "<|im_end|>\n{% endif %}")


@pytest.mark.parametrize("template", [CHATML, TAGGED], ids=["chatml", "generation-tags"])
def test_the_rendering_is_transformers_apply_chat_template(tmp_path, template):
    transformers = pytest.importorskip("transformers")
    tok = save_chat_tokenizer(tmp_path / "tok", template)
    reference = transformers.PreTrainedTokenizerFast(tokenizer_file=tok,
                                                     eos_token="<|endoftext|>")
    reference.chat_template = template
    ours = ChatTemplate(tok)
    for conv in read_conversations(str(TOY_CHAT)):
        messages = [dict(m) for m in conv.messages]
        for prompt in (False, True):
            expected = reference.apply_chat_template(messages, tokenize=False,
                                                     add_generation_prompt=prompt)
            assert ours.render(messages, add_generation_prompt=prompt) == expected, conv.key
    assert json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())["chat_template"]
