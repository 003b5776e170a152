"""Chat data for supervised fine-tuning: conversations rendered with the tokenizer's chat
template, loss on the assistant's tokens only (``data.loss_on=assistant``;
docs/data.md#chat-data).

A chat file is JSON lines: ``{"messages": [{"role": ..., "content": ...}, ...]}``, or
``{"prompt": ..., "completion": ...}`` (user message, assistant answer). Each conversation is
rendered by the Jinja ``chat_template`` of the ``tokenizer_config.json`` (or
``chat_template.jinja``) beside ``data.tokenizer``, as Hugging Face's ``apply_chat_template``
(same sandboxed environment and globals), then tokenized whole.

The assistant's characters: the conversation before each assistant message, rendered with
``add_generation_prompt=True``, must prefix the conversation through it; the characters in
between (answer, end-of-turn marker) are the assistant's. A token starting in such a span has
target weight 1; every other, 0.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from jaxpar.data.sources import user_files

Message = dict[str, str]

# ChatML, as Qwen's tokenizer_config.json spells it (an unknown role raises): the template of
# scripts/tiny_chat_model.py's tokenizer and of the tests' chat tokenizers.
CHATML = (
    "{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Unknown role: ' + m['role']) }}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class Conversation:
    key: str  # "file:line", as the text sources' keys (it decides the split)
    messages: tuple[Message, ...]


class ChatTemplate:
    """The ``chat_template`` of the ``tokenizer_config.json`` beside a tokenizer.json."""

    def __init__(self, tokenizer_path: str):
        path = Path(tokenizer_path).expanduser().with_name("tokenizer_config.json")
        self.path = str(path)
        if tokenizer_path == "byte" or not path.is_file():
            raise ValueError(f"data.loss_on=assistant needs a chat template: no {path} beside "
                             f"data.tokenizer={tokenizer_path!r}")
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            raise ValueError(f"{path}: cannot read it as JSON ({err})") from None
        template = config.get("chat_template") if isinstance(config, dict) else None
        jinja_file = path.with_name("chat_template.jinja")  # where newer transformers save it
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if not isinstance(template, str) or not template.strip():
            raise ValueError(f"{path}: no chat_template (a Jinja string), nor a "
                             "chat_template.jinja beside it; data.loss_on=assistant renders "
                             "conversations with it")
        self.special = {k: _token_text(config.get(k)) for k in ("bos_token", "eos_token")}
        try:
            import jinja2
            import jinja2.ext
            import jinja2.nodes
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError as err:
            raise ImportError("data.loss_on=assistant needs jinja2: pip install jinja2") from err

        def raise_exception(message: str) -> None:
            raise jinja2.exceptions.TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols",
                                                        _generation_tag(jinja2)])
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False,
                                                                  indent=indent)
        env.globals["raise_exception"] = raise_exception
        try:
            self._template = env.from_string(template)
        except jinja2.exceptions.TemplateError as err:
            raise ValueError(f"{path}: chat_template is not valid Jinja ({err})") from None
        self._errors = (jinja2.exceptions.TemplateError,)

    def render(self, messages: Sequence[Message], add_generation_prompt: bool = False) -> str:
        """The text of ``messages``; ValueError on a template error (an unknown role)."""
        try:
            return self._template.render(messages=list(messages),
                                         add_generation_prompt=add_generation_prompt,
                                         **self.special)
        except self._errors as err:
            raise ValueError(str(err).splitlines()[0] if str(err) else type(err).__name__) from None

    def assistant_text(self, conv: Conversation) -> tuple[str, list[tuple[int, int]]]:
        """The rendered conversation and its assistant messages' [start, end) character
        spans. A one-line ValueError naming ``conv.key`` for a role the template does not
        render, or renderings that are not prefixes of one another."""

        def render(messages: Sequence[Message], add_generation_prompt: bool = False) -> str:
            try:
                return self.render(messages, add_generation_prompt)
            except ValueError as err:
                raise ValueError(f"{conv.key}: the chat template ({self.path}) rejects this "
                                 f"conversation: {err}") from None

        where, text = conv.key, render(conv.messages)
        spans, before = [], ""
        for i, message in enumerate(conv.messages):
            upto = render(conv.messages[: i + 1])
            content = message["content"].strip()
            if not upto.startswith(before) or (content and content not in upto[len(before):]):
                raise ValueError(f"{where}: message {i + 1}'s role {message['role']!r} is not "
                                 f"one the chat template ({self.path}) renders")
            if message["role"] == "assistant":
                prompt = render(conv.messages[:i], add_generation_prompt=True)
                if not (prompt.startswith(before) and upto.startswith(prompt)):
                    raise ValueError(f"{where}: the chat template ({self.path}) renders the "
                                     "conversation before assistant message "
                                     f"{i + 1} differently from the whole, so the assistant's "
                                     "tokens cannot be told apart")
                spans.append((len(prompt), len(upto)))
            before = upto
        if not text.startswith(before):
            raise ValueError(f"{where}: the chat template ({self.path}) renders the whole "
                             "conversation differently from its messages one by one")
        if not spans:
            raise ValueError(f"{where}: no assistant message (nothing to train on)")
        return text, spans


def _generation_tag(jinja2: Any) -> type:
    """``{% generation %}...{% endgeneration %}`` (some templates' assistant-mask markup),
    rendered as its body; spans come from the prefixes instead."""

    class Generation(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body, lineno=lineno)

    return Generation


def _token_text(token: Any) -> str:
    token = token.get("content") if isinstance(token, dict) else token
    return token if isinstance(token, str) else ""


def read_conversations(source: str) -> list[Conversation]:
    """The conversations of the .jsonl file(s) ``source`` (file, directory or glob)."""
    files = [(p, k) for p, k in user_files(source) if p.endswith(".jsonl")]
    if not files:
        raise ValueError(f"data.source={source!r}: data.loss_on=assistant reads chat .jsonl "
                         "files (docs/data.md#chat-data)")
    out = []
    for path, key in files:
        try:
            with open(path, encoding="utf-8") as f:
                lines = list(f)
        except (OSError, UnicodeDecodeError) as err:
            raise ValueError(f"data.source={source!r}: cannot read {path} ({err})") from None
        for line_no, line in enumerate(lines, start=1):
            if line.strip():
                out.append(Conversation(f"{key}:{line_no}",
                                        parse_conversation(line, f"{path} line {line_no}")))
    return out


def parse_conversation(line: str, where: str) -> tuple[Message, ...]:
    """One JSON line as messages; ``where`` (file and line) starts every error."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"{where}: invalid JSON ({err.msg})") from None
    if isinstance(record, dict) and "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            raise ValueError(f'{where}: "messages" must be a non-empty list of '
                             '{"role": ..., "content": ...}')
        for i, m in enumerate(messages, start=1):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                    and isinstance(m.get("content"), str)):
                raise ValueError(f'{where}: message {i} needs string "role" and "content"')
        return tuple({"role": m["role"], "content": m["content"]} for m in messages)
    if (isinstance(record, dict) and isinstance(record.get("prompt"), str)
            and isinstance(record.get("completion"), str)):
        return ({"role": "user", "content": record["prompt"]},
                {"role": "assistant", "content": record["completion"]})
    raise ValueError(f'{where}: expected "messages" (a list of role/content) or string '
                     '"prompt" and "completion"')


def encode_conversation(tokenizer: Any, text: str, spans: Sequence[tuple[int, int]]
                        ) -> tuple[np.ndarray, np.ndarray]:
    """(int32 ids, float32 weights): ``text`` tokenized (special tokens recognised, none added),
    weight 1 on tokens whose first character lies in ``spans``."""
    ids, offsets = tokenizer.encode_offsets(text)
    starts = np.asarray([s for s, _ in offsets], dtype=np.int64).reshape(-1)
    weights = np.zeros(len(ids), dtype=np.float32)
    for lo, hi in spans:
        weights[(starts >= lo) & (starts < hi)] = 1.0
    return ids, weights

