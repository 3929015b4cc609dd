"""Every relative link of README.md and docs/ reaches a file and, with a #fragment, a heading of that page; every
``docs/<page>.md`` that code, configs and tests cite exists. Pages get merged and renamed: these keep links honest."""
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
CITED = re.compile(r"(?<![\w/.])docs/((?:[\w-]+/)?[\w.-]+)\.md\b")
SOURCE_DIRS = ("corrections", "learner", "rollout_client", "scripts", "configs", "tests", "docs", ".ci")


def prose(text):
    """The page without fenced code blocks and inline code, where a bracket is not a link."""
    return re.sub(r"`[^`\n]*`", "", FENCE.sub("", text))


def anchors(page):
    """GitHub's heading ids: lower case, punctuation but - and _ dropped, spaces to -, repeats numbered."""
    seen, ids = {}, set()
    for line in FENCE.sub("", page.read_text()).splitlines():
        heading = re.match(r"#{1,6} (.*)", line)
        if heading:
            slug = re.sub(r"[^\w\- ]", "", heading.group(1).replace("`", "").lower()).replace(" ", "-")
            ids.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
            seen[slug] = seen.get(slug, 0) + 1
    return ids


def test_slugs_follow_github():
    page = ROOT / "docs" / "corrections.md"
    assert "truncated-sampling-top-k--top-p--min-p" in anchors(page)
    assert "the-configuration" in anchors(page)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = []
    for target in LINK.findall(prose(page.read_text())):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, fragment = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif fragment and file.suffix == ".md" and fragment not in anchors(file):
            broken.append(f"{target}: no heading #{fragment} in {file.relative_to(ROOT)}")
    assert not broken, broken


def test_cited_docs_pages_exist():
    """A ``docs/<page>.md`` (or ``docs/DIR/NAME.md`` with DIR a folder of docs/) named anywhere in the sources."""
    missing = []
    for top in SOURCE_DIRS:
        for file in (ROOT / top).rglob("*"):
            if file.suffix not in (".py", ".toml", ".sh", ".md", ".yaml", ".txt") or "fixtures" in file.parts:
                continue
            for name in CITED.findall(file.read_text(errors="replace")):
                folder = name.rpartition("/")[0]
                if (not folder or (ROOT / "docs" / folder).is_dir()) and not (ROOT / "docs" / f"{name}.md").exists():
                    missing.append(f"{file.relative_to(ROOT)}: docs/{name}.md")
    assert not missing, missing
