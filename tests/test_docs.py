"""README and docs/ hold together: every relative link leads to a file (and a heading, where it names one), every
docs page is one click from README, README keeps its word budget and shows the test command CI runs."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
README_WORDS = 1200  # docs/design.md, "Budgets"
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")  # [text](target) and ![alt](target)


def without_code_blocks(page: Path) -> str:
    """The page's text without its fenced code blocks."""
    return re.sub(r"^```.*?^```", "", page.read_text(), flags=re.MULTILINE | re.DOTALL)


def prose(page: Path) -> str:
    """The page without code blocks and inline code, where brackets are not links."""
    return re.sub(r"`[^`\n]*`", "", without_code_blocks(page))


def anchors(page: Path) -> set[str]:
    """The ids GitHub gives the page's headings: lower case, punctuation dropped, spaces as hyphens, a repeated
    heading's id numbered -1, -2, ..."""
    ids, counts = set(), {}
    for match in re.finditer(r"^#{1,6}\s+(.*)$", without_code_blocks(page), flags=re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", match[1].strip().lower()).replace(" ", "-")
        ids.add(f"{slug}-{counts[slug]}" if slug in counts else slug)
        counts[slug] = counts.get(slug, 0) + 1
    return ids


def relative_links(page: Path) -> list[str]:
    """The link targets of the page that are paths in the repository (no scheme such as https:)."""
    return [target for target in LINK.findall(prose(page)) if not re.match(r"[a-z]+:", target)]


@pytest.mark.parametrize("page", PAGES, ids=[str(page.relative_to(ROOT)) for page in PAGES])
def test_every_relative_link_leads_to_a_file_and_heading_that_exist(page):
    assert relative_links(page) or page != README, "README links to nothing: the parser broke"
    broken = []
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        destination = (page.parent / path).resolve() if path else page
        if not destination.exists():
            broken.append(f"{target}: no file {destination.relative_to(ROOT)}")
        elif anchor and destination.suffix == ".md" and anchor not in anchors(destination):
            broken.append(f"{target}: no heading #{anchor} in {destination.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_every_docs_page_is_one_click_from_readme():
    linked = {(ROOT / target.partition("#")[0]).resolve() for target in relative_links(README)}
    unlinked = [page.name for page in PAGES[1:] if page.resolve() not in linked]
    assert len(PAGES) > 1 and not unlinked, f"docs pages README does not link: {unlinked}"


def test_readme_keeps_its_word_budget():
    words = len(README.read_text().split())  # as `wc -w` counts
    assert words <= README_WORDS, f"README.md has {words} words, over the budget of {README_WORDS}"


def test_readme_shows_the_test_command_that_ci_runs():
    [command] = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines() if "pytest" in line]
    assert command in [line.strip() for line in README.read_text().splitlines()]
