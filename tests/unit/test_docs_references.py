"""The code the walkthrough pages name exists: every `path.py:name` in docs/train-step.md,
docs/add-a-layer.md and docs/glossary.md names a file of the repository and, in it, a function
or class (``A.b``: a method ``b`` of class ``A``, or a function ``b`` defined inside function
``A``). A bare `path.py` or `path/` names a file or folder that exists.

Plain text and ``ast`` only: nothing of jaxpar is imported.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "docs" / "train-step.md", ROOT / "docs" / "add-a-layer.md",
         ROOT / "docs" / "glossary.md"]

REFERENCE = re.compile(r"`((?:jaxpar|tests|scripts)/[\w/.-]*?)(?::([\w.]+))?`")


def references(text: str) -> list[tuple[str, str | None]]:
    """(path, dotted name or None) of each `path:name` or `path` code span."""
    return REFERENCE.findall(text)


def defined(tree: ast.AST, dotted: str) -> bool:
    """Whether ``dotted`` (``f``, ``A.b``, ``f.inner``) is defined in ``tree``, each part among
    the definitions (or module-level assignments, for the first part) of the part before."""
    scopes: list[ast.AST] = [tree]
    for depth, part in enumerate(dotted.split(".")):
        found = []
        for scope in scopes:
            for node in ast.walk(scope) if depth else ast.iter_child_nodes(scope):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) \
                        and node.name == part:
                    found.append(node)
                elif depth == 0 and isinstance(node, (ast.Assign, ast.AnnAssign)):
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    if any(isinstance(t, ast.Name) and t.id == part for t in targets):
                        found.append(node)
        if not found:
            return False
        scopes = found
    return True


def missing(page: Path, root: Path = ROOT) -> list[str]:
    problems = []
    for path, name in references(page.read_text(encoding="utf-8")):
        target = root / path
        if not target.exists():
            problems.append(f"{path} (no such file)")
        elif name and not defined(ast.parse(target.read_text()), name):
            problems.append(f"{path}:{name} (not defined there)")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_named_function_exists(page):
    assert references(page.read_text(encoding="utf-8")), "the page names no code"
    problems = missing(page)
    assert not problems, "\n".join(problems)


def test_the_checker_finds_what_is_missing(tmp_path):
    (tmp_path / "jaxpar").mkdir()
    (tmp_path / "jaxpar" / "m.py").write_text(
        "X = 1\nclass A:\n    def b(self):\n        pass\n"
        "def f():\n    def inner():\n        pass\n")
    page = tmp_path / "page.md"
    page.write_text("`jaxpar/m.py:A.b` `jaxpar/m.py:f.inner` `jaxpar/m.py:X` `jaxpar/m.py`\n"
                    "`jaxpar/m.py:A.c` `jaxpar/m.py:g` `jaxpar/gone.py:f` `jaxpar/m.py:b`\n")
    assert missing(page, tmp_path) == [
        "jaxpar/m.py:A.c (not defined there)", "jaxpar/m.py:g (not defined there)",
        "jaxpar/gone.py (no such file)", "jaxpar/m.py:b (not defined there)"]
