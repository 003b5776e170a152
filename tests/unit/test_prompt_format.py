"""What a prompt becomes and which ids end a sequence (``generation.*``, jaxpar/data/prompts.py),
without a model: a jaxpar-trained model's prompt after the end-of-text token, an imported one's
as its tokenizer encodes it; the eos ids ``import-hf`` reads; their checks. Generation of
imported models against transformers: tests/integration/test_generate_imported.py."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from hf_models import BOS, EOS, char_text, save_char_tokenizer

from jaxpar.config import Config, ConfigError, GenerationConfig, check_generation, load_config
from jaxpar.data.prompts import prompts_for
from jaxpar.hf.config import HFConfigError
from jaxpar.hf.importer import generation_settings
from jaxpar.inference.generation import eos_array

TEXT = char_text([5, 6, 7])


@pytest.fixture
def tokenizers(tmp_path):
    """tokenizer.json paths: one whose post-processor adds a BOS, one that adds nothing."""
    pytest.importorskip("tokenizers")
    out = {}
    for adds_bos in (True, False):
        directory = tmp_path / ("bos" if adds_bos else "none")
        directory.mkdir()
        out[adds_bos] = str(save_char_tokenizer(directory, adds_bos) / "tokenizer.json")
    return out


def imported(tokenizer: str, eos_ids: tuple[int, ...] = ()) -> Config:
    return Config(generation=GenerationConfig(prompt="tokenizer", eos_ids=eos_ids),
                  data=dataclasses.replace(Config().data, tokenizer=tokenizer))


def test_a_jaxpar_trained_model_s_prompt_follows_the_end_of_text_token(tokenizers):
    prompts = prompts_for(Config())  # the byte tokenizer: NUL ends a document
    assert prompts.encode("ab") == [0, 97, 98] and prompts.eos_ids == (0,)
    # A tokenizer.json that adds a BOS: packing never asked for it, nor does the prompt.
    cfg = dataclasses.replace(Config(), data=imported(tokenizers[True]).data)
    prompts = prompts_for(cfg)
    assert prompts.encode(TEXT) == [EOS, 5, 6, 7] and prompts.eos_ids == (EOS,)


def test_an_imported_model_s_prompt_is_what_its_tokenizer_makes(tokenizers):
    prompts = prompts_for(imported(tokenizers[True], (EOS, 9)))
    assert prompts.encode(TEXT) == [BOS, 5, 6, 7]
    assert prompts.eos_ids == (EOS, 9) and prompts.prefix_id() == BOS
    prompts = prompts_for(imported(tokenizers[False]))
    assert prompts.encode(TEXT) == [5, 6, 7]
    # No eos ids from the model: the tokenizer_config.json's end-of-text token.
    assert prompts.eos_ids == (EOS,) and prompts.tokenizer.eos_id == EOS


def test_an_older_save_names_its_special_tokens_in_special_tokens_map(tokenizers):
    directory = Path(tokenizers[True]).parent
    (directory / "tokenizer_config.json").write_text("{}")
    prompts = prompts_for(imported(tokenizers[True]))
    assert prompts.prefix_id() == EOS and prompts.eos_ids == (EOS,)  # by the usual name
    (directory / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": {"content": "<s>"}, "eos_token": char_text([9])}))
    prompts = prompts_for(imported(tokenizers[True]))
    assert prompts.prefix_id() == BOS and prompts.eos_ids == (9,)


def test_import_takes_the_eos_ids_of_generation_config_then_of_config_json(tmp_path):
    hf = {"eos_token_id": 7}
    assert generation_settings(tmp_path, hf, 256) == GenerationConfig("tokenizer", (7,))
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [3, 300, 4, 3]}))  # 300: past the vocabulary, never made
    assert generation_settings(tmp_path, hf, 256).eos_ids == (3, 4)
    (tmp_path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1}))
    assert generation_settings(tmp_path, {}, 256).eos_ids == ()
    with pytest.raises(HFConfigError, match="eos_token_id"):
        generation_settings(tmp_path, {"eos_token_id": "</s>"}, 256)


def test_generation_settings_are_checked_in_one_line():
    cfg = load_config("tiny", ["generation.eos_ids=[1, 300]", "generation.prompt=tokenizer"])
    with pytest.raises(ConfigError, match=r"^generation.eos_ids=\[1, 300\]: 300 .*\[0, 256\)"):
        check_generation(cfg)
    assert load_config("tiny", ["generation.eos_ids=5"]).generation.eos_ids == (5,)
    for bad, needle in ((["generation.prompt=bos"], "eos_prefix, tokenizer"),
                        (["generation.eos_ids=[x]"], "list of integers")):
        with pytest.raises(ConfigError, match=needle):
            load_config("tiny", bad)


def test_generation_ends_at_one_id_or_any_of_several():
    assert eos_array(None).size == 0
    assert eos_array(3).tolist() == [3] and eos_array(np.int32(3)).tolist() == [3]
    assert eos_array((1, 9)).tolist() == [1, 9]
