"""Which attention ``model.attention`` picks on each platform, and its config errors (nothing
compiled; the implementations themselves: ``tests/equivalence/test_attention.py``)."""

from __future__ import annotations

import pytest

from jaxpar.config import ConfigError, load_config, validate
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


@pytest.mark.parametrize("overrides,message", [
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
    with pytest.raises(ConfigError, match=message):
        validate(load_config("tiny", overrides),
                 2 if "mesh.context=2" in overrides else 4 if "mesh.pipe=2" in overrides else 1)
