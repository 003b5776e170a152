"""Chat data (``data.loss_on=assistant``): rendering with the chat template, the mask on the
assistant's tokens, packing, the masked loss, and one-line errors (jaxpar/data/chat.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from helpers import CHATML, save_chat_tokenizer, write_chat

# The data extra's tokenizers and jinja2: chat data renders and tokenizes with them.
pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

from jaxpar.config import ConfigError, documents_masked, load_config, validate  # noqa: E402
from jaxpar.data import build_dataset, make_tokenizer  # noqa: E402
from jaxpar.data.chat import ChatTemplate, Conversation, encode_conversation, parse_conversation  # noqa: E402

# One that renders user and assistant messages only and drops any other role silently.
SILENT = (
    "{% for m in messages %}{% if m['role'] == 'user' %}Q: {{ m['content'] }}\n"
    "{% elif m['role'] == 'assistant' %}A: {{ m['content'] }}<|endoftext|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}A: {% endif %}"
)
TOY_CHAT = Path(__file__).parents[2] / "jaxpar" / "data" / "toy_chat.jsonl"


def pieces(tokenizer, ids) -> list[str]:
    return [tokenizer.decode([int(i)]) for i in ids]


def expected_weights(tokens: list[str]) -> list[float]:
    """By hand, from the ChatML tokens alone: 1 from after ``<|im_start|>assistant\\n`` up to
    and including the ``<|im_end|>`` and newline that close the turn."""
    out, inside, i = [], False, 0
    header = ["<|im_start|>", *"assistant", "\n"]
    while i < len(tokens):
        if not inside and tokens[i: i + len(header)] == header:
            out += [0.0] * len(header)
            i += len(header)
            inside = True
            continue
        out.append(1.0 if inside else 0.0)
        if inside and tokens[i] == "\n" and i and tokens[i - 1] == "<|im_end|>":
            inside = False
        i += 1
    return out


@pytest.fixture
def chat_tokenizer(tmp_path):
    return make_tokenizer(save_chat_tokenizer(tmp_path / "tok"))


def test_the_mask_is_one_exactly_on_the_assistant_tokens(chat_tokenizer):
    conv = Conversation("c.jsonl:1", parse_conversation(json.dumps({"messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "ok"}, {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"}]}), "c.jsonl line 1"))
    text, spans = ChatTemplate(chat_tokenizer.name).assistant_text(conv)
    assert [text[a:b] for a, b in spans] == ["ok<|im_end|>\n", "4<|im_end|>\n"]
    ids, weights = encode_conversation(chat_tokenizer, text, spans)
    tokens = pieces(chat_tokenizer, ids)
    assert "".join(tokens) == text
    turns = [  # (tokens, their weight), by hand
        (["<|im_start|>", *"system\nBe brief.", "<|im_end|>", "\n"], 0.0),
        (["<|im_start|>", *"user\nhi", "<|im_end|>", "\n"], 0.0),
        (["<|im_start|>", *"assistant\n"], 0.0), (["o", "k", "<|im_end|>", "\n"], 1.0),
        (["<|im_start|>", *"user\n2+2?", "<|im_end|>", "\n"], 0.0),
        (["<|im_start|>", *"assistant\n"], 0.0), (["4", "<|im_end|>", "\n"], 1.0),
    ]
    assert tokens == [t for part, _ in turns for t in part]
    assert list(weights) == [w for part, w in turns for _ in part]
    assert list(weights) == expected_weights(tokens)


def test_generation_tags_render_their_body(tmp_path):
    tagged = CHATML.replace("{{ m['content'] }}<|im_end|>\n",
                            "{% if m['role'] == 'assistant' %}{% generation %}"
                            "{{ m['content'] }}<|im_end|>\n{% endgeneration %}"
                            "{% else %}{{ m['content'] }}<|im_end|>\n{% endif %}")
    assert "{% generation %}" in tagged
    plain = make_tokenizer(save_chat_tokenizer(tmp_path / "plain"))
    tok = make_tokenizer(save_chat_tokenizer(tmp_path / "tagged", tagged))
    conv = Conversation("c:1", parse_conversation('{"prompt": "q", "completion": "a"}', "c"))
    assert (ChatTemplate(tok.name).assistant_text(conv)
            == ChatTemplate(plain.name).assistant_text(conv))


# Llama 3's (Instruct) template: BOS first, headers, contents trimmed, <|eot_id|> ends a turn.
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)


def test_a_llama3_template_marks_the_trimmed_answers_and_their_end_of_turn(tmp_path):
    path = save_chat_tokenizer(tmp_path / "tok", LLAMA3)
    config = json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())
    (tmp_path / "tok" / "tokenizer_config.json").write_text(
        json.dumps(config | {"bos_token": "<|begin_of_text|>"}))
    conv = Conversation("c:1", ({"role": "system", "content": "S"},
                                {"role": "user", "content": "hi "},
                                {"role": "assistant", "content": " ok"},
                                {"role": "user", "content": "q"},
                                {"role": "assistant", "content": "a"}))
    text, spans = ChatTemplate(path).assistant_text(conv)
    assert text.startswith("<|begin_of_text|><|start_header_id|>system")
    assert [text[a:b] for a, b in spans] == ["ok<|eot_id|>", "a<|eot_id|>"]


def test_prompt_and_completion_are_a_user_and_an_assistant_message():
    messages = parse_conversation('{"prompt": "Q?", "completion": "A."}', "f line 1")
    assert messages == ({"role": "user", "content": "Q?"},
                        {"role": "assistant", "content": "A."})


def test_packed_rows_carry_the_assistant_mask_and_document_ids(chat_tokenizer, tmp_path):
    records = [{"prompt": f"q{i}", "completion": "a" * (1 + i % 3)} for i in range(6)]
    records.append({"messages": [{"role": "user", "content": "x"},
                                 {"role": "assistant", "content": "y"},
                                 {"role": "user", "content": "z"},
                                 {"role": "assistant", "content": "w"}]})
    source = write_chat(tmp_path / "chat.jsonl", records)
    ds = build_dataset(source, chat_tokenizer, seq_len=16, val_fraction=0.0,
                       loss_on="assistant")
    assert ds.n_documents == len(records)
    rows = ds.rows(np.arange(len(ds)))
    stream = np.concatenate([rows["inputs"].reshape(-1), rows["targets"][-1, -1:]])
    stream = stream[: ds.n_tokens]
    # By hand: each conversation's ChatML weights, 0 on the end-of-text between them.
    eos = chat_tokenizer.eos_id
    tokens = pieces(chat_tokenizer, stream)
    docs, start = [], 0
    for i, t in enumerate(stream):
        if t == eos:
            docs.append(tokens[start:i])
            start = i + 1
    docs.append(tokens[start:])
    assert len(docs) == len(records)
    weights = np.concatenate([np.r_[expected_weights(d), 0.0] for d in docs])[: ds.n_tokens]
    target_weights = np.r_[weights[1:], np.zeros(len(rows["mask"].reshape(-1)))]
    np.testing.assert_array_equal(rows["mask"].reshape(-1),
                                  target_weights[: rows["mask"].size])
    assert rows["mask"].sum() > 0
    # Document ids restart in each row and step after each end-of-text (up to the padding).
    ids = ds.segment_ids(np.arange(len(ds)))
    position = np.arange(ids.size).reshape(ids.shape)[:, 1:]
    real = position < ds.n_tokens
    np.testing.assert_array_equal((np.diff(ids, axis=1) > 0)[real],
                                  (rows["inputs"][:, :-1] == eos)[real])


def test_loss_on_all_keeps_the_text_path(chat_tokenizer, tmp_path):
    source = write_chat(tmp_path / "t.jsonl", [{"text": "hello world"}] * 4)
    ds = build_dataset(source, chat_tokenizer, seq_len=8, val_fraction=0.0)
    assert ds.weights is None
    assert ds.rows(np.arange(len(ds)))["mask"].sum() == ds.n_tokens - 1


def test_the_masked_loss_equals_a_hand_computed_reference(chat_tokenizer, tmp_path):
    """Mean cross entropy over the assistant's targets, from the rows' mask, against a loop
    over the hand-marked assistant tokens of the stream."""
    source = write_chat(tmp_path / "chat.jsonl",
                        [{"prompt": f"p{i}", "completion": f"c{i}!"} for i in range(4)])
    ds = build_dataset(source, chat_tokenizer, seq_len=12, val_fraction=0.0,
                       loss_on="assistant")
    rows = ds.rows(np.arange(len(ds)))
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(*rows["targets"].shape, chat_tokenizer.vocab_size))
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    picked = np.take_along_axis(logp, rows["targets"][..., None], -1)[..., 0]
    masked = -(picked * rows["mask"]).sum() / rows["mask"].sum()

    tokens = pieces(chat_tokenizer, ds.tokens[: ds.n_tokens])
    hand, doc = [], []
    for tok in tokens + ["<|endoftext|>"]:
        if tok == "<|endoftext|>":
            hand += expected_weights(doc) + [0.0]
            doc = []
        else:
            doc.append(tok)
    losses = []
    for p in range(1, ds.n_tokens):  # the target at stream position p is row (p-1)//S's
        if hand[p] == 1.0:
            r, c = divmod(p - 1, ds.seq_len)
            z = logits[r, c]
            losses.append(np.log(np.exp(z).sum()) - z[int(ds.tokens[p])])
    assert len(losses) == rows["mask"].sum()
    np.testing.assert_allclose(masked, np.mean(losses), rtol=1e-12)


def test_the_toy_chat_set_renders_with_chatml(chat_tokenizer):
    ds = build_dataset(str(TOY_CHAT), chat_tokenizer, seq_len=64, val_fraction=0.1,
                       loss_on="assistant")
    assert ds.n_documents >= 20
    assert 0 < ds.rows(np.arange(len(ds)))["mask"].mean() < 0.5


# --- errors: one line naming the file, line or field -----------------------------------------


@pytest.mark.parametrize("template, message", [
    (CHATML, r"chat\.jsonl:2: the chat template .* rejects this conversation: Unknown role: tool"),
    (SILENT, r"chat\.jsonl:2: message 2's role 'tool' is not one the chat template .* renders"),
])
def test_a_role_the_template_does_not_know_is_named(tmp_path, template, message):
    tok = make_tokenizer(save_chat_tokenizer(tmp_path / "tok", template))
    source = write_chat(tmp_path / "chat.jsonl", [
        {"prompt": "a", "completion": "b"},
        {"messages": [{"role": "user", "content": "a"}, {"role": "tool", "content": "t"},
                      {"role": "assistant", "content": "b"}]}])
    with pytest.raises(ValueError, match=message) as err:
        build_dataset(source, tok, seq_len=4, val_fraction=0.0, loss_on="assistant")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("split", ["train", "validation"])
def test_a_bad_conversation_is_named_whichever_split_it_is_in(chat_tokenizer, tmp_path, split):
    good = [{"prompt": f"q{i}", "completion": "a"} for i in range(9)]
    bad = {"messages": [{"role": "narrator", "content": "x"}]}
    source = write_chat(tmp_path / "chat.jsonl", [*good, bad])
    with pytest.raises(ValueError, match=r"chat\.jsonl:10: .*Unknown role: narrator"):
        build_dataset(source, chat_tokenizer, seq_len=4, split=split, val_fraction=0.5,
                      loss_on="assistant")


@pytest.mark.parametrize("line, message", [
    ('{"text": "no chat here"}', r'line 2: expected "messages" .* or string "prompt" and'),
    ('{"messages": []}', r'line 2: "messages" must be a non-empty list'),
    ('{"messages": [{"role": "user"}]}', r'line 2: message 1 needs string "role" and "content"'),
    ('{"prompt": "x"', r"line 2: invalid JSON"),
])
def test_a_line_that_is_not_a_conversation_is_named(chat_tokenizer, tmp_path, line, message):
    source = write_chat(tmp_path / "chat.jsonl", [{"prompt": "a", "completion": "b"}, line])
    with pytest.raises(ValueError, match=message) as err:
        build_dataset(source, chat_tokenizer, seq_len=4, val_fraction=0.0, loss_on="assistant")
    assert "\n" not in str(err.value) and "chat.jsonl" in str(err.value)


def test_a_tokenizer_without_a_chat_template_is_named(tmp_path):
    tok = make_tokenizer(save_chat_tokenizer(tmp_path / "tok", template=None))
    source = write_chat(tmp_path / "chat.jsonl", [{"prompt": "a", "completion": "b"}])
    with pytest.raises(ValueError, match=r"tokenizer_config\.json: no chat_template"):
        build_dataset(source, tok, seq_len=4, val_fraction=0.0, loss_on="assistant")


def test_a_chat_template_jinja_file_beside_the_tokenizer_is_read(tmp_path):
    tok = make_tokenizer(save_chat_tokenizer(tmp_path / "tok", template=None))
    (tmp_path / "tok" / "chat_template.jinja").write_text(CHATML)
    source = write_chat(tmp_path / "chat.jsonl", [{"prompt": "a", "completion": "b"}] * 2)
    ds = build_dataset(source, tok, seq_len=4, val_fraction=0.0, loss_on="assistant")
    assert ds.rows(np.arange(len(ds)))["mask"].sum() == 2 * 3  # "b<|im_end|>\n" twice


def test_the_byte_tokenizer_has_no_chat_template(tmp_path):
    source = write_chat(tmp_path / "chat.jsonl", [{"prompt": "a", "completion": "b"}])
    with pytest.raises(ValueError, match=r"data\.loss_on=assistant needs data\.tokenizer"):
        build_dataset(source, make_tokenizer("byte"), seq_len=4, loss_on="assistant")


@pytest.mark.parametrize("overrides, message", [
    (["data.loss_on=assistants"], r"data\.loss_on: 'assistants' is not allowed; allowed values: "
                                  r"all, assistant"),
    (["data.loss_on=assistant"], r"data\.loss_on=assistant with data\.tokenizer=byte"),
    (["data.loss_on=assistant", "data.tokenizer=t.json"],
     r"data\.loss_on=assistant with data\.source=stdlib"),
])
def test_the_config_checks_loss_on(overrides, message):
    with pytest.raises(ConfigError, match=message) as err:
        validate(load_config("tiny", overrides), 1)
    assert "\n" not in str(err.value)


def test_loss_on_defaults_to_all_and_assistant_masks_documents():
    cfg = load_config("tiny", [])
    assert cfg.data.loss_on == "all"
    chat = load_config("tiny", ["data.loss_on=assistant"])
    assert documents_masked(chat)


# --- the train loop's data: batches, and errors as ConfigError (the CLI's exit 2) ---------------


def _chat_config(source: str, tokenizer: str):
    return validate(load_config("tiny", [
        f"data.source={source}", f"data.tokenizer={tokenizer}", "data.loss_on=assistant",
        "data.val_fraction=0.1", "train.seq_len=32", "train.batch_size=2", "mesh.data=1"]), 1)


def test_the_loop_reads_chat_batches_with_document_ids(tmp_path):
    from jaxpar.train.loop import make_data_iterator

    tok = save_chat_tokenizer(tmp_path / "tok")
    data, line = make_data_iterator(_chat_config(str(TOY_CHAT), tok))
    batch = next(data)
    assert set(batch) == {"inputs", "targets", "mask", "segment_ids"}
    assert 0 < batch["mask"].sum() < batch["mask"].size
    assert "attention within each document" in line


def test_a_bad_chat_file_is_one_config_error_line(tmp_path):
    from jaxpar.train.loop import make_data_iterator

    tok = save_chat_tokenizer(tmp_path / "tok")
    source = write_chat(tmp_path / "chat.jsonl", [
        {"messages": [{"role": "narrator", "content": "x"},
                      {"role": "assistant", "content": "y"}]}] * 3)
    with pytest.raises(ConfigError, match=r"chat\.jsonl:1: .*Unknown role: narrator") as err:
        make_data_iterator(_chat_config(source, tok))
    assert "\n" not in str(err.value)
