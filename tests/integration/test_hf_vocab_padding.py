"""A Hugging Face model whose vocabulary divides nothing (301 ids), imported, trained and
exported (docs/configuration.md, "Padded vocabularies"): the import pads the embedding and
head, every layout computes transformers' logits and loss, and the same gradients as one
device; the command line trains under ``tensor=2``, resumes on one device (another
padding) and logs MFU from the true vocabulary; every export (base, merged LoRA, adapters)
drops the padding and loads in transformers and peft with the logits jaxpar computes; greedy
generation is transformers'. The layouts on tiny, without transformers:
tests/equivalence/test_vocab_padding.py."""

from __future__ import annotations

import json
from types import SimpleNamespace

import jax
import numpy as np
import pytest
import yaml
from helpers import assert_one_line_error, cached_jax_env, metrics, run_jaxpar
from hf_models import (
    build_hf_model,
    greedy_both_ways,
    hf_logits,
    hf_mean_loss,
    jaxpar_logits,
    next_token_ids,
    tokens,
    trainer_from_import,
)

from jaxpar.checkpoint.state import read_meta
from jaxpar.checkpoint.weights_only import read_weights, saved_config, step_dir
from jaxpar.config import config_from_dict
from jaxpar.hf.importer import import_hf
from jaxpar.model.flop_formula import train_flops_per_token
from jaxpar.model.vocab import fit_vocab

pytest.importorskip("transformers")

V = 301  # 7 x 43: no mesh axis divides it
TOLERANCE = 1e-4  # max abs logit difference, float32
TRAIN = ("train.batch_size=4", "train.seq_len=32", "logging.progress=false", "logging.every=1",
         "mesh.data=-1",
         "data.max_bytes=100000", "train.warmup_steps=1", "train.lr=0.01")


@pytest.fixture(scope="module")
def odd(tmp_path_factory) -> SimpleNamespace:
    """The Hugging Face model with 301 ids, its import, and the command line's runs: a base
    export of the import; 4 steps from it under tensor=2 (model.vocab_multiple=1: 302 rows,
    checkpoints at 2 and 4) and its export; steps 3-4 again from step 2 on one device (301
    rows); 3 LoRA steps from the import under tensor=2 and their merged and adapter exports."""
    root = tmp_path_factory.mktemp("odd")
    env = cached_jax_env(root / "jax-cache")
    source = root / "hf"
    build_hf_model("llama", vocab_size=V).save_pretrained(source)
    done = import_hf(source, root / "import")
    config = str(done.config_yaml)
    runs = {
        "base": ("export", str(root / "import"), "--to", str(root / "base-hf"), "--format", "hf"),
        "a": ("train", config, *TRAIN, f"run_dir={root / 'a'}", "host_devices=2",
              "mesh.tensor=2", "model.vocab_multiple=1", "train.steps=4", "checkpoint.every=2"),
        "a-hf": ("export", str(root / "a"), "--to", str(root / "a-hf"), "--format", "hf"),
        "a-flat": ("export", str(root / "a"), "--to", str(root / "a-flat")),
        "b": ("train", config, *TRAIN, f"run_dir={root / 'b'}", "host_devices=1",
              "model.vocab_multiple=1", "train.steps=4",
              "train.init_from=null", f"train.resume={root / 'a' / 'checkpoints' / '2'}"),
        "lora": ("train", config, *TRAIN, f"run_dir={root / 'lora'}", "host_devices=2",
                 "mesh.tensor=2", "train.steps=3", "train.lora.rank=4", "train.lora.alpha=8",
                 "train.lora.targets=[q,v,o,down]"),
        "merged": ("export", str(root / "lora"), "--to", str(root / "merged"), "--format",
                   "hf"),
        "adapters": ("export", str(root / "lora"), "--to", str(root / "adapters"), "--format",
                     "hf", "--adapters-only"),
    }
    out = {}
    for name, args in runs.items():
        result = run_jaxpar(*args, env=env)
        assert result.returncode == 0, (name, result.stderr[-3000:])
        out[name] = result.stdout
    ids = tokens(rows=2)
    return SimpleNamespace(root=root, source=source, done=done, stdout=out, ids=ids,
                           hf=hf_logits(source, ids))


