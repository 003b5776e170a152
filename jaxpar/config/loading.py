"""Building a :class:`~jaxpar.config.schema.Config`: YAML presets and files, dotted ``key=value``
overrides, each value typed and checked against the schema; renamed keys read under their old
names until the version :data:`RENAMED_KEYS` names, with a one-line warning."""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml

from jaxpar.config.schema import (
    MESH_AXES,
    PRESETS_DIR,
    Config,
    ConfigError,
)
from jaxpar.config.validation import check_distributed

# --------------------------------------------------------------------------------------------
# Renamed keys: the one table, read by every path into a Config (YAML files, saved run_dir
# configs and checkpoints, key=value overrides).

# Old dotted key -> new: the old key is accepted, with a warning, until jaxpar RENAMED_UNTIL.
RENAMED_KEYS = {
    "train.schedule": "train.lr_schedule",  # beside parallel.pipeline_schedule
    "train.loss_chunks": "train.loss_pieces",  # "chunk": a pipeline stage's slice of layers
    "parallel.expert_chunks": "parallel.expert_pieces",
}
RENAMED_UNTIL = "0.2.0"
_warned: set[str] = set()  # old keys already reported in this process


def renamed_key_warning(old: str) -> str:
    return (f"warning: {old} is renamed {RENAMED_KEYS[old]}; the old key is accepted until "
            f"jaxpar {RENAMED_UNTIL}")


def _renamed(tree: Mapping[str, Any]) -> dict[str, Any]:
    """``tree`` (one source: a file, a saved config or the overrides) with each old key of
    :data:`RENAMED_KEYS` moved to its new name, reported once a process on stderr; old and new
    key both set is a ConfigError."""
    out = dict(tree)
    for old, new in RENAMED_KEYS.items():
        section, old_name = old.split(".")
        new_name = new.split(".")[1]
        node = out.get(section)
        if not isinstance(node, Mapping) or old_name not in node:
            continue
        if new_name in node:
            raise ConfigError(f"{old} and {new} are both set: {old} is renamed {new}; "
                              f"set {new} only")
        if old not in _warned:
            _warned.add(old)
            print(renamed_key_warning(old), file=sys.stderr)
        out[section] = {new_name if k == old_name else k: v for k, v in node.items()}
    return out


# --------------------------------------------------------------------------------------------
# Building a Config from nested dicts, with types checked against the dataclass schema.


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(str(a) for a in typing.get_args(tp))
    if _is_optional(tp):
        return _type_name(_strip_optional(tp)) + " or null"
    return getattr(tp, "__name__", str(tp))


# Plain-text fields whose allowed forms are worth naming in a type error.
_FORMS = {"train.resume": "auto, never, a step number or a checkpoint path"}


def _is_optional(tp: Any) -> bool:
    union = typing.get_origin(tp) in (typing.Union, types.UnionType)
    return union and type(None) in typing.get_args(tp)


def _strip_optional(tp: Any) -> Any:
    return next(a for a in typing.get_args(tp) if a is not type(None))


def _parse_scalar_text(text: str) -> Any:
    """Read an override's right-hand side as YAML would (``2`` -> int, ``true`` -> bool)."""
    try:
        return yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        return text


def _coerce(key: str, tp: Any, value: Any) -> Any:
    """Check ``value`` against the schema type ``tp``; return it converted, or raise ConfigError."""
    if _is_optional(tp):
        if value is None or (isinstance(value, str) and value.lower() in ("null", "none")):
            return None
        tp = _strip_optional(tp)
    origin = typing.get_origin(tp)
    bad = ConfigError(f"{key}: expected {_FORMS.get(key, _type_name(tp))}, got {value!r}")
    if origin is Literal:
        allowed = typing.get_args(tp)
        if isinstance(value, bool) and {"on", "off"} <= set(allowed):  # YAML 1.1 reads on/off
            value = "on" if value else "off"
        if not any(value == a and type(value) is type(a) for a in allowed):
            raise ConfigError(f"{key}: {value!r} is not allowed; allowed values: "
                              + ", ".join(str(a) for a in allowed))
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise bad
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise bad
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise bad
    if origin is tuple and typing.get_args(tp) == (int, Ellipsis):  # generation.eos_ids
        items = [value] if isinstance(value, int) else value
        if (isinstance(items, Sequence) and not isinstance(items, str)
                and all(isinstance(i, int) and not isinstance(i, bool) for i in items)):
            return tuple(items)
        raise ConfigError(f"{key}: expected a list of integers (token ids), got {value!r}")
    if origin is tuple and typing.get_args(tp) == (str, Ellipsis):  # train.lora.targets
        items = [value] if isinstance(value, str) else value
        if (isinstance(items, Sequence) and not isinstance(items, str)
                and all(isinstance(i, str) for i in items)):
            return tuple(items)
        raise ConfigError(f"{key}: expected a list of names, got {value!r}")
    if origin is dict:  # parallel.rules: logical axis -> tuple of mesh axes
        if not isinstance(value, Mapping):
            raise bad
        return {str(k): _coerce_axes(f"{key}.{k}", v) for k, v in value.items()}
    raise bad


def _coerce_axes(key: str, value: Any) -> tuple[str, ...]:
    if value is None or value == "" or (isinstance(value, str) and value.lower() == "none"):
        return ()
    if isinstance(value, str):
        value = [v.strip() for v in value.split(",") if v.strip()]
    if not isinstance(value, Sequence) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{key}: expected a list of mesh axes ({', '.join(MESH_AXES)}), "
                          f"got {value!r}")
    return tuple(value)


