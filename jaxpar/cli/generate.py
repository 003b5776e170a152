"""``jaxpar generate``: its command line (the library is :mod:`jaxpar.inference.generation`).

The checkpoint's config is read without jax, so ``host_devices`` can still choose the number of
virtual CPU devices; the mesh is one device unless ``--mesh`` or ``mesh.*`` say otherwise.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from jaxpar.config import Config, ConfigError

GENERATE_HELP = ("generate text from a checkpoint: the prompt, then new tokens (KV-cached "
                 "decoding), streamed as they come")


def add_generate(commands, positive_int: Callable[[str], int]) -> None:
    """The ``generate`` subcommand's arguments (``positive_int``: the CLI's N >= 1 type)."""
    sub = checkpoint_command(
        commands, "generate", GENERATE_HELP,
        "the model, tokenizer (data.tokenizer) and compute dtype (train.dtype) are the run's; "
        "a prompt follows the end-of-text token for a model jaxpar trained, and is what its "
        "tokenizer makes (BOS included) for an imported one (generation.prompt). "
        "key=value overrides apply to that config (host_devices=4, train.dtype=bfloat16, ...). "
        "The mesh is one device unless --mesh or mesh.* say otherwise: data and fsdp split the "
        "prompts, tensor the heads.",
        ["jaxpar generate runs/tiny --prompt 'def main(' --max-tokens 200",
         "jaxpar generate runs/tiny --prompts-file prompts.txt --temperature 0.8 --top-p 0.9 "
         "--mesh data=2,tensor=2 host_devices=4",
         "jaxpar generate runs/sft --chat --prompt 'What is 2 + 3?'"])
    prompts = sub.add_mutually_exclusive_group(required=True)
    prompts.add_argument("--prompt", metavar="TEXT", help="one prompt; its tokens stream")
    prompts.add_argument("--prompts-file", metavar="FILE", help="one prompt per line, "
                         "generated as one batch; each completion is printed when all are done")
    sub.add_argument("--max-tokens", type=positive_int, default=64, metavar="N",
                     help="new tokens per prompt at most (default 64)")
    sub.add_argument("--temperature", type=float, default=0.0, metavar="T",
                     help="0 (default): greedy; else sample from softmax(logits / T)")
    sub.add_argument("--top-k", type=int, default=0, metavar="K",
                     help="sample among the K likeliest tokens only (0: all)")
    sub.add_argument("--top-p", type=float, default=1.0, metavar="P",
                     help="sample among the likeliest tokens whose probability reaches P "
                     "(nucleus; 1: all)")
    sub.add_argument("--seed", type=int, default=0, help="random seed of the sampling")
    sub.add_argument("--tokenizer", metavar="PATH", help="a tokenizer.json, or 'byte', instead "
                     "of the run's data.tokenizer")
    sub.add_argument("--chat", action="store_true", help="each prompt is a user message, "
                     "rendered with the tokenizer's chat template (tokenizer_config.json's "
                     "chat_template) up to the assistant's turn")


def checkpoint_command(commands, name: str, help_text: str, details: str,
                       examples: list[str]) -> argparse.ArgumentParser:
    """A subcommand that runs a saved model (generate, eval): its help, and the arguments of
    :func:`checkpoint_arguments`."""
    sub = commands.add_parser(
        name, help=help_text, description=help_text + ".", intermixed=True,
        epilog="CKPT is a step directory (runs/tiny/checkpoints/200), or a run or checkpoints "
        f"directory (its newest complete checkpoint); {details}\nExamples:\n"
        + "".join(f"  {e}\n" for e in examples)
        + "Exit codes: 0 done, 2 bad usage/config/input, 1 failure while running.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    checkpoint_arguments(sub)
    return sub


def checkpoint_arguments(sub: argparse.ArgumentParser) -> None:
    """CKPT, its config's ``key=value`` overrides and ``--mesh``: what every command that runs
    a saved model takes (generate, eval; :func:`generation_config` reads them)."""
    sub.add_argument("checkpoint", metavar="CKPT", help="checkpoint step, run or checkpoints "
                     "directory")
    sub.add_argument("overrides", nargs="*", default=[], metavar="key=value",
                     help="dotted overrides of the run's config")
    sub.add_argument("--mesh", metavar="AXES", default="", help="mesh axes, e.g. "
                     "data=2,tensor=2 (same as mesh.data=2 mesh.tensor=2)")


def generation_config(args: argparse.Namespace, saved: dict) -> Config:
    """The saved run's config for running it: :func:`jaxpar.config.saved_run_config` of
    ``--mesh`` and the ``key=value`` overrides."""
    from jaxpar.config import saved_run_config  # noqa: PLC0415

    return saved_run_config(saved, args.mesh, args.overrides)


def run_generate(args: argparse.Namespace) -> int:
    """``jaxpar generate``: load the weights onto the mesh, generate, print."""
    import math  # noqa: PLC0415
    import time  # noqa: PLC0415

    from jaxpar.checkpoint.weights_only import read_weights, saved_config, step_dir  # noqa: PLC0415
    from jaxpar.inference.generation import Sampling  # noqa: PLC0415
    from jaxpar.mesh import use_host_devices  # noqa: PLC0415

    sampling = Sampling(args.temperature, args.top_k, args.top_p)
    path = step_dir(Path(args.checkpoint))
    cfg = generation_config(args, saved_config(path))
    texts = _prompt_texts(args)
    if args.chat:
        texts = _chat_prompts(texts, args.tokenizer or cfg.data.tokenizer)
    use_host_devices(cfg.host_devices)  # before anything starts jax's backend
    import jax  # noqa: PLC0415

    from jaxpar.inference.generation import Generator  # noqa: PLC0415
    from jaxpar.mesh import make_mesh  # noqa: PLC0415

    wanted, have = math.prod(cfg.mesh.sizes().values()), jax.device_count()
    if wanted > have:
        raise ConfigError(f"--mesh: {wanted} devices asked for, {have} available (on CPU, "
                          f"host_devices={wanted} makes them)")
    prompt_format = _prompts(cfg, args.tokenizer)
    tokenizer = prompt_format.tokenizer
    params, buffers, step = read_weights(path)
    start = time.perf_counter()
    generator = Generator(cfg, params, buffers, make_mesh(cfg, jax.devices()[:wanted]))
    # A model jaxpar trained gets the end-of-text token in front, an imported one what its
    # tokenizer adds (generation.prompt: jaxpar/data/prompts.py).
    prompts = [tokenizer.encode(t).tolist() if args.chat else prompt_format.encode(t)
               for t in texts]  # a chat template writes the special tokens itself
    options = dict(max_tokens=args.max_tokens, sampling=sampling, seed=args.seed,
                   eos_id=prompt_format.eos_ids)
    if args.prompt is not None:
        made = [_stream_one(generator, tokenizer, texts[0], prompts[0], options)]
    else:
        made = generator.generate(prompts, **options)
        for i, (text, new) in enumerate(zip(texts, made, strict=True)):
            print(f"--- {i + 1}/{len(texts)} ---\n{text}{tokenizer.decode(new)}", flush=True)
    count, seconds = sum(map(len, made)), time.perf_counter() - start
    print(f"generate: step {step} of {path}: {count} tokens for {len(texts)} prompt(s) in "
          f"{seconds:.2f} s (compiles included)", file=sys.stderr)
    return 0


def _prompt_texts(args: argparse.Namespace) -> list[str]:
    if args.prompt is not None:
        return [args.prompt]
    try:
        lines = Path(args.prompts_file).expanduser().read_text().splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"--prompts-file {args.prompts_file}: cannot read it ({err})") from None
    texts = [line for line in lines if line.strip()]
    if not texts:
        raise ConfigError(f"--prompts-file {args.prompts_file}: no prompt in it")
    return texts


def _chat_prompts(texts: list[str], tokenizer: str) -> list[str]:
    """Each text as a user message rendered by the chat template, up to the assistant's turn
    (``add_generation_prompt``), as transformers' ``apply_chat_template`` renders it."""
    from jaxpar.data.chat import ChatTemplate  # noqa: PLC0415

    try:
        template = ChatTemplate(tokenizer)
        return [template.render([{"role": "user", "content": t}], add_generation_prompt=True)
                for t in texts]
    except (ValueError, ImportError) as err:
        raise ConfigError("--chat: " + str(err).splitlines()[0].replace(
            "data.loss_on=assistant needs", "needs")) from None


def _prompts(cfg: Config, tokenizer: str | None):
    from jaxpar.config import check_generation  # noqa: PLC0415
    from jaxpar.data.prompts import prompts_for  # noqa: PLC0415

    check_generation(cfg)
    try:
        return prompts_for(cfg, tokenizer)
    except (ValueError, ImportError) as err:
        raise ConfigError(str(err)) from None


def _stream_one(generator, tokenizer, text: str, prompt: list[int], options: dict) -> list[int]:
    """Print ``text``, then its new tokens as they arrive; returns them. A byte tokenizer may
    cut a character between tokens: a trailing undecodable piece waits for the next token."""
    print(text, end="", flush=True)
    new: list[int] = []
    shown = 0
    for step in generator.stream([prompt], **options):
        token = int(step.tokens[0])
        if token in options["eos_id"]:
            break
        new.append(token)
        decoded = tokenizer.decode(new).rstrip("\ufffd")
        print(decoded[shown:], end="", flush=True)
        shown = max(shown, len(decoded))
    print(tokenizer.decode(new)[shown:], flush=True)
    return new
