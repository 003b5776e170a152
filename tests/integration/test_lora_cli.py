"""``jaxpar train`` with ``train.lora`` (docs/lora.md): fine-tuning a run's checkpoint with
adapters (``train.init_from``: the base weights from the checkpoint, fresh adapters), and a target
the model does not have as one line, exit 2."""

from __future__ import annotations

import math

import pytest
from helpers import assert_one_line_error, env_without_device_flags, metrics, run_jaxpar

COMMON = ("train.seq_len=32", "train.batch_size=4", "logging.every=1",
          "logging.progress=false", "host_devices=1", "mesh.data=-1")


@pytest.mark.slow  # (the default suite's test_lora_export.py starts a LoRA run from a base too)
def test_lora_fine_tunes_a_checkpoint(tmp_path):
    env = env_without_device_flags()
    base = run_jaxpar("train", "tiny", *COMMON, "train.steps=2", f"run_dir={tmp_path / 'a'}",
                      env=env)
    assert base.returncode == 0, base.stderr[-3000:]
    tuned = run_jaxpar("train", "tiny", *COMMON, "train.steps=3", "train.lora.rank=4",
                       f"train.init_from={tmp_path / 'a'}", "checkpoint.enabled=false",
                       f"run_dir={tmp_path / 'b'}", env=env)
    assert tuned.returncode == 0, tuned.stderr[-3000:]
    assert "weights from" in tuned.stdout
    rows = [r for r in metrics(tmp_path / "b") if "loss" in r]
    assert len(rows) == 3 and all(math.isfinite(r["loss"]) for r in rows)


def test_a_lora_target_the_model_lacks_is_one_line(tmp_path):
    result = run_jaxpar("train", "tiny", *COMMON, "train.lora.rank=4",
                        "train.lora.targets=[q,w_qkv]", f"run_dir={tmp_path / 'c'}",
                        env=env_without_device_flags())
    assert_one_line_error(result, "train.lora.targets", "'w_qkv'", "allowed: q, k, v, o")