def _build(cls: type, data: Mapping[str, Any], prefix: str) -> Any:
    if not isinstance(data, Mapping):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        if key not in names:
            raise ConfigError(f"unknown key {prefix}{key}; allowed keys: {', '.join(names)}")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = _build(tp, value, f"{prefix}{key}.")
        elif _is_dataclass_tuple(tp):
            kwargs[key] = _build_each(typing.get_args(tp)[0], value, f"{prefix}{key}")
        else:
            kwargs[key] = _coerce(f"{prefix}{key}", tp, value)
    return cls(**kwargs)


def _is_dataclass_tuple(tp: Any) -> bool:
    """``tuple[SomeConfig, ...]``: a list of mappings in YAML (``data.sources``)."""
    args = typing.get_args(tp)
    return (typing.get_origin(tp) is tuple and len(args) == 2 and args[1] is Ellipsis
            and dataclasses.is_dataclass(args[0]))


def _build_each(cls: type, value: Any, key: str) -> tuple:
    if value is None or value == "":
        return ()
    if not isinstance(value, Sequence) or isinstance(value, str):
        fields = ", ".join(f.name for f in dataclasses.fields(cls))
        raise ConfigError(f"{key}: expected a list of mappings with keys {fields}, got {value!r}")
    return tuple(_build(cls, item, f"{key}[{i}].") for i, item in enumerate(value))


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    """Insert ``value`` at ``a.b.c`` in nested dicts (schema checks happen later, in _build)."""
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{dotted}: {part} is a value, not a section")
        node = child
    node[parts[-1]] = value


def _to_dict(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {f.name: _to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {k: _to_dict(v) for k, v in obj.items()}
    if isinstance(obj, tuple):
        return [_to_dict(v) for v in obj]
    return obj


def to_dict(cfg: Config) -> dict[str, Any]:
    """Plain nested dict of the config (what ``run_dir/config.yaml`` holds)."""
    return _to_dict(cfg)


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def resolve_config_path(name_or_path: str) -> Path:
    """A YAML path, or the name of a preset in ``configs/`` (``tiny`` or ``tiny.yaml``)."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    for candidate in (PRESETS_DIR / name_or_path, PRESETS_DIR / f"{name_or_path}.yaml"):
        if candidate.is_file():
            return candidate
    presets = sorted(p.stem for p in PRESETS_DIR.glob("*.yaml")) if PRESETS_DIR.is_dir() else []
    raise ConfigError(f"config {name_or_path!r} is neither a YAML file nor a preset; presets: "
                      + (", ".join(presets) or "(none found)"))


def parse_overrides(overrides: Sequence[str]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key=value, e.g. mesh.tensor=2")
        key, text = item.split("=", 1)
        key = key.strip()
        if not key:
            raise ConfigError(f"override {item!r} has an empty key")
        if key.startswith("parallel.rules."):
            value: Any = _coerce_axes(key, text)
        else:
            value = _parse_scalar_text(text)
        _set_dotted(tree, key, value)
    return _renamed(tree)


def _merge(base: dict, extra: Mapping) -> dict:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def load_config(name_or_path: str | None = None, overrides: Sequence[str] = ()) -> Config:
    """Read a preset/YAML file and apply ``key=value`` overrides; types are checked, the device
    count is not (call :func:`validate` once it is known)."""
    data: dict[str, Any] = {}
    if name_or_path is not None:
        path = resolve_config_path(name_or_path)
        try:
            loaded = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            raise ConfigError(f"{path}: not valid YAML{where} "
                              f"({str(err).splitlines()[0]})") from None
        except (OSError, UnicodeDecodeError) as err:
            raise ConfigError(f"{path}: cannot read the config file ({err})") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: expected a mapping at the top level")
        data = _renamed(loaded)
    data = _merge(data, parse_overrides(overrides))
    cfg = _build(Config, data, "")
    # Checked here, not in validate(): the device count that validate() needs comes from it.
    if cfg.host_devices is not None and cfg.host_devices < 1:
        raise ConfigError(f"host_devices={cfg.host_devices}: must be >= 1 (or null for the "
                          "devices jax finds)")
    check_distributed(cfg.distributed)
    return cfg


def config_from_dict(data: Mapping[str, Any]) -> Config:
    """A Config from nested dicts (a saved ``config.yaml``, a checkpoint's config), old keys
    read under their new names."""
    return _build(Config, _renamed(data), "")


def saved_run_config(saved: Mapping[str, Any], mesh: str = "",
                     overrides: Sequence[str] = ()) -> Config:
    """A saved run's config for running its weights (``jaxpar generate``, ``jaxpar eval``,
    lm-eval's model ``jaxpar``): the mesh reset to one device, then ``mesh`` (``data=2,tensor=2``)
    and the ``key=value`` overrides (typed by the schema like every command's)."""
    items = [f"mesh.{item.strip()}" for item in mesh.split(",") if item.strip()]
    base = dict(_renamed(saved), mesh=dict.fromkeys(MESH_AXES, 1))
    for item in items:
        if item.split("=", 1)[0].removeprefix("mesh.") not in MESH_AXES:
            raise ConfigError(f"--mesh {mesh}: axes are {', '.join(MESH_AXES)} "
                              "(e.g. --mesh data=2,tensor=2)")
    cfg = config_from_dict(_merge(base, parse_overrides([*items, *overrides])))
    bad = [f"mesh.{a}={n}" for a, n in cfg.mesh.sizes().items() if n < 1]
    if bad:
        raise ConfigError(f"{bad[0]}: generate takes mesh axis sizes >= 1")
    return cfg
