"""One vocabulary (issue 49, point 3): outside ``jaxpar/cli/`` (whose files are named after the
CLI's words), no two modules of ``jaxpar/`` share a file name, ``__init__.py`` aside. A name then
says what its module holds wherever it is read: a traceback, an import, a doc's pointer.

The test fails when a module is added whose name another has: adding, say,
``jaxpar/parallel/flops.py`` beside ``jaxpar/inspect/hlo/flops.py`` puts the name ``flops.py``
twice in :func:`module_names`, and the assertion lists it with both paths. The helper is checked
on a made-up tree as well (:func:`test_the_check_finds_a_shared_name`), so the test cannot pass
by finding nothing.

Plain file names only: nothing of jaxpar is imported.
"""

from __future__ import annotations

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
