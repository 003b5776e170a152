"""``jaxpar generate`` of an imported model continues a prompt as transformers does: every model
type ``import-hf`` reads, through the command line in this process (``import-hf``, then
``generate --temperature 0`` on a prompts file), against transformers' greedy ``generate`` on
the ids its own tokenizer makes, with a tokenizer that puts a BOS before every text and with
one that adds nothing; any id of ``generation_config.json``'s ``eos_token_id`` list ends a
sequence; lm-eval's model ``jaxpar`` encodes an import's text as lm-eval's ``hf`` model does.
The prompt rules without a model: tests/unit/test_prompt_format.py."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import yaml
from hf_models import BOS, EOS, VOCAB, build_hf_model, char_text, save_char_tokenizer

from jaxpar.cli.main import main

pytest.importorskip("transformers")

FAMILIES = ["llama", "mistral", "mistral_window", "qwen2", "qwen3", "mixtral", "qwen3_moe",
            "deepseek_v3", "gemma2", "gemma3_text", "gemma3"]
# Local layers see 8 tokens, so that the longer prompts reach past the window.
WINDOWED = {"mistral_window", "gemma2", "gemma3_text", "gemma3"}
# Prompt lengths in tokens: within one length bucket of generation (16), at its edge, past it,
# past two (the BOS, where one is added, makes each one longer).
LENGTHS = (3, 15, 16, 21, 37)
TEXTS = [char_text(np.random.default_rng(n).integers(3, VOCAB, n)) for n in LENGTHS]
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """(model type, whether its tokenizer adds a BOS) -> a model directory as transformers
    saves it: a tiny random model whose config's bos and eos ids are the tokenizer's."""
    root = tmp_path_factory.mktemp("families")
    out = {}
    for kind in FAMILIES:
        model_dir = root / kind
        window = {"sliding_window": 8} if kind in WINDOWED else {}
        build_hf_model(kind, bos_token_id=BOS, eos_token_id=EOS, **window
                       ).save_pretrained(model_dir)
        for adds_bos in (True, False):
            source = shutil.copytree(model_dir, root / f"{kind}-{'bos' if adds_bos else 'none'}")
            out[kind, adds_bos] = save_char_tokenizer(source, adds_bos)
    return out


def transformers_greedy(source, texts: list[str], **generate_kwargs) -> list[list[int]]:
    """transformers' greedy new tokens for each text, encoded by its own tokenizer, up to and
    without the first end-of-text token its generation config names."""
    import torch
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    # tokenizer.json as it is: transformers 5's AutoTokenizer gives model type qwen2 its own
    # byte-level pipeline around the file's vocabulary.
    tokenizer = PreTrainedTokenizerFast.from_pretrained(source)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    stops = model.generation_config.eos_token_id
    stops = set() if stops is None else {stops} if isinstance(stops, int) else set(stops)
    out = []
    for text in texts:
        ids = tokenizer(text)["input_ids"]
        with torch.no_grad():
            made = model.generate(torch.tensor([ids]), do_sample=False,
                                  max_new_tokens=NEW_TOKENS, pad_token_id=EOS,
                                  **generate_kwargs)[0, len(ids):].tolist()
        ends = [i for i, token in enumerate(made) if token in stops]
        out.append(made[:ends[0]] if ends else made)
    return out


def jaxpar_generated(stdout: str, texts: list[str], source) -> list[list[int]]:
    """The new token ids of each completion ``jaxpar generate`` printed (``--prompt`` or
    ``--prompts-file``): the text after the prompt, encoded again (each id has its own
    text)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(source / "tokenizer.json"))
    lines = stdout.splitlines()
    if len(texts) > 1:
        assert lines[0::2] == [f"--- {i + 1}/{len(texts)} ---" for i in range(len(texts))]
        lines = lines[1::2]
    out = []
    for text, line in zip(texts, lines, strict=True):
        assert line.startswith(text)
        out.append(tokenizer.encode(line[len(text):], add_special_tokens=False).ids)
    return out


def import_and_generate(source, tmp_path, capsys, *args: str) -> tuple[str, str]:
    """``jaxpar import-hf SOURCE``, then ``jaxpar generate`` of the import with ``args``: the
    two commands' stdout."""
    checkpoint = tmp_path / "ckpt"
    assert main(["import-hf", str(source), "--to", str(checkpoint)]) == 0
    imported = capsys.readouterr().out
    assert main(["generate", str(checkpoint), "--temperature", "0", *args]) == 0
    return imported, capsys.readouterr().out


