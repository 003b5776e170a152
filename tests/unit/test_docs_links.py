"""The documentation's relative links resolve: every ``[text](path)`` and ``[text](path#anchor)``
in README.md, CHANGELOG.md and docs/*.md names a file of the repository, and every anchor names
a heading of its page (GitHub's slugs). Every page of docs/ is linked from the README.

Plain text only: no jax, nothing of jaxpar imported.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", *DOCS]

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
# [text](target) or ![alt](target), with an optional "title"; the text may hold `code`.
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"")
EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # http:, https:, mailto:, ...


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of a Markdown text's lines outside fenced code blocks."""
    lines, fenced = [], False
    for number, line in enumerate(text.splitlines(), start=1):
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append((number, line))
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text (code spans and link targets dropped),
    lowercased, every character but letters, digits, spaces, '-' and '_' dropped, spaces ->
    '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link renders as its text
    text = text.replace("`", "").lower()
    text = "".join(c for c in text if c.isalnum() or c in " -_")
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor a page offers: its headings' slugs (repeats numbered -1, -2, ... as GitHub
    does) and explicit ``<a name=...>`` / ``<a id=...>`` anchors."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for _, line in prose_lines(path.read_text(encoding="utf-8")):
        found.update(HTML_ANCHOR.findall(line))
        match = HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of every link in a page's prose (not in code blocks or spans)."""
    return [(number, target)
            for number, line in prose_lines(path.read_text(encoding="utf-8"))
            for target in LINK.findall(INLINE_CODE.sub("", line))]


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    """Each relative link of ``path`` that does not resolve inside the repository ``root``, as
    'page:line: target (why)'."""
    problems = []
    for number, target in links(path):
        if not target or EXTERNAL.match(target):
            continue
        file_part, _, anchor = target.partition("#")
        where = f"{path.relative_to(root)}:{number}: {target}"
        resolved = (path.parent / unquote(file_part)).resolve() if file_part else path
        if root not in resolved.parents:
            problems.append(f"{where} (outside the repository)")
            continue
        if not resolved.exists():
            problems.append(f"{where} (no such file)")
            continue
        if anchor:
            if resolved.suffix != ".md":
                problems.append(f"{where} (an anchor into a file that is not Markdown)")
            elif unquote(anchor) not in anchors(resolved):
                problems.append(f"{where} (no heading with this anchor in "
                                f"{resolved.relative_to(root)})")
    return problems


def test_the_pages_exist():
    assert (ROOT / "README.md").is_file() and (ROOT / "CHANGELOG.md").is_file()
    assert DOCS, "docs/ holds no page"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    problems = broken_links(page)
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_every_docs_page_is_linked_from_the_readme():
    readme = ROOT / "README.md"
    linked = {(readme.parent / unquote(target.partition("#")[0])).resolve()
              for _, target in links(readme) if not EXTERNAL.match(target)}
    missing = [str(page.relative_to(ROOT)) for page in DOCS if page.resolve() not in linked]
    assert not missing, f"docs pages the README does not link: {missing}"


# The checker itself: each rule is seen to fail where it must.


def test_slug_follows_github():
    assert slug("Checkpoints and resume") == "checkpoints-and-resume"
    assert slug("Real sizes: compiled against the plan (issue 31)") == (
        "real-sizes-compiled-against-the-plan-issue-31")
    assert slug("`--compare` and `--strict`") == "--compare-and---strict"
    assert slug("Collectives under control flow (XLA:CPU)") == (
        "collectives-under-control-flow-xlacpu")
    assert slug("A `shard_map` nested in a [stage](x.md)") == "a-shard_map-nested-in-a-stage"


def test_the_checker_finds_broken_links(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A page\n\n## Its part\n\ntext\n")
    page = tmp_path / "README.md"
    page.write_text(
        "# Title\n\n"
        "[ok](docs/a.md) [ok](docs/a.md#its-part) [ok](#title) [web](https://x.org/y)\n"
        "[gone](docs/b.md) [bad anchor](docs/a.md#nothing) [bad here](#nowhere)\n"
        "[out](../elsewhere.md) `[in code](docs/b.md)`\n"
        "```\n[in a block](docs/b.md)\n```\n")
    problems = broken_links(page, root=tmp_path)
    assert [p.split(": ", 1)[1].split(" (")[0] for p in problems] == [
        "docs/b.md", "docs/a.md#nothing", "#nowhere", "../elsewhere.md"]
