"""``jaxpar train`` from a mixture (``data.sources`` in a config file): metrics.jsonl counts each
source's tokens of the global batches, and bad mixtures are one line and exit 2 before anything
compiles."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import yaml
from helpers import assert_one_line_error, env_without_device_flags, run_jaxpar, write_text_corpus

from jaxpar.config import PRESETS_DIR
from jaxpar.data import DataIterator, open_mixture

TRAIN = ["train.steps=3", "logging.every=1", "logging.progress=false", "host_devices=2",
         "checkpoint.enabled=false"]


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("mixture")
    for name, seed in (("web", 0), ("code", 1)):
        write_text_corpus(root / f"text-{name}", documents=40, seed=seed)
        result = run_jaxpar("tokenize", str(root / f"text-{name}"), "--to", str(root / name),
                            "--workers", "1", timeout=120)
        assert result.returncode == 0, result.stderr[-2000:]
    return root / "web", root / "code"


def _config(tmp_path: Path, entries: list[dict]) -> Path:
    """The tiny preset with ``data.sources`` as a YAML list of mappings."""
    cfg = yaml.safe_load((PRESETS_DIR / "tiny.yaml").read_text())
    cfg.setdefault("data", {})["sources"] = entries
    path = tmp_path / "mix.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_train_from_a_mixture_counts_tokens_per_source(sources, tmp_path):
    web, code = sources
    config = _config(tmp_path, [{"path": str(web), "weight": 3}, {"path": str(code),
                                                                   "weight": 1}])
    run_dir = tmp_path / "run"
    trained = run_jaxpar("train", str(config), *TRAIN, f"run_dir={run_dir}",
                         env=env_without_device_flags(), timeout=300)
    assert trained.returncode == 0, trained.stderr[-4000:]
    assert "a mixture of 2 tokenized sources (web 75.0%" in trained.stdout
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(np.isfinite(r["loss"]) for r in rows)

    _assert_counts(rows, web, code)
    assert rows[-1]["tokens_seen/web"] > rows[-1]["tokens_seen/code"] > 0


def _assert_counts(rows: list[dict], web: Path, code: Path) -> None:
    """Each row's tokens_seen/* are those of the same mixture's global batches, read here."""
    mix = open_mixture([(str(web), 3.0), (str(code), 1.0)], 32, tokenizer="byte", seed=0)
    it = DataIterator(mix, 8, seed=0, shuffle=False)
    total, step = 0.0, 0
    for row in rows:
        while step < row["step"]:
            total += next(it)["mask"].sum()
            step += 1
        seen = {k: v for k, v in row.items() if k.startswith("tokens_seen/")}
        assert seen == {f"tokens_seen/{k}": v for k, v in it.tokens_seen().items()}
        assert sum(seen.values()) == total  # the global batches' real targets, per source


def test_tokens_seen_go_on_after_a_resume(sources, tmp_path):
    web, code = sources
    config = _config(tmp_path, [{"path": str(web), "weight": 3}, {"path": str(code),
                                                                   "weight": 1}])
    run_dir = tmp_path / "run"
    for steps in (2, 3):  # the second run resumes from the first's checkpoint at step 2
        result = run_jaxpar("train", str(config), *TRAIN[1:-1], f"train.steps={steps}",
                            "checkpoint.enabled=true", "checkpoint.every=1",
                            f"run_dir={run_dir}", env=env_without_device_flags(), timeout=300)
        assert result.returncode == 0, result.stderr[-4000:]
    assert "resumed from step 2" in result.stdout
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    _assert_counts(rows, web, code)


@pytest.mark.parametrize(("entries", "overrides", "needles"), [
    ([{"path": "WEB", "weight": 0}], [], ["data.sources[0].weight=0.0: must be a finite"]),
    ([{"path": "WEB"}], ["data.source=WEB"], ["data.source=", "and data.sources are both set"]),
    ([{"path": "WEB"}, {"path": "NOWHERE"}], [],
     ["data.sources[1].path=", "not a directory written by jaxpar tokenize"]),
])
def test_bad_mixtures_are_one_line_before_compiling(sources, tmp_path, entries, overrides,
                                                    needles):
    def fill(text: str) -> str:
        return text.replace("WEB", str(sources[0])).replace("NOWHERE", str(tmp_path))

    config = _config(tmp_path, [{k: fill(v) if isinstance(v, str) else v for k, v in e.items()}
                                for e in entries])
    run_dir = tmp_path / "run"
    result = run_jaxpar("train", str(config), *TRAIN, f"run_dir={run_dir}",
                        *map(fill, overrides), env=dict(os.environ, JAX_LOG_COMPILES="1"),
                        timeout=120)
    assert_one_line_error(result, *needles)
    assert not run_dir.exists()


def test_a_mixture_is_validated_per_source_and_over_all_held_out_tokens(tmp_path):
    paths = []
    for name, seed in (("web", 0), ("code", 1)):
        write_text_corpus(tmp_path / f"text-{name}", documents=40, seed=seed)
        result = run_jaxpar("tokenize", str(tmp_path / f"text-{name}"), "--to",
                            str(tmp_path / name), "--workers", "1", "--val-fraction", "0.25",
                            timeout=120)
        assert result.returncode == 0, result.stderr[-2000:]
        paths.append(tmp_path / name)
    config = _config(tmp_path, [{"path": str(paths[0]), "weight": 3},
                                {"path": str(paths[1]), "weight": 1}])
    run_dir = tmp_path / "run"
    trained = run_jaxpar("train", str(config), *TRAIN, f"run_dir={run_dir}",
                         "train.eval_every=2", "train.eval_batches=2",
                         env=env_without_device_flags(), timeout=300)
    assert trained.returncode == 0, trained.stderr[-4000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evaluated = [r for r in rows if "val_loss" in r]
    assert [r["step"] for r in evaluated] == [2, 3]
    for r in evaluated:
        per_source = {name: (r[f"val_loss/{name}"], r[f"val_tokens/{name}"])
                      for name in ("web", "code")}
        assert all(np.isfinite(loss) and tokens > 0 for loss, tokens in per_source.values())
        # The overall loss is every held-out token's once: the token-weighted mean of the two.
        tokens = sum(t for _, t in per_source.values())
        assert r["val_tokens"] == tokens
        mean = sum(loss * t for loss, t in per_source.values()) / tokens
        assert r["val_loss"] == pytest.approx(mean, rel=1e-6)
