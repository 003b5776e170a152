"""``scripts/tiny_chat_model.py``, the model of docs/fine-tuning.md's worked example: transformers
and jaxpar encode its chat-rendered text to the same ids (jaxpar trains on what transformers
will be given), it imports, and ``jaxpar generate --chat`` prompts it through the template."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import assert_one_line_error, env_without_device_flags, run_jaxpar

from jaxpar.data.chat import ChatTemplate, parse_conversation
from jaxpar.data.tokenizer import make_tokenizer

pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[2]
TOY_CHAT = REPO / "jaxpar" / "data" / "toy_chat.jsonl"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-chat")
    made = subprocess.run([sys.executable, str(REPO / "scripts" / "tiny_chat_model.py"),
                           "--to", str(root / "model"), "--layers", "2"],
                          capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr[-3000:]
    result = run_jaxpar("import-hf", str(root / "model"), "--to", str(root / "ckpt"),
                        env=env_without_device_flags())
    assert result.returncode == 0, result.stderr[-3000:]
    return root


def test_transformers_and_jaxpar_encode_the_rendered_chats_alike(model):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(model / "model")
    ours = make_tokenizer(str(model / "ckpt" / "tokenizer.json"))
    template = ChatTemplate(str(model / "ckpt" / "tokenizer.json"))
    for n, line in enumerate(TOY_CHAT.read_text().splitlines()[:10]):
        messages = list(parse_conversation(line, f"line {n + 1}"))
        text = template.render(messages)
        assert text == hf.apply_chat_template(messages, tokenize=False)
        assert ours.encode(text).tolist() == hf(text, add_special_tokens=False)["input_ids"]


def test_generate_chat_renders_the_prompt_with_the_template(model):
    result = run_jaxpar("generate", str(model / "ckpt"), "--chat", "--prompt", "Hi?",
                        "--max-tokens", "4", env=env_without_device_flags())
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("<|im_start|>user\nHi?<|im_end|>\n<|im_start|>assistant\n")


def test_generate_chat_without_a_template_is_one_line(model, tmp_path):
    config = model / "ckpt" / "tokenizer_config.json"
    bare = tmp_path / "tok"
    bare.mkdir()
    (bare / "tokenizer.json").write_bytes((model / "ckpt" / "tokenizer.json").read_bytes())
    (bare / "tokenizer_config.json").write_text(json.dumps(
        {k: v for k, v in json.loads(config.read_text()).items() if k != "chat_template"}))
    result = run_jaxpar("generate", str(model / "ckpt"), "--chat", "--prompt", "Hi?",
                        "--tokenizer", str(bare / "tokenizer.json"))
    assert_one_line_error(result, "--chat", "no chat_template", empty_stdout=True)