@pytest.mark.parametrize("adds_bos", [True, False], ids=["bos-added", "nothing-added"])
@pytest.mark.parametrize("kind", FAMILIES)
def test_greedy_generation_of_an_import_is_transformers_token_for_token(
        sources, kind, adds_bos, tmp_path, capsys):
    source = sources[kind, adds_bos]
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("".join(f"{text}\n" for text in TEXTS))
    _, stdout = import_and_generate(source, tmp_path, capsys, "--prompts-file", str(prompts),
                                    "--max-tokens", str(NEW_TOKENS))
    expected = transformers_greedy(source, TEXTS)
    assert jaxpar_generated(stdout, TEXTS, source) == expected
    assert sum(map(len, expected)) >= len(TEXTS)  # something was generated to compare


def test_any_eos_id_of_generation_config_ends_a_sequence(sources, tmp_path, capsys):
    """generation_config.json's ``eos_token_id`` list (not config.json's eos, not the
    tokenizer's): a token greedy decoding makes third or later, and not before, becomes the
    second of two end ids; the streamed completion stops before it, as transformers' does, and
    ``export --format hf`` writes the list back. An id past the vocabulary is one line."""
    source = shutil.copytree(sources["llama", False], tmp_path / "source")
    text = TEXTS[3]
    (free,) = transformers_greedy(source, [text], eos_token_id=None)
    stop = next(i for i in range(2, len(free)) if free[i] not in free[:i])
    other = next(i for i in range(3, VOCAB) if i not in free)
    (source / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": BOS, "eos_token_id": [other, free[stop]]}))
    imported, stdout = import_and_generate(source, tmp_path, capsys, "--prompt", text,
                                           "--max-tokens", str(NEW_TOKENS))
    assert f"a sequence ends at any of the ids {other}, {free[stop]})" in imported
    saved = yaml.safe_load((tmp_path / "ckpt" / "config.yaml").read_text())
    assert saved["generation"] == {"prompt": "tokenizer", "eos_ids": [other, free[stop]]}
    assert stdout.count("\n") == 1 and jaxpar_generated(stdout, [text], source) == [free[:stop]]
    assert transformers_greedy(source, [text]) == [free[:stop]]
    # Exported, the ids go to transformers again.
    assert main(["export", str(tmp_path / "ckpt"), "--to", str(tmp_path / "hf"),
                 "--format", "hf"]) == 0
    exported = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert exported == {"eos_token_id": [other, free[stop]]}
    capsys.readouterr()
    assert main(["generate", str(tmp_path / "ckpt"), "--prompt", text,
                 f"generation.eos_ids=[{VOCAB}]"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"jaxpar: error: generation.eos_ids=[{VOCAB}]: {VOCAB} is not")


@pytest.mark.parametrize("adds_bos", [True, False], ids=["bos-added", "nothing-added"])
def test_lm_eval_model_encodes_an_import_as_the_hf_model_does(sources, adds_bos, tmp_path):
    """lm-eval's ``jaxpar`` model on an import and its ``hf`` model on the source agree on the
    ids of a text, of a continuation (no special tokens), the empty context's token and the
    end-of-text token (the two models' scores: tests/integration/test_lm_eval.py)."""
    pytest.importorskip("lm_eval")
    from lm_eval.models.huggingface import HFLM

    from jaxpar.evaluation.harness import JaxparLM

    source = sources["llama", adds_bos]
    assert main(["import-hf", str(source), "--to", str(tmp_path / "ckpt")]) == 0
    ours = JaxparLM(checkpoint=str(tmp_path / "ckpt"))
    theirs = HFLM(pretrained=str(source), device="cpu", dtype="float32")
    for text in TEXTS[:2]:
        assert ours.tok_encode(text) == theirs.tok_encode(text)
        assert (ours.tok_encode(text, add_special_tokens=False)
                == theirs.tok_encode(text, add_special_tokens=False))
    assert (ours.tok_encode(TEXTS[0])[0] == BOS) == adds_bos
    assert (ours.prefix_token_id, ours.eot_token_id) == (
        theirs.prefix_token_id, theirs.eot_token_id) == (BOS, EOS)
