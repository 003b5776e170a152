"""Padded vocabularies without compiling a model (docs/configuration.md, "Padded
vocabularies"): the padded size as a function of the config, its one-line errors, ``jaxpar
config``'s two sizes, the plan's padded bytes and true useful flops, and the mask living in
``jaxpar/model/`` alone. The layouts against one device, generation and resume:
tests/equivalence/test_vocab_padding.py; Hugging Face import and export:
tests/integration/test_hf_vocab_padding.py."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import yaml
from helpers import assert_one_line_config_error, tiny_8x32

from jaxpar.cli.main import main
from jaxpar.config import load_config, validate
from jaxpar.cost.estimate import estimate
from jaxpar.hardware import get_profile
from jaxpar.model.flop_formula import train_flops_per_token
from jaxpar.model.transformer import abstract_model
from jaxpar.model.vocab import VOCAB_AXIS
from jaxpar.parallel.rules import param_logical_axes

PACKAGE = Path(__file__).resolve().parents[2] / "jaxpar"


@pytest.mark.parametrize("overrides, devices, rows", [
    # One device: only the hardware multiple.
    (("mesh.data=1",), 1, 384),
    (("mesh.data=1", "model.vocab_multiple=1"), 1, 257),
    # tensor splits the vocabulary; the multiple is the lcm of both.
    (("mesh.data=1", "mesh.tensor=2", "model.vocab_multiple=1"), 2, 258),
    (("mesh.data=1", "mesh.tensor=4", "model.vocab_multiple=1"), 4, 260),
    (("mesh.data=1", "mesh.tensor=2"), 2, 384),
    (("mesh.data=1", "mesh.tensor=2", "model.vocab_multiple=3"), 2, 258),
    # A pipeline cuts it over pipe too (pipe x tensor pieces).
    (("mesh.data=1", "mesh.pipe=2", "mesh.tensor=2", "train.microbatches=2",
      "model.vocab_multiple=1"), 4, 260),
    # data and fsdp do not split the vocabulary (fsdp splits the embedding's model dim).
    (("mesh.data=2", "mesh.fsdp=2", "model.vocab_multiple=1"), 4, 257),
    # parallel.rules.vocab: the axes that split it are the rule's.
    (("mesh.data=1", "mesh.tensor=2", "model.vocab_multiple=1", "parallel.rules.vocab=none"),
     2, 257),
])
def test_the_padded_size_is_a_multiple_of_the_vocab_multiple_and_the_splitting_devices(
        overrides, devices, rows):
    cfg = validate(load_config("tiny", ["model.vocab_size=257", *overrides]), devices)
    assert cfg.vocab_rows() == rows
    assert cfg.model.vocab_size == 257  # the config keeps the true size


def test_a_vocabulary_that_does_not_divide_is_accepted_and_vocab_multiple_is_checked():
    for overrides, devices in ((["mesh.data=1", "mesh.tensor=2"], 2),
                               (["mesh.data=1", "mesh.pipe=2", "mesh.tensor=2",
                                 "train.microbatches=2"], 4)):
        validate(load_config("tiny", ["model.vocab_size=257", *overrides]), devices)
    for bad in ("0", "-3"):
        assert_one_line_config_error([f"model.vocab_multiple={bad}"], ">= 1",
                                     f"model.vocab_multiple={bad}")


def test_jaxpar_config_shows_the_true_and_the_padded_size(capsys):
    # host_devices=null: this process's 8 devices (jax has started), data=4 x tensor=2.
    assert main(["config", "tiny", "mesh.tensor=2", "host_devices=null",
                 "model.vocab_size=257", "model.vocab_multiple=1"]) == 0
    out = capsys.readouterr().out
    line = next(text for text in out.splitlines() if text.strip().startswith("vocab_size:"))
    assert line.startswith("  vocab_size: 257  # true size;"), line
    assert "258 rows" in line and "model.vocab_multiple=1" in line and "2 devices" in line
    # The sizes are a comment: the printed YAML still loads as the config.
    assert yaml.safe_load(out)["model"]["vocab_size"] == 257
    assert main(["config", "tiny", "host_devices=null"]) == 0
    assert "256 rows in this layout (no padding" in capsys.readouterr().out


def test_the_model_names_the_vocabulary_axis_the_resizing_table_says():
    axes = param_logical_axes(abstract_model(load_config("tiny").model))
    named = {name: names.index("vocab") for name, names in axes.items()
             if isinstance(names, tuple) and "vocab" in names}
    assert named == VOCAB_AXIS


def test_the_plan_counts_padded_bytes_and_the_true_vocabularys_useful_flops():
    """tiny (d_model 64) with 257 ids under tensor=2 and model.vocab_multiple=1: 258 rows."""
    true, padded = (estimate(tiny_8x32("mesh.data=4", "mesh.tensor=2", "model.vocab_multiple=1",
                                       f"model.vocab_size={v}"), "h100") for v in (257, 258))
    params = {p.name: p for p in true.params}
    assert params["embedding"].shape == (258, 64) and params["lm_head"].shape == (64, 258)
    assert params["embedding"].bytes_per_device == 258 * 64 * 4 // 2
    # Bytes: every array of the padded model is the 258-id model's.
    assert true.memory == padded.memory
    # Useful flops (MFU's yardstick, the plan's MFU) count the 257 true ids ...
    cfg = tiny_8x32("mesh.data=4", "mesh.tensor=2", "model.vocab_multiple=1",
                    "model.vocab_size=257")
    per_device = cfg.train.batch_size * cfg.train.seq_len / 8
    assert true.flops.model == train_flops_per_token(cfg.model, cfg.train.seq_len) * per_device
    assert true.flops.model < padded.flops.model
    peak = get_profile("h100").peak_flops
    assert true.time.mfu == pytest.approx(true.flops.model / (true.time.step * peak))
    assert true.time.step == pytest.approx(padded.time.step)
    assert true.time.mfu < padded.time.mfu
    # ... and the executed flops the padded column's too: the same work as 258 true ids.
    assert true.flops.vocab_padding == 6 * 64 * 1 * per_device
    assert true.flops.executed == pytest.approx(padded.flops.executed)


def _functions_outside_the_model() -> list[tuple[str, ast.AST]]:
    out = []
    for path in PACKAGE.rglob("*.py"):
        if path.is_relative_to(PACKAGE / "model"):
            continue
        tree = ast.parse(path.read_text())
        out += [(f"{path.relative_to(PACKAGE.parent)}:{node.name}", node)
                for node in ast.walk(tree)
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)]
    return out


def _is_infinity(node: ast.AST) -> bool:
    if isinstance(node, ast.Attribute) and node.attr in ("inf", "NINF"):
        return True
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value.strip().lstrip("+-").lower() in ("inf", "infinity")
    return isinstance(node, ast.Attribute) and node.attr == "finfo"


def test_the_padding_mask_lives_in_jaxpar_model_only():
    """No function outside ``jaxpar/model/`` both names the vocabulary and makes an infinity
    (or a dtype's extreme): masking the padded logits is the model's (``jaxpar/model/vocab.py:
    masked_logits``), and the pipeline's head and loss call the model's loss for it. Generation's
    top-k and top-p cuts set -inf too, on logits the model already masked."""
    offenders = []
    for name, fn in _functions_outside_the_model():
        nodes = list(ast.walk(fn))
        vocab = any(isinstance(n, ast.Name | ast.Attribute | ast.arg)
                    and "vocab" in (getattr(n, "id", None) or getattr(n, "attr", None)
                                    or getattr(n, "arg", None) or "").lower() for n in nodes)
        if vocab and any(_is_infinity(n) for n in nodes):
            offenders.append(name)
    assert offenders == []
    defined = [str(p.relative_to(PACKAGE.parent)) for p in PACKAGE.rglob("*.py")
               if "def masked_logits" in p.read_text()]
    assert defined == ["jaxpar/model/vocab.py"]
    # The pipeline's loss is the model's own (jaxpar/model/edges.py: Edges.piece_loss, which
    # hands jaxpar/model/loss.py: vocab_piece_loss the true vocabulary).
    stages = (PACKAGE / "parallel" / "pipeline" / "stages.py").read_text()
    assert stages.count("stages.edges.piece_loss(") == 2
    edges = (PACKAGE / "model" / "edges.py").read_text()
    assert "vocab_piece_loss(" in edges and "self.masked_from)" in edges
