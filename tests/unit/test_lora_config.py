"""``train.lora``'s configuration (docs/lora.md): the targets a model has, one-line errors."""

from __future__ import annotations

import pytest

from jaxpar.config import ConfigError, load_config, validate
from jaxpar.config.schema import LORA_TARGETS


def _error(*overrides: str, devices: int = 1) -> str:
    with pytest.raises(ConfigError) as info:
        validate(load_config("tiny", ["train.lora.rank=4", *overrides]), devices)
    return str(info.value)


def test_lora_loads_targets_as_a_list() -> None:
    cfg = validate(load_config("tiny", ["train.lora.rank=4", "train.lora.targets=[q,v]"]), 1)
    assert cfg.train.lora.targets == ("q", "v")
    assert validate(load_config("tiny", []), 1).train.lora.targets == LORA_TARGETS


def test_a_target_the_model_does_not_have_is_one_line_naming_it() -> None:
    message = _error("train.lora.targets=[q,wq_proj]")
    assert "\n" not in message and "'wq_proj'" in message and "allowed: q, k, v" in message


def test_lora_refuses_what_it_does_not_run_yet() -> None:
    assert "\n" not in _error("train.lora.dropout=0.1")
    assert "mesh.pipe" in _error("mesh.pipe=2", "train.microbatches=2", devices=2)
    assert "train.lora.rank=-1" in _error("train.lora.rank=-1")
