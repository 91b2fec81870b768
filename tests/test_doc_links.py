"""Every relative link in README.md and docs/ points at a file that exists (figures and JSON
results the docs cite included)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def broken_links(page: Path) -> list[str]:
    """Relative link targets of a Markdown page that do not exist (anchors and URLs skipped)."""
    broken = []
    for target in LINK.findall(page.read_text()):
        path = target.split("#", 1)[0]
        if not path or "://" in target or target.startswith("mailto:"):
            continue
        if not (page.parent / path).exists():
            broken.append(target)
    return broken


def test_relative_links_resolve():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    assert len(pages) > 1
    assert {page.name: broken_links(page) for page in pages} == {page.name: [] for page in pages}


def test_a_broken_link_is_caught(tmp_path):  # the negative control
    (tmp_path / "here.json").write_text("{}")
    page = tmp_path / "page.md"
    page.write_text("[ok](here.json) [web](https://example.org/x) [gone](missing.json#a) [a](#b)")
    assert broken_links(page) == ["missing.json#a"]
