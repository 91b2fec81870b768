"""Every relative link in README.md and docs/ points at a file that exists (figures and JSON
results the docs cite included), every `#anchor` link points at a heading of its page, and every
`benchmarks/results/` file the docs name exists; and every file kept there is named somewhere
(git keeps the rest)."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^ {0,3}(```|~~~)")
HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$")
INLINE_CODE = re.compile(r"`([^`\n]+)`")
RESULTS_FILE = re.compile(r"benchmarks/results/([A-Za-z0-9_.\-]+)")


def doc_pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def prose(text: str) -> str:
    """The text outside fenced code blocks (a `# comment` in a shell block is no heading, and a
    command's output path is not a file the docs claim exists)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return "\n".join(lines)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: links reduced to their text, lowercase, every
    character but letters, digits, spaces, hyphens and underscores dropped, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    text = "".join(c for c in text if c.isalnum() or c in " -_")
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of a page's headings; a repeated heading gets -1, -2, ... as on GitHub."""
    seen: Counter[str] = Counter()
    found = set()
    for line in prose(page.read_text()).splitlines():
        match = HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        found.add(base if not seen[base] else f"{base}-{seen[base]}")
        seen[base] += 1
    return found


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


def broken_anchors(page: Path) -> list[str]:
    """`#anchor` and `page.md#anchor` links whose anchor is no heading of the target page (a
    missing page is `broken_links`' to report)."""
    broken = []
    for target in LINK.findall(prose(page.read_text())):
        if "://" in target or "#" not in target:
            continue
        path, anchor = target.split("#", 1)
        if path and not path.endswith(".md"):
            continue  # an anchor into source code or a figure: not a heading
        linked = page.parent / path if path else page
        if linked.is_file() and anchor not in anchors(linked):
            broken.append(target)
    return broken


def missing_results(page: Path, root: Path = ROOT) -> list[str]:
    """`benchmarks/results/<file>` paths named in a page's links or inline code (outside code
    blocks) that are not files under `root`."""
    text = prose(page.read_text())
    mentions = LINK.findall(text) + INLINE_CODE.findall(text)
    names = {name for mention in mentions for name in RESULTS_FILE.findall(mention)}
    return sorted(f"benchmarks/results/{name}" for name in names
                  if not (root / "benchmarks" / "results" / name).is_file())


def test_relative_links_resolve():
    pages = doc_pages()
    assert len(pages) > 1
    assert {page.name: broken_links(page) for page in pages} == {page.name: [] for page in pages}


def test_anchors_resolve():
    pages = doc_pages()
    assert sum(len(anchors(page)) for page in pages) > 50
    assert {str(page.relative_to(ROOT)): broken_anchors(page) for page in pages} == \
        {str(page.relative_to(ROOT)): [] for page in pages}


def test_cited_results_exist():
    pages = doc_pages()
    cited = {str(page.relative_to(ROOT)): missing_results(page) for page in pages}
    assert cited == {name: [] for name in cited}


BRACES = re.compile(r"([\w.\-]*)\{([\w.\-]*(?:,[\w.\-]*)+)\}([\w.\-]*)")
CITING_SUFFIXES = (".md", ".py", ".sh", ".toml", ".yml", ".yaml", "Makefile")


def expand_braces(text: str) -> str:
    """`name_{a,b}.json` written out as `name_a.json name_b.json` (as the docs cite families)."""
    return BRACES.sub(lambda m: " ".join(m.group(1) + part + m.group(3)
                                         for part in m.group(2).split(",")), text)


def uncited_results(root: Path = ROOT) -> list[str]:
    """Files under benchmarks/results/ whose name (less its extension) appears in no doc, script
    or test outside that folder."""
    texts = [expand_braces(path.read_text(errors="replace"))
             for path in root.rglob("*") if path.is_file() and path.name.endswith(CITING_SUFFIXES)
             and "benchmarks/results" not in path.as_posix() and ".venv" not in path.parts]
    corpus = "\n".join(texts)
    return sorted(path.name for path in (root / "benchmarks" / "results").iterdir()
                  if path.stem not in corpus)


def test_every_kept_result_is_cited():
    assert uncited_results() == []


def test_an_uncited_result_is_caught(tmp_path):  # the negative control, braces included
    results = tmp_path / "benchmarks" / "results"
    results.mkdir(parents=True)
    for name in ("run_a.json", "run_b.json", "run_c.json", "old.png"):
        (results / name).write_text("{}")
    (tmp_path / "page.md").write_text("See `run_{a,b}.json`.")
    assert uncited_results(tmp_path) == ["old.png", "run_c.json"]


def test_a_broken_link_is_caught(tmp_path):  # the negative control
    (tmp_path / "here.json").write_text("{}")
    page = tmp_path / "page.md"
    page.write_text("[ok](here.json) [web](https://example.org/x) [gone](missing.json#a) [a](#b)")
    assert broken_links(page) == ["missing.json#a"]


def test_github_slugs():
    assert slug("Native GGUF on CPU vs llama.cpp (`make bench-llamacpp`)") == \
        "native-gguf-on-cpu-vs-llamacpp-make-bench-llamacpp"
    assert slug("A real-size model: Llama-3-8B shaped, random weights") == \
        "a-real-size-model-llama-3-8b-shaped-random-weights"
    assert slug("The controller's `K` & [its cost](x.md)") == "the-controllers-k--its-cost"
    assert slug("snake_case and  two spaces") == "snake_case-and--two-spaces"


def test_a_broken_anchor_is_caught(tmp_path):  # the negative control
    (tmp_path / "other.md").write_text("# Other page\n\n## Part (one)\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Title\n\n## Setup\n\n## Setup\n\n```sh\n# not a heading\n```\n\n"
        "[a](#setup) [b](#setup-1) [c](#setup-2) [d](#not-a-heading) [e](#title)\n"
        "[f](other.md#part-one) [g](other.md#part-two) [h](other.md) [i](gone.md#x)\n"
        "[j](https://example.org/x#y) [k](code.py#L10)\n")
    assert broken_anchors(page) == ["#setup-2", "#not-a-heading", "other.md#part-two"]


def test_a_missing_results_file_is_caught(tmp_path):  # the negative control
    results = tmp_path / "benchmarks" / "results"
    results.mkdir(parents=True)
    (results / "here.json").write_text("{}")
    page = tmp_path / "docs" / "page.md"
    page.parent.mkdir()
    page.write_text(
        "[ok](../benchmarks/results/here.json) `benchmarks/results/here.json` and "
        "[gone](../benchmarks/results/gone.json), `benchmarks/results/gone.png` + `.json`, "
        "the folder `benchmarks/results/`.\n\n"
        "```sh\nbench --output benchmarks/results/new.json\n```\n")
    assert missing_results(page, tmp_path) == ["benchmarks/results/gone.json",
                                               "benchmarks/results/gone.png"]
