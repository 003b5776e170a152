"""``jaxpar export --format hf`` of a LoRA run (docs/lora.md): the adapters merged into the
weights they adapt; transformers computes from the export the logits jaxpar's adapted model
computes from the checkpoint."""

from __future__ import annotations

from types import SimpleNamespace

import jax
import numpy as np
import pytest
from helpers import env_without_device_flags, run_jaxpar
from hf_models import hf_logits, jaxpar_logits

from jaxpar.checkpoint.state import read_config
from jaxpar.checkpoint.weights_only import read_weights, step_dir
from jaxpar.config import config_from_dict, validate
from jaxpar.mesh import make_mesh
from jaxpar.train.step import build_trainer

pytest.importorskip("transformers")


def test_export_merges_the_adapters(tmp_path):
    env = env_without_device_flags()
    run = tmp_path / "run"
    result = run_jaxpar("train", "tiny", "train.steps=3", "train.lr=0.01", "train.warmup_steps=0",
                        "train.seq_len=32", "train.batch_size=4", "logging.progress=false",
                        "host_devices=1", "mesh.data=-1", "train.lora.rank=4",
                        "train.lora.targets=[q,v,o,down]", f"run_dir={run}", env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    result = run_jaxpar("export", str(run), "--to", str(tmp_path / "hf"), "--format", "hf",
                        env=env)
    assert result.returncode == 0, result.stderr[-3000:]

    path = step_dir(run)
    cfg = validate(config_from_dict(read_config(path)), 1)
    params, buffers, _ = read_weights(path)
    trainer = build_trainer(cfg, make_mesh(cfg, devices=jax.devices()[:1]))
    ids = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (2, 16)).astype(np.int32)
    adapted = jaxpar_logits(trainer, SimpleNamespace(params=params, buffers=buffers), ids)
    exported = hf_logits(tmp_path / "hf", ids)
    assert np.abs(exported - adapted).max() <= 1e-4
    # The adapters changed the model (B moved away from zero): the base weights alone differ.
    zero_b = jax.tree_util.tree_map_with_path(
        lambda p, a: np.zeros_like(a) if jax.tree_util.keystr(p).endswith("['b']") else a,
        params)
    base_only = jaxpar_logits(trainer, SimpleNamespace(params=zero_b, buffers=buffers), ids)
    assert np.abs(base_only - adapted).max() > 1e-3
