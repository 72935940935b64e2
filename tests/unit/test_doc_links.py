"""Every relative link of README.md, docs/*.md and benchmarks/README.md reaches a file,
and a link to a heading (``page.md#anchor``) reaches one of that page's headings (#24:
the README became a front door of links; a moved section must not leave them dangling)."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "benchmarks" / "README.md",
         *sorted((ROOT / "docs").glob("*.md"))]


def anchors(markdown: str) -> set[str]:
    """The anchors of ``markdown``'s headings, as GitHub makes them (lower case, spaces
    to hyphens, other punctuation dropped); headings inside code blocks left out."""
    found, inside = set(), False
    for line in markdown.split("\n"):
        if line.startswith("```"):
            inside = not inside
        elif not inside and (m := re.match(r"#{1,6} (.*)", line)):
            found.add(re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return found


def broken_links(page: Path) -> list[str]:
    bad = []
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        name, _, anchor = target.partition("#")
        file = (page.parent / name).resolve() if name else page
        if not file.exists():
            bad.append(f"{target} (no such file)")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file.read_text()):
            bad.append(f"{target} (no such heading in {file.name})")
    return bad


def test_every_relative_link_of_the_docs_reaches_a_file_and_its_heading():
    bad = [f"{page.relative_to(ROOT)}: {b}" for page in PAGES for b in broken_links(page)]
    assert not bad, "links that lead nowhere:\n" + "\n".join(bad)


def test_anchors_are_githubs(tmp_path):
    assert anchors("# Benchmarks\n## Engine: one process (`engine.py`)\n```\n# not\n```\n") \
        == {"benchmarks", "engine-one-process-enginepy"}
    page = tmp_path / "page.md"
    page.write_text("# Here\n[a](page.md#here) [b](page.md#gone) [c](missing.md) "
                    "[d](https://example.org)\n")
    assert broken_links(page) == ["page.md#gone (no such heading in page.md)",
                                  "missing.md (no such file)"]
