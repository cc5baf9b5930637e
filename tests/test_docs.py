"""The README and docs/ pages: the generated benchmark tables match benchmarks/results/, the README is a short
front page that starts with the two commands, and every relative link points to a file (and heading) that
exists."""

from __future__ import annotations

import re
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
CODE = re.compile(r"`[^`\n]*`")


def test_tables_match_the_results():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "tables.py"), "--check"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert proc.returncode == 0, "stale or missing tables:\n" + proc.stderr


def test_the_check_names_a_stale_table(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import tables

    page = tmp_path / "docs"
    page.mkdir()
    for name in {p for p, _, _ in tables.TABLES.values()}:
        (page / name).write_text((ROOT / "docs" / name).read_text())
    text = (page / "trainer.md").read_text()
    row = tables.render("trainer").splitlines()[2]  # the first data row, as the results file says
    assert row in text
    (page / "trainer.md").write_text(text.replace(row, row.replace("| fp32 |", "| fp32 (edited) |")))
    monkeypatch.setattr(tables, "DOCS", page)
    problems = tables.update(check=True)
    assert problems == ["trainer.md: table:trainer is stale (run python benchmarks/tables.py)"]


def test_readme_is_a_front_page():
    lines = README.read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; the rest belongs in docs/"
    assert lines[0].startswith("# bitrl")
    first_block = lines.index("```bash")
    assert all(not ln.strip() for ln in lines[1:first_block]), "the commands come first"
    assert lines[first_block + 1].split("#")[0].strip() == "make demo"
    assert lines[first_block + 2].split("#")[0].strip() == "make test"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, inline code marks and punctuation dropped, spaces to '-'."""
    text = heading.strip().lower().replace("`", "")
    text = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN")
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text())
    seen: dict[str, int] = {}
    anchors = set()
    for line in text.splitlines():
        m = re.match(r"#{1,6}\s+(.*)", line)
        if m:
            slug = _slug(m.group(1))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def _links(path: Path) -> list[str]:
    text = CODE.sub("", FENCE.sub("", path.read_text()))
    return [t for t in LINK.findall(text) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = []
    for target in _links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target} (no such heading)")
    assert not broken, f"{page.relative_to(ROOT)}: " + ", ".join(broken)


def test_pages_link_their_plots():
    text = "".join(p.read_text() for p in PAGES)
    for png in sorted((ROOT / "docs" / "img").glob("*.png")):
        assert f"img/{png.name}" in text, f"docs/img/{png.name} is linked from no page"
        assert png.stat().st_size < 200 * 1024, f"docs/img/{png.name} is over 200 KB"
