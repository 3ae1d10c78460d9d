"""The documentation's links lead somewhere: every relative link in README.md and docs/*.md names
a file that exists and, with #anchor, a heading of that file (GitHub's slugs); every page under
docs/ is reachable from the README; the README's test command is the one CI runs."""

import re
from pathlib import Path

import pytest

from tests.docs import CODE_SPAN, FENCE, PAGES, README, REPO

LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t#]*$", re.M)


def prose(text: str) -> str:
    """``text`` without fenced code blocks and code spans, where brackets are code, not links."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its rendered text lower-cased, spaces to hyphens, every
    character but letters, digits, '_', '-' and spaces dropped."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text stays
    text = text.replace("`", "").replace("*", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set:
    """Every heading's anchor; a repeated one gets -1, -2, ... as on GitHub."""
    seen, found = {}, set()
    for heading in HEADING.findall(FENCE.sub("", page.read_text())):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def relative_links(page: Path) -> list:
    """(target path, anchor or None) for each link that is not to another site."""
    links = []
    for target in LINK.findall(prose(page.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):  # https:, mailto:, ...
            continue
        path, _, anchor = target.partition("#")
        links.append(((page.parent / path).resolve() if path else page, anchor or None))
    return links


def broken_links(page: Path) -> list:
    problems = []
    for path, anchor in relative_links(page):
        shown = path.relative_to(REPO) if path.is_relative_to(REPO) else path
        if not path.exists():
            problems.append(f"{page.name}: {shown} does not exist")
        elif anchor is not None and (path.suffix != ".md" or anchor not in anchors(path)):
            problems.append(f"{page.name}: {shown} has no heading #{anchor}")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_relative_link_and_anchor_exists(page):
    assert broken_links(page) == []


def test_broken_link_and_anchor_are_found(tmp_path):
    """The check itself: a missing file and a missing heading are both reported."""
    (tmp_path / "other.md").write_text("# Other page\n\n## Step time: A vs B (`x_y`)\n\n```bash\n# not a heading\n```\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md#step-time-a-vs-b-x_y) [top](other.md#other-page) [gone](missing.md)\n"
                    "[bad](other.md#not-a-heading) `[code](nowhere.md)` [web](https://example.com/x)\n")
    assert broken_links(page) == [f"page.md: {tmp_path / 'missing.md'} does not exist",
                                  f"page.md: {tmp_path / 'other.md'} has no heading #not-a-heading"]


def test_repeated_headings_get_numbered_anchors(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Notes\n\n## Notes\n\n### Notes\n")
    assert anchors(page) == {"notes", "notes-1", "notes-2"}


def test_every_docs_page_is_linked_from_the_readme():
    linked = {path for path, _ in relative_links(README)}
    assert [page.name for page in PAGES[1:] if page.resolve() not in linked] == []


def test_pages_are_readable_in_one_sitting():
    assert {page.name: n for page in PAGES if (n := len(page.read_text().splitlines())) >= 600} == {}


def test_ci_runs_the_readme_test_command():
    """.ci/run is what CI runs; it must be the command the README tells a user to run."""
    command = re.search(r"^(bash tools/bootstrap\.sh python -m pytest [^#\n]*?)\s*(#.*)?$",
                        README.read_text(), re.M).group(1)
    assert command in (REPO / ".ci" / "run").read_text().splitlines()
