"""The documentation holds together: every link of the front page and of docs/ reaches a file and, with
an anchor, a heading of that page (as GitHub names headings); each page's contents list is its
headings; docs/README.md indexes every page."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
LINK = re.compile(r"\[([^\]]*)\]\(([^)\s]+)\)")


def prose(text: str) -> str:
    """The text outside fenced code blocks."""
    return re.sub(r"^```.*?^```$", "", text, flags=re.M | re.S)


def headings(text: str) -> list[tuple[int, str, str]]:
    """(level, title, anchor) of each heading, the anchor as GitHub makes it: lower case, punctuation
    dropped (backticks too), spaces as hyphens, a repeated one numbered."""
    seen: dict[str, int] = {}
    out = []
    for m in re.finditer(r"^(#{1,6}) (.+)$", prose(text), flags=re.M):
        anchor = re.sub(r"[^\w\- ]", "", m.group(2).strip().lower()).replace(" ", "-")
        n = seen.get(anchor, 0)
        seen[anchor] = n + 1
        out.append((len(m.group(1)), m.group(2), anchor if n == 0 else f"{anchor}-{n}"))
    return out


def contents(text: str) -> list[str] | None:
    """The bullet list under a page's `**Contents**` line, or None without one."""
    lines = text.splitlines()
    if "**Contents**" not in lines:
        return None
    listed = []
    for line in lines[lines.index("**Contents**") + 1:]:
        if line.startswith(("- ", "  - ")):
            listed.append(line)
        elif listed:
            break
    return listed


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_reaches_a_page_and_a_heading(page: Path) -> None:
    broken = []
    text = re.sub(r"`[^`\n]*`", "``", prose(page.read_text()))  # a code span is not a link
    for _, target in LINK.findall(text):
        if re.match(r"^[a-z]+:", target):
            continue  # another site
        path, _, anchor = target.partition("#")
        where = (page.parent / path).resolve() if path else page
        if not where.exists():
            broken.append(f"{target}: no {where.relative_to(ROOT) if where.is_relative_to(ROOT) else where}")
        elif anchor and where.suffix == ".md" and anchor not in {a for _, _, a in headings(where.read_text())}:
            broken.append(f"{target}: no heading #{anchor} in {where.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_contents_list_is_the_pages_headings(page: Path) -> None:
    text = page.read_text()
    expected = [f"{'  ' * (level - 2)}- [{title}](#{anchor})" for level, title, anchor in headings(text)
                if level in (2, 3)]
    listed = contents(text)
    if listed is None:
        assert len([h for h in headings(text) if h[0] == 2]) < 2, \
            f"{page.relative_to(ROOT)} has sections and no **Contents** list; it should be:\n" + "\n".join(expected)
        return
    # The front page lists its sections only.
    if page.name == "README.md" and page.parent == ROOT:
        expected = [e for e in expected if not e.startswith("  ")]
    assert listed == expected, f"{page.relative_to(ROOT)}'s contents list should be:\n" + "\n".join(expected)


def test_the_docs_index_names_every_page() -> None:
    index = (DOCS / "README.md").read_text()
    linked = {target.partition("#")[0] for _, target in LINK.findall(index)}
    missing = {p.name for p in DOCS.glob("*.md")} - {"README.md"} - linked
    assert not missing, f"docs/README.md does not index {sorted(missing)}"


def _areas(bullets: str) -> list[str]:
    """The area each top-level bullet of a "not built" list speaks of: its words before a colon or a
    parenthesis."""
    return [re.split(r"[:(]", line[2:], maxsplit=1)[0].strip() for line in bullets.splitlines()
            if line.startswith("- ")]


def test_the_front_pages_not_built_list_names_the_same_areas_as_the_page() -> None:
    # README's list is the short form of docs/not-built.md: an area said there and not here (or the
    # other way round) is a list that went stale.
    readme = (ROOT / "README.md").read_text()
    short = readme.split("## Not built yet", 1)[1].split("\n## ", 1)[0]
    whole = (DOCS / "not-built.md").read_text()
    assert sorted(_areas(short)) == sorted(_areas(whole))
