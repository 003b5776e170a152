"""``logging.wandb`` without running anything: its config errors (one line naming the key and what
is allowed), the missing package (a config error naming the extra), the scalars both trackers
log for a metrics.jsonl row, the hardware profile of a device kind, and the summary's layout
and plan. A run tracked offline: ``tests/integration/test_wandb.py``."""

from __future__ import annotations

import sys

import pytest
from helpers import assert_one_line_config_error

from jaxpar.cli.train import plan_summary
from jaxpar.config import ConfigError, load_config, validate
from jaxpar.cost.estimate import estimate
from jaxpar.hardware import PROFILES, profile_of
from jaxpar.train.metrics import scalars
from jaxpar.train.tracking import layout_summary, require_wandb

ERRORS = {
    "empty-name": (["logging.wandb.name="], "is empty", "logging.wandb.name"),
    "empty-entity": (["logging.wandb.entity= "], "is empty", "logging.wandb.entity"),
    "project-slash": (["logging.wandb.project=a/b"], "cannot hold", "logging.wandb.project"),
    "project-colon": (["logging.wandb.project=a:b"], "cannot hold", "logging.wandb.project"),
    "long-tag": (["logging.wandb.tags=[" + "x" * 65 + "]"], "1 to 64", "logging.wandb.tags"),
    "empty-tag": (["logging.wandb.tags=[ok, '']"], "1 to 64", "logging.wandb.tags"),
    "timeout": (["logging.wandb.init_timeout_s=0"], "> 0", "logging.wandb.init_timeout_s"),
}


@pytest.mark.parametrize(("overrides", "needle", "key"), list(ERRORS.values()), ids=list(ERRORS))
def test_bad_wandb_settings_are_one_line(overrides, needle, key):
    assert_one_line_config_error(overrides, needle, key)


def test_an_unknown_mode_lists_the_allowed_ones():
    with pytest.raises(ConfigError, match="allowed values: disabled, online, offline") as err:
        load_config("tiny", ["logging.wandb.mode=cloud"])
    assert "\n" not in str(err.value) and "logging.wandb.mode" in str(err.value)


def test_good_settings_load_and_tracking_is_off_by_default():
    cfg = validate(load_config("tiny", ["logging.wandb.mode=offline", "logging.wandb.tags=[a,b]",
                                        "logging.wandb.project=p", "logging.wandb.group=g"]), 8)
    w = cfg.logging.wandb
    assert (w.mode, w.tags, w.project, w.group, w.name) == ("offline", ("a", "b"), "p", "g", None)
    assert load_config("tiny").logging.wandb.mode == "disabled"


def test_a_missing_wandb_is_a_config_error_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    require_wandb(load_config("tiny"))  # disabled: not looked for
    with pytest.raises(ConfigError, match=r"pip install 'jaxpar\[track\]'") as err:
        require_wandb(load_config("tiny", ["logging.wandb.mode=online"]))
    assert "\n" not in str(err.value) and "logging.wandb.mode=online" in str(err.value)


def test_scalars_flatten_lists_and_leave_out_nulls_and_the_step():
    row = {"step": 7, "loss": None, "lr": 1e-3, "skipped_steps": 0, "expert_tokens": [3, 5],
           "tokens_seen/web": 1024}
    assert scalars(row) == {"lr": 1e-3, "skipped_steps": 0.0, "expert_tokens/0": 3.0,
                            "expert_tokens/1": 5.0, "tokens_seen/web": 1024.0}


@pytest.mark.parametrize(("kind", "name"), [
    ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"), ("NVIDIA A100-SXM4-80GB", "a100"),
    ("TPU v5 lite", "tpu-v5e"), ("TPU v5p", "tpu-v5p"), ("TPU v4", "tpu-v4"),
    ("TPU v6 lite", "tpu-v6e"), ("cpu", "cpu"), ("some new chip", "cpu")])
def test_a_device_kind_finds_its_profile(kind, name):
    assert profile_of(kind) is PROFILES[name]


def test_the_summary_holds_the_mesh_layout_and_plan_of_a_pipeline():
    cfg = validate(load_config("tiny", ["mesh.pipe=2", "mesh.data=4"]), 8)
    layout = layout_summary(cfg, "NVIDIA H100 80GB HBM3")
    assert (layout["mesh/pipe"], layout["mesh/data"], layout["mesh/tensor"]) == (2, 4, 1)
    assert layout["layout/zero"] == cfg.parallel.zero
    assert layout["layout/pipeline_schedule"] == cfg.parallel.pipeline_schedule
    plan = estimate(cfg, "h100")
    summary = plan.summary()
    assert summary["plan/hardware"] == "h100"
    assert summary["plan/peak_memory_bytes"] == plan.memory.peak
    assert summary["plan/step_time_s"] == plan.time.step
    assert summary["plan/pipeline_bubble"] == plan.pipeline["bubble"] > 0
    assert "plan/step_time_s" not in estimate(cfg).summary()  # no hardware: no time


def test_the_command_line_plans_for_the_devices_of_the_run():
    cfg = validate(load_config("tiny", ["logging.wandb.mode=offline"]), 8)
    assert plan_summary(cfg) == estimate(cfg, "cpu").summary()  # the tests' devices are CPUs