def true_and_padding(logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return logits[..., :V], logits[..., V:]


def test_the_import_pads_the_vocabulary_and_records_the_true_size(odd):
    params, _, _ = read_weights(odd.done.checkpoint)
    assert params["embedding"].shape == (384, 64) and params["lm_head"].shape == (64, 384)
    assert not params["embedding"][V:].any() and not params["lm_head"][:, V:].any()
    assert yaml.safe_load(odd.done.config_yaml.read_text())["model"]["vocab_size"] == V
    meta = read_meta(odd.done.checkpoint)
    assert (meta["vocab_size"], meta["vocab_rows"]) == (V, 384)


@pytest.mark.parametrize("overrides, devices, rows", [
    ([], 1, 384),
    (["model.vocab_multiple=1"], 1, 301),  # the import's padding cut as it is read
    (["mesh.tensor=2", "model.vocab_multiple=1"], 4, 302),
    (["mesh.fsdp=2", "mesh.tensor=2", "model.vocab_multiple=1"], 4, 302),
])
def test_every_layout_computes_transformers_logits(odd, overrides, devices, rows):
    trainer, state = trainer_from_import(odd.done.config_yaml, overrides, devices)
    assert state.params["embedding"].shape[0] == rows
    logits, padding = true_and_padding(jaxpar_logits(trainer, state, odd.ids))
    assert np.abs(logits - odd.hf).max() <= TOLERANCE
    assert padding.shape[-1] == rows - V and np.all(np.isneginf(padding))


def loss_and_grads(odd, overrides: list[str], devices: int) -> tuple[float, dict]:
    ids = next_token_ids()
    trainer, state = trainer_from_import(odd.done.config_yaml, [
        "train.batch_size=4", "model.vocab_multiple=1", *overrides], devices)
    batch = trainer.put_batch({"inputs": ids[:, :-1], "targets": ids[:, 1:],
                               "mask": np.ones((4, ids.shape[1] - 1), np.float32)})
    loss, grads = trainer.loss_and_grads(state, batch)
    grads = jax.tree.map(np.asarray, grads)
    padding = [grads["embedding"][V:], grads["lm_head"][:, V:]]
    assert not any(p.any() for p in padding)
    return float(loss), fit_vocab(grads, V)


def test_every_layout_trains_with_one_devices_loss_and_gradients(odd):
    """tensor=2, fsdp x tensor and a pipe=2 tensor=2 pipeline (302, 302 and 304 rows) against
    one device (301), and one device against transformers' cross-entropy."""
    loss, grads = loss_and_grads(odd, [], 1)
    assert abs(loss - hf_mean_loss(odd.source, next_token_ids())) <= 1e-5 * loss
    for overrides in (["mesh.tensor=2"], ["mesh.fsdp=2", "mesh.tensor=2"],
                      ["mesh.pipe=2", "mesh.tensor=2", "train.microbatches=2"]):
        got_loss, got = loss_and_grads(odd, overrides, 4)
        assert got_loss == pytest.approx(loss, rel=1e-6), overrides
        errors = jax.tree.map(lambda a, b: float(np.abs(a - b).max() / np.abs(b).max()),
                              got, grads)
        assert max(jax.tree.leaves(errors)) <= 1e-5, (overrides, errors)


def test_a_run_resumes_under_a_layout_that_pads_differently_and_mfu_counts_true_flops(odd):
    """Run a saved step 2 with 302 rows (tensor=2); run b resumed it on one device (301 rows,
    the padding cut): its steps 3 and 4 are a's."""
    a, b = metrics(odd.root / "a"), metrics(odd.root / "b")
    assert "resumed from step 2" in odd.stdout["b"]
    assert [r["step"] for r in b] == [3, 4]
    for mine, theirs in zip(b, a[2:], strict=True):
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=1e-5)
    assert read_meta(step_dir(odd.root / "b"))["vocab_rows"] == V
    # MFU (tflops per device) counts the 301 true ids' flops, not the 302 rows'.
    cfg = config_from_dict(yaml.safe_load(odd.done.config_yaml.read_text()))
    for row in a:
        flops = row["tflops_per_device"] * 1e12 * row["step_time_s"] * 2 / (4 * 32)
        assert flops == pytest.approx(train_flops_per_token(cfg.model, 32), rel=1e-6)


