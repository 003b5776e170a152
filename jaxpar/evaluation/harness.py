"""A jaxpar checkpoint as a model of EleutherAI's lm-evaluation-harness (``lm-eval``, tested
with 0.4.13: ``pip install 'jaxpar[eval]'``).

lm-eval finds models in its own registry only, with no entry point an outside package could
fill. So importing this module (or its old name :mod:`jaxpar.lm_eval`, as documented) registers
the name ``jaxpar``, and ``python -m jaxpar.lm_eval`` is lm-eval's own command line after that
import::

    python -m jaxpar.lm_eval run --model jaxpar --model_args checkpoint=runs/tiny \\
        --tasks hellaswag --batch_size 16

``--model_args``: ``checkpoint``, ``overrides`` (``key=value`` overrides of its config, the mesh
among them), ``max_length`` and ``max_gen_toks``. It computes what lm-eval's ``hf`` model
computes for a causal LM (tokenization, context splitting, ``loglikelihood``,
``loglikelihood_rolling``, greedy ``generate_until``), through
:class:`jaxpar.inference.generation.Generator`, so the numbers are those of the same model
exported to Hugging Face. Requests are sorted by length and scored ``batch_size`` at a time.

Every argument and rule: docs/evaluation.md, "lm-eval: the model `jaxpar`".
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

# The harness's own models are registered first: its get_model imports them only while its
# registry is empty, so a registry holding ``jaxpar`` alone would hide ``hf`` and the rest.
import lm_eval.models  # noqa: F401
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from jaxpar.config import ConfigError

DEFAULT_BATCH = 8  # requests scored together when lm-eval's --batch_size is "auto"


def load_generator(checkpoint: str, overrides: str = "") -> tuple[Any, Any]:
    """(:class:`~jaxpar.inference.generation.Generator` on the config's mesh, the run's
    :class:`~jaxpar.data.prompts.Prompts`) of a checkpoint, its config changed by the
    space-separated ``key=value`` ``overrides``."""
    from jaxpar.checkpoint.weights_only import saved_config, step_dir  # noqa: PLC0415
    from jaxpar.config import check_generation, saved_run_config  # noqa: PLC0415
    from jaxpar.data.prompts import prompts_for  # noqa: PLC0415
    from jaxpar.mesh import use_host_devices  # noqa: PLC0415

    path = step_dir(Path(checkpoint))
    cfg = saved_run_config(saved_config(path), overrides=str(overrides or "").split())
    check_generation(cfg)
    prompts = prompts_for(cfg)
    use_host_devices(cfg.host_devices)  # before jax starts its backend, if it has not yet
    from jaxpar.checkpoint.weights_only import read_weights  # noqa: PLC0415
    from jaxpar.evaluation.split_loss import check_devices  # noqa: PLC0415
    from jaxpar.inference.generation import Generator  # noqa: PLC0415
    from jaxpar.mesh import make_mesh  # noqa: PLC0415

    params, buffers, _ = read_weights(path)
    return Generator(cfg, params, buffers, make_mesh(cfg, check_devices(cfg))), prompts


@register_model("jaxpar")
class JaxparLM(TemplateLM):
    """lm-eval's model ``jaxpar`` (module docstring)."""

    def __init__(self, checkpoint: str, overrides: str = "", max_length: int | None = None,
                 max_gen_toks: int = 256, batch_size: int | str | None = None,
                 **ignored: Any):
        # lm-eval also passes device and max_batch_size: the mesh decides where jaxpar runs.
        super().__init__()
        self.generator, self.prompts = load_generator(checkpoint, overrides)
        self.tokenizer_ = self.prompts.tokenizer
        self.max_length = int(max_length or self.generator.cfg.train.seq_len)
        self.max_gen_toks = int(max_gen_toks)
        self.batch_size = (int(batch_size) if str(batch_size or "auto").isdigit()
                           else DEFAULT_BATCH)

    @property
    def eot_token_id(self) -> int:
        # The tokenizer's own (an import's tokenizer_config.json eos_token), as the hf model's;
        # generation ends at any of the model's eos ids all the same.
        return self.tokenizer_.eos_id

    @property
    def prefix_token_id(self) -> int:
        return self.prompts.prefix_id()

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any
                   ) -> list[int]:
        special = self.prompts.special_tokens if add_special_tokens is None else add_special_tokens
        return self.tokenizer_.encode(string, special_tokens=special).tolist()

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tokenizer_.decode(tokens)

    def _loglikelihood_tokens(self, requests: list, disable_tqdm: bool = False, **kwargs: Any
                              ) -> list[tuple[float, bool]]:
        """(sum of the continuation's log-probabilities, all its tokens greedy) per request."""
        pairs = [(list(context), list(continuation)) for _, context, continuation in requests]
        out: list[tuple[float, bool]] = [(0.0, False)] * len(pairs)
        # Longest first, as lm-eval's hf model does: each batch is padded to its first row.
        order = sorted(range(len(pairs)), key=lambda i: -len(pairs[i][0] + pairs[i][1]))
        for start in range(0, len(order), self.batch_size):
            chunk = order[start:start + self.batch_size]
            windows = [(pairs[i][0] + pairs[i][1])[-(self.max_length + 1):] for i in chunk]
            for i, (logprobs, greedy) in zip(chunk, self.generator.score(windows), strict=True):
                n = len(pairs[i][1])
                out[i] = (float(logprobs[-n:].astype("float64").sum()), bool(greedy[-n:].all()))
        return out

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        """The log-likelihood of each whole text, over lm-eval's disjoint rolling windows."""
        windows, owners = [], []
        for number, (text,) in enumerate(req.args for req in requests):
            for context, continuation in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, context, continuation))
                owners.append(number)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows), strict=True):
            totals[owner] += logprob
        return totals

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations, cut before the first stop string (``until``, plus the
        end-of-text token's text), at most ``max_gen_toks`` tokens each."""
        eos = self.tok_decode([self.eot_token_id])
        out: list[str] = [""] * len(requests)
        groups: dict[tuple, list[int]] = {}
        jobs = []
        for i, req in enumerate(requests):
            context, gen_kwargs = req.args
            kwargs = normalize_gen_kwargs(dict(gen_kwargs), self.max_gen_toks)
            if kwargs.get("do_sample") or kwargs.get("temperature", 0.0):
                raise ConfigError("jaxpar's lm-eval model decodes greedily only "
                                  f"(got do_sample/temperature in {dict(gen_kwargs)})")
            until = handle_stop_sequences(kwargs.get("until"), eos=eos)
            budget = kwargs["max_gen_toks"]
            if budget >= self.max_length:
                raise ConfigError(f"max_gen_toks={budget} leaves no context in max_length="
                                  f"{self.max_length} tokens (--model_args max_length=...)")
            prompt = self.tok_encode(context)[-(self.max_length - budget):]
            jobs.append((prompt or [self.prefix_token_id], until))
            groups.setdefault((budget,), []).append(i)
        for (budget,), members in groups.items():
            for start in range(0, len(members), self.batch_size):
                chunk = members[start:start + self.batch_size]
                made = self.generator.generate([jobs[i][0] for i in chunk], max_tokens=budget,
                                               eos_id=self.prompts.eos_ids)
                for i, tokens in zip(chunk, made, strict=True):
                    text = self.tok_decode(tokens)
                    for stop in jobs[i][1]:
                        text = text.split(stop)[0] if stop else text
                    out[i] = text
        return out


def main(argv: list[str] | None = None) -> None:
    """lm-eval's command line with the ``jaxpar`` model registered (module docstring)."""
    from lm_eval.__main__ import cli_evaluate  # noqa: PLC0415

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    cli_evaluate()


if __name__ == "__main__":
    main()
