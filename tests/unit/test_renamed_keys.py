"""Config keys renamed (issue 49, point 3): ``train.schedule`` -> ``train.lr_schedule``,
``train.loss_chunks`` -> ``train.loss_pieces``, ``parallel.expert_chunks`` ->
``parallel.expert_pieces``. Until jaxpar 0.2.0 the old key still loads, by every path into a
Config (a YAML file, a ``key=value`` override, a saved ``run_dir/config.yaml`` or checkpoint
config, a saved run's config for ``generate``/``eval``), to the Config the new key gives, with
a one-line warning printed once; old and new key both set is a one-line error. One table
(``jaxpar.config.loading.RENAMED_KEYS``) serves every path.
"""

from __future__ import annotations

import pytest
import yaml

from jaxpar.config import (
    ConfigError,
    config_from_dict,
    load_config,
    loading,
    saved_run_config,
    to_dict,
)
from jaxpar.config.loading import RENAMED_KEYS, renamed_key_warning

# A value of each renamed key that differs from its default.
VALUES = {"train.schedule": "wsd", "train.loss_chunks": 2, "parallel.expert_chunks": 2}


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    """Each test sees the warnings as a new process would."""
    monkeypatch.setattr(loading, "_warned", set())


def nested(dotted: str, value) -> dict:
    section, key = dotted.split(".")
    return {section: {key: value}}


def test_the_table_is_what_the_tests_cover():
    assert set(RENAMED_KEYS) == set(VALUES)
    assert renamed_key_warning("train.schedule") == (
        "warning: train.schedule is renamed train.lr_schedule; the old key is accepted until "
        "jaxpar 0.2.0")


@pytest.mark.parametrize("old", sorted(VALUES))
def test_an_old_key_in_a_yaml_file_loads_as_the_new_one(old, tmp_path, capsys):
    new, value = RENAMED_KEYS[old], VALUES[old]
    (tmp_path / "old.yaml").write_text(yaml.safe_dump(nested(old, value)))
    (tmp_path / "new.yaml").write_text(yaml.safe_dump(nested(new, value)))
    expected = load_config(str(tmp_path / "new.yaml"))
    assert capsys.readouterr().err == ""
    assert load_config(str(tmp_path / "old.yaml")) == expected
    assert load_config(str(tmp_path / "old.yaml")) == expected  # the warning: once a process
    assert capsys.readouterr().err == renamed_key_warning(old) + "\n"
    section, name = new.split(".")
    assert getattr(getattr(expected, section), name) == value


@pytest.mark.parametrize("old", sorted(VALUES))
def test_an_old_key_as_an_override_loads_as_the_new_one(old, capsys):
    new, value = RENAMED_KEYS[old], VALUES[old]
    assert load_config("tiny", [f"{old}={value}"]) == load_config("tiny", [f"{new}={value}"])
    assert capsys.readouterr().err == renamed_key_warning(old) + "\n"


@pytest.mark.parametrize("old", sorted(VALUES))
def test_a_saved_config_with_an_old_key_loads(old, capsys):
    """A run_dir config.yaml or a checkpoint's config written before the rename."""
    new, value = RENAMED_KEYS[old], VALUES[old]
    cfg = load_config("tiny", [f"{new}={value}"])
    saved = to_dict(cfg)
    section, new_name = new.split(".")
    saved[section] = {old.split(".")[1] if k == new_name else k: v
                      for k, v in saved[section].items()}
    assert new_name not in saved[section]
    assert config_from_dict(yaml.safe_load(yaml.safe_dump(saved))) == cfg
    assert saved_run_config(saved) == saved_run_config(to_dict(cfg))
    assert capsys.readouterr().err == renamed_key_warning(old) + "\n"


@pytest.mark.parametrize("old", sorted(VALUES))
def test_an_override_beats_a_file_whatever_name_either_uses(old, tmp_path):
    new, value = RENAMED_KEYS[old], VALUES[old]
    (tmp_path / "new.yaml").write_text(yaml.safe_dump(nested(new, value)))
    (tmp_path / "old.yaml").write_text(yaml.safe_dump(nested(old, value)))
    default = load_config("tiny")
    section, name = new.split(".")
    default_value = getattr(getattr(default, section), name)
    for path, key in ((tmp_path / "new.yaml", old), (tmp_path / "old.yaml", new)):
        cfg = load_config(str(path), [f"{key}={default_value}"])
        assert getattr(getattr(cfg, section), name) == default_value


@pytest.mark.parametrize("old", sorted(VALUES))
def test_old_and_new_key_both_set_is_a_one_line_error(old, tmp_path):
    new, value = RENAMED_KEYS[old], VALUES[old]
    section = old.split(".")[0]
    both = {section: {old.split(".")[1]: value, new.split(".")[1]: value}}
    (tmp_path / "both.yaml").write_text(yaml.safe_dump(both))
    line = f"{old} and {new} are both set: {old} is renamed {new}; set {new} only"
    for load in (lambda: load_config(str(tmp_path / "both.yaml")),
                 lambda: load_config("tiny", [f"{old}={value}", f"{new}={value}"]),
                 lambda: config_from_dict(both)):
        with pytest.raises(ConfigError) as err:
            load()
        assert str(err.value) == line