def test_exports_drop_the_padding_and_load_in_transformers(odd):
    """The base export is the source model again; the trained run's (302 rows in its
    checkpoint) computes in transformers what jaxpar computes from the checkpoint."""
    for name in ("base-hf", "a-hf", "merged"):
        config = json.loads((odd.root / name / "config.json").read_text())
        assert config["vocab_size"] == V, name
    assert np.abs(hf_logits(odd.root / "base-hf", odd.ids) - odd.hf).max() <= TOLERANCE
    path = step_dir(odd.root / "a")
    params, buffers, _ = read_weights(path)
    assert params["embedding"].shape[0] == 302
    assert saved_config(path)["model"]["vocab_size"] == V  # the true size, recorded
    trainer, _ = trainer_from_import(odd.done.config_yaml, ["model.vocab_multiple=1"], 1)
    assert trainer.cfg.vocab_rows() == V
    state = SimpleNamespace(params=fit_vocab(params, V), buffers=buffers)
    expected = hf_logits(odd.root / "a-hf", odd.ids)
    assert np.abs(expected - odd.hf).max() > 1e-3  # training changed the model
    assert np.abs(jaxpar_logits(trainer, state, odd.ids)[..., :V] - expected).max() <= TOLERANCE
    flat = json.loads((odd.root / "a-flat" / "config.json").read_text())["params"]
    assert flat["embedding"]["shape"] == [V, 64] and flat["lm_head"]["shape"] == [64, V]


def test_lora_exports_load_in_transformers_and_peft(odd):
    """The LoRA run under tensor=2 (384 rows): its merged export computes jaxpar's adapted
    logits, and peft's adapter directory on the base export computes the merged ones."""
    peft = pytest.importorskip("peft")
    import torch
    from transformers import AutoModelForCausalLM

    path = step_dir(odd.root / "lora")
    params, buffers, _ = read_weights(path)
    assert params["lm_head"].shape[1] == 384
    trainer, _ = trainer_from_import(odd.done.config_yaml, [
        "train.lora.rank=4", "train.lora.alpha=8", "train.lora.targets=[q,v,o,down]"], 1)
    adapted = jaxpar_logits(trainer, SimpleNamespace(params=params, buffers=buffers), odd.ids)
    merged = hf_logits(odd.root / "merged", odd.ids)
    assert merged.shape[-1] == V
    assert np.abs(adapted[..., :V] - merged).max() <= TOLERANCE
    base = AutoModelForCausalLM.from_pretrained(odd.root / "base-hf", dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, odd.root / "adapters").eval()
    with torch.no_grad():
        logits = model(torch.tensor(odd.ids, dtype=torch.long)).logits.numpy()
    assert np.abs(logits - merged).max() <= TOLERANCE
    assert np.abs(merged - odd.hf).max() > 1e-3  # the adapters moved it


def test_greedy_generation_is_transformers_and_never_a_padded_id(odd):
    theirs, ours = greedy_both_ways(odd.source, odd.done.checkpoint, odd.done.model)
    assert ours == theirs
    assert max(max(row) for row in ours) < V


def test_bad_vocab_multiple_is_one_line(odd, tmp_path):
    for value in ("0", "many"):
        result = run_jaxpar("train", str(odd.done.config_yaml), f"run_dir={tmp_path}",
                            f"model.vocab_multiple={value}", "host_devices=1",
                            env={**cached_jax_env(tmp_path), "JAX_PLATFORMS": "cpu"})
        assert_one_line_error(result, "model.vocab_multiple")


def test_jaxpar_config_shows_both_sizes(odd):
    result = run_jaxpar("config", str(odd.done.config_yaml), "mesh.tensor=2", "host_devices=2",
                        "mesh.data=-1")
    assert result.returncode == 0, result.stderr
    line = next(t for t in result.stdout.splitlines() if t.strip().startswith("vocab_size:"))
    assert line.startswith(f"  vocab_size: {V}  # true size;") and "384 rows" in line, line
    assert f"vocab {V} (padded to 384 rows" in run_import_line(odd)


def run_import_line(odd) -> str:
    """What ``jaxpar import-hf`` prints of the vocabulary (a second import, on the command
    line)."""
    out = odd.root / "import-cli"
    result = run_jaxpar("import-hf", str(odd.source), "--to", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout

