"""Prompts as token ids, and the ids that end a generated sequence: ``generation.*`` applied to
the run's tokenizer, for ``jaxpar generate`` and lm-eval's model ``jaxpar``.

``eos_prefix`` (default; a model jaxpar trained): the end-of-text token, then the text without
special tokens, as packing encoded it. ``tokenizer`` (``jaxpar import-hf``): the text exactly as
its tokenizer encodes it, BOS included where the model expects one. A sequence ends at any of
``generation.eos_ids``, else at the end-of-text token. The table: docs/generation.md, "Prompts
and stopping".
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxpar.config import Config
from jaxpar.data.tokenizer import Tokenizer, make_tokenizer, named_special_tokens


@dataclass(frozen=True)
class Prompts:
    """How one model's prompts are encoded and where its sequences end."""

    tokenizer: Tokenizer  # its eos_id: the tokenizer's own end-of-text token
    eos_prefix: bool  # generation.prompt=eos_prefix
    eos_ids: tuple[int, ...]  # what ends a generated sequence; never empty
    bos_id: int | None = None  # the tokenizer's BOS, where its tokenizer_config.json names one

    @property
    def special_tokens(self) -> bool:
        """Whether the tokenizer's own special tokens (its post-processor) belong in a prompt."""
        return not self.eos_prefix

    def encode(self, text: str) -> list[int]:
        """``text`` as token ids, as the model's training presented text."""
        if self.eos_prefix:
            return [self.tokenizer.eos_id, *self.tokenizer.encode(text).tolist()]
        return self.tokenizer.encode(text, special_tokens=True).tolist()

    def prefix_id(self) -> int:
        """The token standing for an empty context: BOS, else end-of-text (as lm-eval's ``hf``)."""
        return self.tokenizer.eos_id if self.bos_id is None else self.bos_id


def prompts_for(cfg: Config, tokenizer: str | None = None) -> Prompts:
    """``cfg``'s prompts on its tokenizer (``tokenizer``: a tokenizer.json or 'byte' instead of
    ``data.tokenizer``). ValueError or ImportError if unusable."""
    g = cfg.generation
    spec = tokenizer or cfg.data.tokenizer
    if g.prompt == "eos_prefix":  # the first token is packing's separator, found by its name
        tok = make_tokenizer(spec)
        return Prompts(tok, True, g.eos_ids or (tok.eos_id,))
    # An imported model's end-of-text and BOS tokens are those its tokenizer_config.json names
    # (as transformers reads them); the end-of-text token falls back to its first eos id.
    named = named_special_tokens(spec)
    tok = make_tokenizer(spec, named.get("eos_token", g.eos_ids[0] if g.eos_ids else None))
    bos = tok.token_id(named["bos_token"]) if "bos_token" in named else None
    return Prompts(tok, False, g.eos_ids or (tok.eos_id,), bos)
