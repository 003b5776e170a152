"""How much prose the library carries beside its code: the numbers issue 49 asks to watch.

Prints, for a package (default ``jaxpar``): docstring words per line of code, words per sentence
in docstrings, the longest module docstrings in lines, and each compiler version or measured
time the source names outside ``platform.py`` (the one module that may name them). Code lines
are the non-blank lines that are neither comments nor docstrings. Usage::

    python scripts/docstring_stats.py [PACKAGE_DIR] [--top N]
"""

from __future__ import annotations

import argparse
import ast
import re
from pathlib import Path
from typing import NamedTuple

SENTENCE_END = re.compile(r"[.!?](?:\s|$)")
# A compiler version ("libtpu 0.0.42.1", "jax 0.10.2", "XLA:CPU 0.10", a bare "0.0.52"), a
# time ("1.64 s", "90 ms") or a measured before/after ("1.16 -> 1.05"): facts that change with
# each release.
COMPILER_FACT = re.compile(
    r"\b(?:libtpu|jaxlib|jax|flax|optax|orbax|XLA(?::[A-Z]+)?)(?:'s)?\s+v?\d+\.\d+(?:\.\d+)*"
    r"|\b0\.0\.\d{2}\b"
    r"|\b\d+(?:\.\d+)?\s?m?s\b"
    r"|\b\d+\.\d+\s*->\s*\d+\.\d+")
ALLOWED_FACTS = "platform.py"  # at the package's top: where the workarounds name their versions


class FileStats(NamedTuple):
    path: Path
    code_lines: int
    docstring_words: int
    sentences: int
    module_docstring_lines: int


def docstrings(tree: ast.Module) -> list[ast.Constant]:
    """Every docstring node: the module's and each class's and function's first statement."""
    owners = [tree, *(n for n in ast.walk(tree)
                      if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)))]
    found = []
    for owner in owners:
        body = owner.body
        if (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            found.append(body[0].value)
    return found


def file_stats(path: Path) -> FileStats:
    source = path.read_text()
    tree = ast.parse(source)
    docs = docstrings(tree)
    in_docstring = {line for d in docs for line in range(d.lineno, d.end_lineno + 1)}
    code = sum(1 for number, line in enumerate(source.splitlines(), start=1)
               if line.strip() and not line.strip().startswith("#")
               and number not in in_docstring)
    text = " ".join(d.value for d in docs)
    module_doc = ast.get_docstring(tree, clean=False) or ""
    return FileStats(path, code, len(text.split()), max(1, len(SENTENCE_END.findall(text))),
                     len(module_doc.splitlines()) if module_doc else 0)


def compiler_facts(path: Path) -> list[tuple[int, str]]:
    """(line, text) of each compiler version or measured time in a file's source, read with
    each line break (and a comment's ``#`` after it) as one space, so a wrapped one counts."""
    text, lines = [], []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        part = line.strip()
        if text:
            part = " " + part.removeprefix("#").strip()
        text.append(part)
        lines.extend([number] * len(part))
    return [(lines[match.start()], match.group(0))
            for match in COMPILER_FACT.finditer("".join(text))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("package", nargs="?", default="jaxpar", help="package directory")
    parser.add_argument("--top", type=int, default=10, help="longest module docstrings shown")
    args = parser.parse_args()
    stats = [file_stats(p) for p in sorted(Path(args.package).rglob("*.py"))]
    code = sum(s.code_lines for s in stats)
    words = sum(s.docstring_words for s in stats)
    sentences = sum(s.sentences for s in stats if s.docstring_words)
    print(f"{len(stats)} modules, {code} lines of code, {words} docstring words")
    print(f"docstring words per code line: {words / max(code, 1):.2f}")
    print(f"words per docstring sentence:  {words / max(sentences, 1):.1f}")
    over = [s for s in stats if s.module_docstring_lines > 25]
    print(f"module docstrings over 25 lines: {len(over)} of {len(stats)}")
    for s in sorted(stats, key=lambda s: -s.module_docstring_lines)[:args.top]:
        print(f"  {s.module_docstring_lines:4d}  {s.path}")
    allowed = Path(args.package) / ALLOWED_FACTS
    facts = [(s.path, number, text) for s in stats if s.path != allowed
             for number, text in compiler_facts(s.path)]
    xla_cpu = sum(s.path.read_text().count("XLA:CPU") for s in stats if s.path != allowed)
    print(f"mentions of XLA:CPU outside {allowed}: {xla_cpu}")
    print(f"compiler versions and measured times outside {allowed}: {len(facts)}")
    for path, number, text in facts:
        print(f"  {path}:{number}: {text}")


if __name__ == "__main__":
    main()
