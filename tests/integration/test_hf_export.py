"""``jaxpar export --format hf``, fine-tuning from an import (``train.init_from``) and the
command line of ``import-hf``: transformers loads what jaxpar writes, without warnings, and
computes the same logits. The refusals and shard sizes, without transformers:
``tests/unit/test_hf_config.py``."""

from __future__ import annotations

import json
import logging
import warnings

import numpy as np
import pytest
from helpers import assert_one_line_error, cached_jax_env, run_jaxpar
from hf_models import hf_logits, jaxpar_logits, save_hf_model, tokens, trainer_from_import

from jaxpar.checkpoint.weights_only import read_weights, step_dir
from jaxpar.hf.exporter import export_hf
from jaxpar.hf.importer import import_hf

pytest.importorskip("transformers")

TOLERANCE = 1e-4


def _load_quietly(directory):
    """transformers' model of ``directory``, failing on any warning it logs or raises (unused,
    missing or mismatched weights, an unknown config key...)."""
    import torch
    from transformers import AutoModelForCausalLM

    records: list[logging.LogRecord] = []
    handler = logging.Handler(level=logging.WARNING)
    handler.emit = records.append
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            model, info = AutoModelForCausalLM.from_pretrained(
                directory, dtype=torch.float32, output_loading_info=True)
    finally:
        logger.removeHandler(handler)
    assert not any(info.values()), info
    assert not records, [r.getMessage() for r in records]
    return model.eval()


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return cached_jax_env(tmp_path_factory.mktemp("jax-cache"))


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "mixtral", "qwen3_moe",
                                  "mistral_window"])
def test_export_of_an_import_loads_in_transformers_and_reimports_bit_exactly(tmp_path, kind):
    source = save_hf_model(kind, tmp_path / "src")
    done = import_hf(source, tmp_path / "jaxpar")
    files, step = export_hf(tmp_path / "jaxpar", tmp_path / "hf", max_shard_size="100KB")
    assert step == 0 and len(files) >= 2
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == sorted(f.name for f in files)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["rope_parameters"]["rope_theta"] == config["rope_theta"]  # both dialects
    _load_quietly(tmp_path / "hf")
    ids = tokens(rows=2)
    np.testing.assert_allclose(hf_logits(tmp_path / "hf", ids), hf_logits(source, ids),
                               atol=TOLERANCE, rtol=0)
    again = import_hf(tmp_path / "hf", tmp_path / "again")
    assert again.model == done.model
    if kind == "mistral_window":
        assert config["model_type"] == "mistral" and config["sliding_window"] == 64
    first = read_weights(done.checkpoint)[0]
    second = read_weights(again.checkpoint)[0]
    import jax

    jax.tree.map(np.testing.assert_array_equal, second, first)


def test_llama3_rope_scaling_survives_the_round_trip(tmp_path):
    source = save_hf_model("llama", tmp_path / "src")
    import_hf(source, tmp_path / "jaxpar")
    export_hf(tmp_path / "jaxpar", tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["rope_scaling"]["rope_type"] == "llama3"
    assert config["rope_parameters"]["original_max_position_embeddings"] == 64
    model = _load_quietly(tmp_path / "hf")
    assert model.config.rope_parameters["rope_type"] == "llama3"


def test_fine_tune_under_fsdp_and_tensor_then_export(tmp_path, cache):
    """20 steps from an import under fsdp=2 tensor=2 (with the imported tokenizer), exported:
    transformers computes the logits jaxpar computes from the trained checkpoint. A rerun of
    the same command resumes the run's own checkpoint rather than the import."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    source = save_hf_model("qwen2", tmp_path / "src")
    vocab = {chr(c): i for i, c in enumerate(range(32, 127))} | {"[UNK]": 95, "</s>": 96}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer.save(str(source / "tokenizer.json"))
    out = tmp_path / "ckpt"
    result = run_jaxpar("import-hf", str(source), "--to", str(out), env=cache)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"data.tokenizer={out.absolute() / 'tokenizer.json'}" in result.stdout
    run_dir = tmp_path / "run"
    args = ["train", str(out / "config.yaml"), f"run_dir={run_dir}", "host_devices=4",
            "mesh.fsdp=2", "mesh.tensor=2", "train.batch_size=4", "train.seq_len=32",
            "logging.progress=false", "data.max_bytes=100000", "train.warmup_steps=2"]
    result = run_jaxpar(*args, "train.steps=20", env=cache)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "fresh optimizer, step 0" in result.stdout
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 20 and rows[-1]["loss"] < rows[0]["loss"]

    result = run_jaxpar("export", str(run_dir), "--to", str(tmp_path / "hf"), "--format", "hf",
                        env=cache)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "hf" / "tokenizer.json").is_file()
    _load_quietly(tmp_path / "hf")
    trained = step_dir(run_dir)
    trainer, state = trainer_from_import(out / "config.yaml", [f"train.init_from={trained}"], 1)
    ids = tokens(rows=2)
    expected = hf_logits(tmp_path / "hf", ids)
    assert np.abs(expected - hf_logits(source, ids)).max() > 1e-3  # training changed it
    assert np.abs(jaxpar_logits(trainer, state, ids) - expected).max() <= TOLERANCE

    result = run_jaxpar(*args, "train.steps=22", env=cache)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "not used: resuming from step 20" in result.stdout


def test_import_hf_cli_errors(tmp_path, cache):
    source = save_hf_model("llama", tmp_path / "src")
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "model_type": "gpt_neox"}))
    assert_one_line_error(run_jaxpar("import-hf", str(source), "--to", str(tmp_path / "a"),
                                     env=cache), "model_type", "gpt_neox", code=2)
    assert not (tmp_path / "a").exists()
    (source / "config.json").write_text(json.dumps(config))
    import_hf(source, tmp_path / "c")
    # A weights-only checkpoint has no optimizer state or data position to resume.
    assert_one_line_error(run_jaxpar("train", str(tmp_path / "c" / "config.yaml"),
                                     f"run_dir={tmp_path / 'r'}", "train.init_from=null",
                                     f"train.resume={tmp_path / 'c'}", "host_devices=1",
                                     env=cache), "holds only weights", "train.init_from")
