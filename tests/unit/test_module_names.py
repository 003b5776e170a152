"""One vocabulary (issue 49, point 3): outside ``jaxpar/cli/`` (whose files are named after the
CLI's words), no two modules of ``jaxpar/`` share a file name, ``__init__.py`` aside. A name then
says what its module holds wherever it is read: a traceback, an import, a doc's pointer.

The test fails when a module is added whose name another has: adding, say,
``jaxpar/parallel/flops.py`` beside ``jaxpar/inspect/hlo/flops.py`` puts the name ``flops.py``
twice in :func:`module_names`, and the assertion lists it with both paths. The helper is checked
on a made-up tree as well (:func:`test_the_check_finds_a_shared_name`), so the test cannot pass
by finding nothing.

No two public classes defined at module level (outside ``cli/``) share a name either: the
pipeline's ``Round`` is not decoding's ``Step``, the search's ``MeshLayout`` not the model's
``Layout``. Those are read from the source with :mod:`ast`.

Nothing of jaxpar is imported.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "jaxpar"


def shared_names(package: Path) -> dict[str, list[str]]:
    """File name -> the paths (relative to ``package``) of the modules holding it, for each name
    held by more than one module outside ``cli/``, ``__init__.py`` left out."""
    paths: dict[str, list[str]] = defaultdict(list)
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package)
        if rel.parts[0] == "cli" or path.name == "__init__.py":
            continue
        paths[path.name].append(str(rel))
    return {name: found for name, found in paths.items() if len(found) > 1}


def test_no_two_modules_share_a_name():
    assert shared_names(PACKAGE) == {}


def test_the_check_finds_a_shared_name(tmp_path):
    for rel in ("inspect/hlo/flops.py", "parallel/flops.py", "cli/train.py", "train/step.py",
                "train/__init__.py", "model/__init__.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    (tmp_path / "cli" / "step.py").write_text("")  # the CLI's files keep the CLI's words
    assert shared_names(tmp_path) == {"flops.py": ["inspect/hlo/flops.py", "parallel/flops.py"]}


# Class names more than one module may define, each with why. Empty: every public class name of
# jaxpar/ (outside cli/) is defined once.
SHARED_CLASSES_ALLOWED: dict[str, str] = {}


def shared_classes(package: Path) -> dict[str, list[str]]:
    """Class name -> the modules (relative to ``package``) defining a class of that name at
    module level, for each public name (no leading underscore) defined in more than one module
    outside ``cli/``."""
    paths: dict[str, list[str]] = defaultdict(list)
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package)
        if rel.parts[0] == "cli":
            continue
        for node in ast.parse(path.read_text(), filename=str(path)).body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                paths[node.name].append(str(rel))
    return {name: found for name, found in paths.items() if len(found) > 1}


def test_no_two_classes_share_a_name():
    shared = shared_classes(PACKAGE)
    assert {k: v for k, v in shared.items() if k not in SHARED_CLASSES_ALLOWED} == {}
    # An allowance no longer needed is dropped, so the list stays what it says.
    assert set(SHARED_CLASSES_ALLOWED) <= set(shared)


def test_the_check_finds_a_shared_class(tmp_path):
    files = {"cost/search.py": "class Layout:\n    pass\n",
             "model/annotate.py": "import dataclasses\n\n@dataclasses.dataclass\nclass Layout:\n"
                                  "    x: int = 0\n\nclass _Hidden:\n    pass\n",
             "inspect/groups.py": "class _Hidden:\n    pass\n\ndef f():\n"
                                  "    class Layout:\n        pass\n",
             "cli/plan.py": "class Layout:\n    pass\n"}
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    # Private and nested classes and the CLI's do not count.
    assert shared_classes(tmp_path) == {"Layout": ["cost/search.py", "model/annotate.py"]}
