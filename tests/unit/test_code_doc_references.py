"""The library's pointers into the docs resolve: every ``docs/page.md`` that a docstring or
comment of ``jaxpar/`` names exists, every ``docs/page.md#anchor`` names a heading of that page,
and every ``docs/page.md, "Section"`` begins a heading of it (the rest of the heading may be
left out). Docstrings send readers there for what they no longer hold (issue 49).

Plain text only: nothing of jaxpar is imported.
"""

from __future__ import annotations

import re
from pathlib import Path

from test_docs_links import HEADING, anchors, prose_lines

ROOT = Path(__file__).resolve().parents[2]
# A comment's continuation: a line break, then the next line's indent and '#'.
CONTINUATION = re.compile(r"\s*\n\s*(?:#\s?)?")
REFERENCE = re.compile(r"docs/([\w-]+\.md)(?:#([\w-]+)|,\s*(['\"])(.+?)\3)?")


def headings(page: Path) -> list[str]:
    """A page's headings as read: code spans' backticks dropped."""
    return [m.group(2).replace("`", "") for _, line in prose_lines(page.read_text())
            if (m := HEADING.match(line))]


def references(source: str) -> list[tuple[str, str, str]]:
    """(page, anchor, section) of each pointer in a source text ('' where absent)."""
    text = CONTINUATION.sub(" ", source)
    return [(page, anchor, section.replace("`", "")) for page, anchor, _, section
            in REFERENCE.findall(text)]


def unresolved(source: str, docs: Path) -> list[str]:
    problems = []
    for page, anchor, section in references(source):
        path = docs / page
        if not path.is_file():
            problems.append(f"docs/{page} (no such page)")
        elif anchor and anchor not in anchors(path):
            problems.append(f"docs/{page}#{anchor} (no such anchor)")
        elif section and not any(h.startswith(section) for h in headings(path)):
            problems.append(f'docs/{page}, "{section}" (no heading begins so)')
    return problems


def test_every_pointer_from_the_code_into_the_docs_resolves():
    problems = [f"{path.relative_to(ROOT)}: {problem}"
                for path in sorted((ROOT / "jaxpar").rglob("*.py"))
                for problem in unresolved(path.read_text(), ROOT / "docs")]
    assert not problems, "\n".join(problems)


def test_the_checker_reads_wrapped_pointers_and_finds_broken_ones(tmp_path):
    (tmp_path / "page.md").write_text("# Page\n\n## The `x` section, long\n")
    source = ('"""See docs/page.md, "The x\n    section" and docs/page.md#page."""\n'
              '# docs/page.md, "The\n# x section"; docs/page.md, "Gone"; docs/none.md\n'
              "# docs/page.md#gone\n")
    assert unresolved(source, tmp_path) == [
        'docs/page.md, "Gone" (no heading begins so)', "docs/none.md (no such page)",
        "docs/page.md#gone (no such anchor)"]
