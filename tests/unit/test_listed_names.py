"""The names the docs list are the names that exist (docs/design.md, "Presets, scripts and
extras"): presets against ``configs/*.yaml``, scripts against ``scripts/``, extras against
``pyproject.toml``'s optional dependencies, and the README's commands against the CLI's
subcommands. Every list is read from its file when the test runs, as the module map's test
(tests/unit/test_architecture.py) reads docs/design.md.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DESIGN = ROOT / "docs" / "design.md"
README = ROOT / "README.md"

CODE = re.compile(r"`([^`]+)`")


def table_names(text: str, header: str) -> list[str]:
    """The first column's `code` names of the Markdown table whose first header cell is
    ``header``, in order."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.lstrip().startswith("|") and cells[0] == header:
            names = []
            for row in lines[i + 2:]:
                if not row.lstrip().startswith("|"):
                    break
                names += CODE.findall(row.strip().strip("|").split("|")[0])
            return names
    raise AssertionError(f"no table headed '{header}'")


def section(text: str, heading: str) -> str:
    """The text under the Markdown heading ``heading`` up to the next heading of its level."""
    match = re.search(rf"^(#+) {re.escape(heading)}\s*$", text, re.MULTILINE)
    assert match, f"no heading '{heading}'"
    level = len(match.group(1))
    rest = text[match.end():]
    end = re.search(rf"^#{{1,{level}}} ", rest, re.MULTILINE)
    return rest[:end.start()] if end else rest


def presets() -> set[str]:
    return {p.stem for p in (ROOT / "configs").glob("*.yaml")}


def scripts() -> set[str]:
    return {p.name for p in (ROOT / "scripts").iterdir()
            if p.is_file() and not p.name.startswith(".")}


def extras() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return set(project.get("optional-dependencies", {}))


def cli_commands() -> set[str]:
    """The subcommands ``jaxpar.cli.main.build_parser`` registers."""
    import argparse  # noqa: PLC0415

    from jaxpar.cli.main import build_parser  # noqa: PLC0415

    parser = build_parser()
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return set(commands.choices)


def readme_commands() -> list[str]:
    """The command of each line of the README's "Commands" block that starts ``jaxpar X``."""
    block = section(README.read_text(), "Commands").split("```")[1]
    return [m.group(1) for m in re.finditer(r"^jaxpar ([a-z][\w-]*)", block, re.MULTILINE)]


def readme_presets() -> set[str]:
    """The `code` words of the README's paragraph that starts "`CONFIG` is a YAML file", less
    `CONFIG`, `configs/` and the commands it names."""
    text = README.read_text()
    start = text.index("`CONFIG` is a YAML file")
    paragraph = text[start:text.index("\n\n", start)]
    return set(CODE.findall(paragraph)) - {"CONFIG", "configs/"} - cli_commands()


def missing_and_extra(listed: list[str] | set[str], real: set[str]) -> dict[str, list[str]]:
    return {"not listed": sorted(real - set(listed)),
            "listed, not real": sorted(set(listed) - real)}


NOTHING = {"not listed": [], "listed, not real": []}


def test_design_lists_every_preset():
    assert missing_and_extra(table_names(DESIGN.read_text(), "preset"), presets()) == NOTHING


def test_design_lists_every_script():
    assert missing_and_extra(table_names(DESIGN.read_text(), "script"), scripts()) == NOTHING


def test_design_lists_every_extra():
    assert missing_and_extra(table_names(DESIGN.read_text(), "extra"), extras()) == NOTHING


def test_readme_lists_every_preset():
    assert missing_and_extra(readme_presets(), presets()) == NOTHING


def test_readme_lists_every_command():
    # `jaxpar --help` is a line of the block too; it names no command.
    assert missing_and_extra(readme_commands(), cli_commands()) == NOTHING


def test_each_name_is_listed_once():
    design = DESIGN.read_text()
    for names in (table_names(design, "preset"), table_names(design, "script"),
                  table_names(design, "extra")):
        assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)


# The readers themselves: each is seen to find what it must, so an empty list cannot pass.


def test_the_readers_find_the_lists():
    assert {"tiny", "moe-tiny"} <= presets() and "benchmark.py" in scripts()
    assert {"test", "hf"} <= extras() and {"train", "inspect", "eval"} <= cli_commands()
    assert "train" in readme_commands() and "tiny" in readme_presets()


def test_table_names_reads_the_first_column():
    text = ("intro\n\n| thing | what |\n|---|---|\n| `a` | x `not` |\n| `b`, `c` | y |\n\n"
            "| other |\n|---|\n| `d` |\n")
    assert table_names(text, "thing") == ["a", "b", "c"]
    assert table_names(text, "other") == ["d"]
