"""Which attention ``model.attention`` picks on each platform, and its config errors (nothing
compiled; the implementations themselves: ``tests/equivalence/test_attention.py``)."""

from __future__ import annotations

import pytest

from jaxpar.config import ConfigError, ModelConfig, load_config, validate
from jaxpar.model.fused import resolve


def test_auto_picks_blockwise_only_where_the_sequence_spans_several_blocks():
    assert resolve("auto", "cpu", 4096, 512, "float32") == "blockwise"
    assert resolve("auto", "cpu", 512, 512, "float32") == "dense"
    assert resolve("auto", "gpu", 4096, 512, "bfloat16") == "cudnn"
    assert resolve("auto", "gpu", 4096, 512, "float32") == "blockwise"
    assert resolve("dense", "gpu", 4096, 512, "bfloat16") == "dense"
    with pytest.raises(ConfigError, match="model.attention=cudnn needs a GPU"):
        resolve("cudnn", "cpu", 4096, 512, "bfloat16")


def test_auto_picks_splash_on_a_tpu_where_the_sequence_tiles_into_its_blocks():
    assert resolve("auto", "tpu", 2048, 512, "bfloat16") == "splash"
    assert resolve("auto", "tpu", 256, 512, "float32") == "splash"
    assert resolve("auto", "tpu", 1000, 512, "float32") == "blockwise"  # not 128-tiled
    assert resolve("auto", "tpu", 2048, 512, "float32", splash_possible=False) == "blockwise"
    with pytest.raises(ConfigError, match="model.attention=splash needs a TPU"):
        resolve("splash", "cpu", 2048, 512, "float32")
    with pytest.raises(ConfigError, match="multiple of 128"):
        resolve("splash", "tpu", 2048, 64, "float32")


def test_fused_kernels_take_one_window_for_every_layer_and_cudnn_no_soft_cap():
    uniform = ModelConfig(sliding_window=64)
    alternating = ModelConfig(sliding_window=64, global_every=2)
    capped = ModelConfig(attn_softcap=50.0)
    assert resolve("auto", "gpu", 4096, 512, "bfloat16", model=uniform) == "cudnn"
    assert resolve("auto", "tpu", 2048, 512, "bfloat16", model=uniform) == "splash"
    assert resolve("auto", "gpu", 4096, 512, "bfloat16", model=alternating) == "blockwise"
    assert resolve("auto", "tpu", 2048, 512, "bfloat16", model=alternating) == "blockwise"
    assert resolve("auto", "gpu", 4096, 512, "bfloat16", model=capped) == "blockwise"
    assert resolve("auto", "tpu", 2048, 512, "bfloat16", model=capped) == "splash"
    for name, platform in (("cudnn", "gpu"), ("splash", "tpu")):
        with pytest.raises(ConfigError, match=f"model.attention={name} with "
                                              "model.global_every=2: its window is static"):
            resolve(name, platform, 2048, 512, "bfloat16", model=alternating)
    with pytest.raises(ConfigError, match="model.attention=cudnn with model.attn_softcap=50.0"):
        resolve("cudnn", "gpu", 2048, 512, "bfloat16", model=capped)


@pytest.mark.parametrize("overrides,message", [
    (["model.sliding_window=0"], r"model.sliding_window=0: must be >= 1"),
    (["model.global_every=2"], "model.global_every=2 needs model.sliding_window"),
    (["model.sliding_window=8", "model.global_every=-1"], "model.global_every=-1: must be >= 0"),
    (["model.attn_softcap=-1"], "model.attn_softcap=-1.0: must be 0"),
    (["model.rope_local_theta=1e4"], "model.rope_local_theta=10000.0 needs model.sliding_window"),
    (["model.sliding_window=8", "model.rope_local_theta=0.5"],
     "model.rope_local_theta=0.5: must be a finite number > 1"),
    (["model.attention=flash"], "model.attention"),
    (["train.seq_len=96", "model.attention_block=64"],
     "model.attention_block=64 does not divide the 96 tokens"),
    (["mesh.data=1", "mesh.context=2", "train.seq_len=96", "model.attention_block=16"],
     "model.attention_block=16 does not divide the 24 tokens"),
    (["model.attention_block=0"], "model.attention_block=0: must be >= 1"),
    (["mesh.data=1", "mesh.pipe=2", "mesh.tensor=2", "model.attention=splash"],
     "model.attention=splash cannot run in pipeline stages split over tensor"),
])
def test_attention_config_errors_name_the_field(overrides, message):
    # (A window wider than train.seq_len is allowed: it changes nothing.)
    validate(load_config("tiny", ["model.sliding_window=4096", "mesh.data=1"]), 1)
    with pytest.raises(ConfigError, match=message):
        validate(load_config("tiny", overrides),
                 2 if "mesh.context=2" in overrides else 4 if "mesh.pipe=2" in overrides else 1)
