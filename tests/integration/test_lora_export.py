"""``jaxpar export --format hf`` of a LoRA run (docs/lora.md): the merged model, and with
``--adapters-only`` a PEFT-format adapter directory. A base run, exported; a LoRA run from its
checkpoint (``train.init_from``), exported both ways. transformers computes from the merged
export the logits jaxpar's adapted model computes from the checkpoint, and the base export with
the adapter directory's tensors applied by hand as PEFT applies them (``W + lora_alpha / r * B A``
per module), and the ``peft`` package loading the adapter directory onto the base export, compute
them too."""

from __future__ import annotations

import json
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from helpers import assert_one_line_error, env_without_device_flags, run_jaxpar
from hf_models import hf_logits, jaxpar_logits

from jaxpar.checkpoint.state import read_config
from jaxpar.checkpoint.weights_only import read_weights, step_dir
from jaxpar.config import config_from_dict, validate
from jaxpar.mesh import make_mesh
from jaxpar.train.step import build_trainer

pytest.importorskip("transformers")

COMMON = ("train.seq_len=32", "train.batch_size=4", "logging.progress=false", "host_devices=1",
          "mesh.data=-1")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root, env = tmp_path_factory.mktemp("lora"), env_without_device_flags()
    for args in (("train", "tiny", *COMMON, "train.steps=2", f"run_dir={root / 'base'}"),
                 ("train", "tiny", *COMMON, "train.steps=3", "train.lr=0.01",
                  "train.warmup_steps=0", "train.lora.rank=4", "train.lora.alpha=8",
                  "train.lora.targets=[q,v,o,down]", f"train.init_from={root / 'base'}",
                  f"run_dir={root / 'lora'}"),
                 ("export", str(root / "base"), "--to", str(root / "base-hf"), "--format", "hf"),
                 ("export", str(root / "lora"), "--to", str(root / "merged"), "--format", "hf"),
                 ("export", str(root / "lora"), "--to", str(root / "adapters"), "--format", "hf",
                  "--adapters-only")):
        result = run_jaxpar(*args, env=env)
        assert result.returncode == 0, result.stderr[-3000:]
    ids = np.random.default_rng(0).integers(0, 256, (2, 16)).astype(np.int32)
    return root, ids, hf_logits(root / "merged", ids)


def test_merged_export_computes_the_adapted_models_logits(runs):
    root, ids, merged = runs
    path = step_dir(root / "lora")
    cfg = validate(config_from_dict(read_config(path)), 1)
    params, buffers, _ = read_weights(path)
    trainer = build_trainer(cfg, make_mesh(cfg, devices=jax.devices()[:1]))
    adapted = jaxpar_logits(trainer, SimpleNamespace(params=params, buffers=buffers), ids)
    assert np.abs(merged - adapted).max() <= 1e-4
    # The adapters changed the model: with B zero again (the base model) the logits differ.
    zero_b = jax.tree_util.tree_map_with_path(
        lambda p, a: np.zeros_like(a) if jax.tree_util.keystr(p).endswith("['b']") else a,
        params)
    base = jaxpar_logits(trainer, SimpleNamespace(params=zero_b, buffers=buffers), ids)
    assert np.abs(base - adapted).max() > 1e-3


def test_adapter_directory_on_the_base_export_computes_the_merged_logits(runs):
    import torch
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM

    root, ids, merged = runs
    config = json.loads((root / "adapters" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8
    assert sorted(config["target_modules"]) == ["down_proj", "o_proj", "q_proj", "v_proj"]
    tensors = load_file(str(root / "adapters" / "adapter_model.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(root / "base-hf", dtype=torch.float32).eval()
    scale = config["lora_alpha"] / config["r"]
    modules = {name.removesuffix(".lora_A.weight") for name in tensors if "lora_A" in name}
    assert len(modules) == 4 * 2  # four targets in each of tiny's two layers
    with torch.no_grad():
        for module in modules:
            a, b = tensors[f"{module}.lora_A.weight"], tensors[f"{module}.lora_B.weight"]
            linear = model.get_submodule(module.removeprefix("base_model.model."))
            assert a.shape == (4, linear.in_features) and b.shape == (linear.out_features, 4)
            linear.weight += torch.from_numpy(scale * (b @ a))
        logits = model(torch.tensor(ids, dtype=torch.long)).logits.numpy()
    assert np.abs(logits - merged).max() <= 1e-4
    assert np.abs(hf_logits(root / "base-hf", ids) - merged).max() > 1e-3


def test_peft_loads_the_adapter_directory_onto_the_base_export(runs):
    """``PeftModel.from_pretrained`` (the ``peft`` package, as a user loads adapters) on the
    base export computes the merged export's logits."""
    peft = pytest.importorskip("peft")
    import torch
    from transformers import AutoModelForCausalLM

    root, ids, merged = runs
    base = AutoModelForCausalLM.from_pretrained(root / "base-hf", dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, root / "adapters").eval()
    assert model.peft_config["default"].r == 4
    with torch.no_grad():
        logits = model(torch.tensor(ids, dtype=torch.long)).logits.numpy()
    assert np.abs(logits - merged).max() <= 1e-4
    with torch.no_grad(), model.disable_adapter():  # the adapters are what moves the logits
        plain = model(torch.tensor(ids, dtype=torch.long)).logits.numpy()
    assert np.abs(plain - merged).max() > 1e-3


def test_generation_runs_the_adapted_model(runs):
    """``jaxpar generate``'s Generator on a LoRA checkpoint scores tokens as the adapted model
    does (its adapters merged into the weights)."""
    from jaxpar.inference.generation import Generator

    root, ids, merged = runs
    path = step_dir(root / "lora")
    cfg = validate(config_from_dict(read_config(path)), 1)
    params, buffers, _ = read_weights(path)
    (logprobs, _), = Generator(cfg, params, buffers).score([list(ids[0])])
    shifted = merged[0, :-1] - merged[0, :-1].max(-1, keepdims=True)
    expected = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    np.testing.assert_allclose(logprobs, expected[np.arange(len(ids[0]) - 1), ids[0, 1:]],
                               atol=1e-4)


def test_adapters_only_needs_a_lora_run_and_format_hf(runs):
    root, _, _ = runs
    env = {**env_without_device_flags(), "JAX_PLATFORMS": "cpu"}
    for source, extra in ((root / "base", ("--format", "hf")), (root / "lora", ())):
        result = run_jaxpar("export", str(source), "--to", str(root / "x"), "--adapters-only",
                            *extra, env=env)
        assert_one_line_error(result, "--adapters-only")
