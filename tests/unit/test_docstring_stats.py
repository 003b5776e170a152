"""scripts/docstring_stats.py counts code lines, docstring words and sentences as documented."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "docstring_stats.py"


def load_script():
    spec = importlib.util.spec_from_file_location("docstring_stats", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_docstrings_and_comments_are_not_code_and_their_words_are_counted(tmp_path):
    source = tmp_path / "sample.py"
    source.write_text('"""Module line one. Two words.\n\nA third sentence here."""\n'
                      "\n"
                      "# a comment\n"
                      "X = 1\n"
                      "\n"
                      "def f(a):\n"
                      '    """Add one."""\n'
                      "    return a + 1\n")
    stats = load_script().file_stats(source)
    assert stats.code_lines == 3  # X = 1, def f, return
    assert stats.docstring_words == 3 + 2 + 4 + 2
    assert stats.sentences == 4
    assert stats.module_docstring_lines == 3


def test_compiler_versions_and_measured_times_are_found(tmp_path):
    source = tmp_path / "sample.py"
    source.write_text('"""Seen on libtpu 0.0.42.1 and jax 0.10.2; 1.64 s, then 90 ms."""\n'
                      "# bench: 1.16 -> 1.05 of the step; by default (0.0.52) too; XLA:CPU 0.10\n"
                      "X = 2  # 2 layers, 4096 tokens, v5e, 10 us assumed: none of these\n"
                      "# wrapped: libtpu\n# 0.0.42.1\n")
    assert load_script().compiler_facts(source) == [
        (1, "libtpu 0.0.42.1"), (1, "jax 0.10.2"), (1, "1.64 s"), (1, "90 ms"),
        (2, "1.16 -> 1.05"), (2, "0.0.52"), (2, "XLA:CPU 0.10"), (4, "libtpu 0.0.42.1")]
