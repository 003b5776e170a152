"""Seeing where time goes (``jaxpar/train/observe.py``): ``train.profile`` writes a
``jax.profiler`` trace of the chosen steps, ``logging.tensorboard`` the metrics.jsonl rows as
TensorBoard scalars, in a run trained in this process. Their config errors, one line before any
compile: ``tests/integration/test_observe_cli.py``."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console

from jaxpar.config import load_config, validate
from jaxpar.train.loop import train

SHORT = ["train.steps=3", "logging.every=1", "logging.progress=false",
         "checkpoint.enabled=false", "data.max_bytes=200000"]


def _train(tmp_path: Path, *overrides: str) -> str:
    console = Console(record=True, width=300)
    train(validate(load_config("tiny", [*SHORT, *overrides, f"run_dir={tmp_path}"]), 8), console)
    return console.export_text()


def test_profile_traces_the_chosen_steps_into_run_dir_profile(tmp_path):
    text = _train(tmp_path, "train.profile.start_step=2", "train.profile.steps=1")
    traces = list((tmp_path / "profile").glob("plugins/profile/*/*.xplane.pb"))
    assert len(traces) == 1 and traces[0].stat().st_size > 0
    assert f"profile of steps 2-2 in {traces[0]}" in text
    assert f"train.profile: steps 2-2 traced to {tmp_path / 'profile'}" in text


def _records(path: Path) -> list[bytes]:
    """TFRecord framing of an event file: length (u64), its CRC, the bytes, their CRC."""
    data, out, at = path.read_bytes(), [], 0
    while at < len(data):
        (length,) = struct.unpack_from("<Q", data, at)
        out.append(data[at + 12: at + 12 + length])
        at += 12 + length + 4
    return out


def _scalars(run_dir: Path) -> dict[str, dict[int, float]]:
    from tensorboardX.proto.event_pb2 import Event

    scalars: dict[str, dict[int, float]] = {}
    for path in (run_dir / "tensorboard").glob("events.out.tfevents.*"):
        for record in _records(path):
            event = Event.FromString(record)
            for value in event.summary.value:
                scalars.setdefault(value.tag, {})[event.step] = value.simple_value
    return scalars


def test_tensorboard_scalars_equal_the_metrics_rows(tmp_path):
    pytest.importorskip("tensorboardX")
    _train(tmp_path, "logging.tensorboard=true")
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    scalars = _scalars(tmp_path)
    expected: dict[str, dict[int, float]] = {}
    for row in rows:
        for key, value in row.items():
            if key != "step" and value is not None:
                expected.setdefault(key, {})[row["step"]] = value
    assert {"loss", "grad_norm", "lr", "tokens_per_s", "step_time_s"} <= set(expected)
    assert set(scalars) == set(expected)
    for key, by_step in expected.items():
        assert set(scalars[key]) == {1, 2, 3}, key
        for step, value in by_step.items():  # event files hold float32
            assert scalars[key][step] == np.float32(value), (key, step)
