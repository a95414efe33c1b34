"""The documentation, checked from the source: every ``docs/*.md`` page and ``#anchor`` that the
code, the notebooks, the README and the pages themselves cite exists, no file cites documents
that are not in the repository, and the README stays a short user guide."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 300  # a short user guide; the rest lives in docs/

# Text files that may cite a page; the walk skips build outputs, caches and environments.
TEXT_SUFFIXES = {".py", ".cpp", ".h", ".c", ".md", ".sh", ".toml", ".txt", ".json", ".ipynb"}
SKIP_DIRS = {".git", "__pycache__", ".pytest_cache", ".ruff_cache", ".venv", "venv", "build"}
SKIP_DIRS |= {"dist", "node_modules", ".device-wheels", ".ipynb_checkpoints"}
MAX_BYTES = 4 << 20

# Documents that live outside the repository; citing them leaves the reader nowhere to go.
# (Spelled in pieces so that this file does not cite them itself.)
OUTSIDE = ("powerinfer" + "-format.md", "cpu" + "-kernels.md", "shared" + "/reference")

CITE_RE = re.compile(r"\bdocs/((?:[\w-]+/)*[\w-]+\.md)(#[\w-]*)?")
LINK_RE = re.compile(r"\]\(([^)\s]+)\)")
HEADING_RE = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
FENCE_RE = re.compile(r"^\s*(```|~~~)")


def _text_files() -> list[Path]:
    out = []
    for path in sorted(ROOT.rglob("*")):
        rel = path.relative_to(ROOT)
        if any(part in SKIP_DIRS or part.endswith(".egg-info") for part in rel.parts[:-1]):
            continue
        if not path.is_file() or path.stat().st_size > MAX_BYTES:
            continue
        if path.suffix in TEXT_SUFFIXES or (not path.suffix and rel.parts[0] == ".ci"):
            out.append(path)
    return out


def _text(path: Path) -> str:
    """The file's text; for a notebook, its cells' sources only (not the base64 outputs)."""
    raw = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix != ".ipynb":
        return raw
    cells = json.loads(raw).get("cells", [])
    return "\n".join("".join(c.get("source", [])) for c in cells)


FILES = {path: _text(path) for path in _text_files()}


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`|\*\*|__|\[|\]\([^)]*\)", "", heading).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of a markdown page's headings (repeats get -1, -2, … as on GitHub)."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    fenced = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if FENCE_RE.match(line):
            fenced = not fenced
            continue
        m = None if fenced else HEADING_RE.match(line)
        if m:
            base = slug(m.group(2))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


def _citations() -> list[tuple[Path, str, str]]:
    """(citing file, cited page relative to the root, anchor or "") for every ``docs/…md``."""
    out = []
    for path, text in FILES.items():
        for m in CITE_RE.finditer(text):
            out.append((path, "docs/" + m.group(1), (m.group(2) or "").lstrip("#")))
    return out


def _links() -> list[tuple[Path, Path, str]]:
    """(page, target, anchor) for every relative link in the README and the docs pages."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    out = []
    for page in pages:
        for m in LINK_RE.finditer(page.read_text(encoding="utf-8")):
            target = m.group(1)
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            out.append((page, (page.parent / path).resolve() if path else page, anchor))
    return out


def test_slug_matches_github() -> None:
    assert slug("Keys added by powerpy") == "keys-added-by-powerpy"
    assert slug("Matching llama.cpp") == "matching-llamacpp"
    assert slug("GPU index file (`.generated.gpuidx`)") == "gpu-index-file-generatedgpuidx"
    assert slug("Rows, lanes and threads") == "rows-lanes-and-threads"


def test_cited_pages_and_anchors_exist() -> None:
    cites = _citations()
    assert len(cites) > 30, "the citation scan found almost nothing: is the pattern broken?"
    bad = []
    for path, page, anchor in cites:
        where = path.relative_to(ROOT)
        if not (ROOT / page).is_file():
            bad.append(f"{where}: {page} does not exist")
        elif anchor and anchor not in anchors(ROOT / page):
            bad.append(f"{where}: {page} has no heading for #{anchor}")
    assert not bad, "\n".join(sorted(set(bad)))


def test_links_in_readme_and_docs_resolve() -> None:
    bad = []
    for page, target, anchor in _links():
        where = page.relative_to(ROOT)
        if not target.exists():
            bad.append(f"{where}: link to missing {target}")
        elif anchor and target.suffix == ".md" and anchor not in anchors(target):
            bad.append(f"{where}: {target.name} has no heading for #{anchor}")
    assert not bad, "\n".join(bad)


def test_no_file_cites_documents_outside_the_repository() -> None:
    bad = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()[:100]}"
        for path, text in FILES.items()
        for n, line in enumerate(text.splitlines(), 1)
        if any(name in line for name in OUTSIDE)
    ]
    assert not bad, "cite docs/ instead:\n" + "\n".join(bad)


def test_readme_is_a_short_guide() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move detail to docs/"
