"""The documentation the tests read: README.md (the landing page) and every page of the MkDocs site
under docs/ (issue 44 moved the manual there). Tests that check what the docs promise read all of it."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
SITE = [README, *sorted((REPO / "docs").rglob("*.md"))]


def site_text() -> str:
    """README and every docs page, one after the other."""
    return "\n\n".join(p.read_text() for p in SITE)


def section(heading: str) -> str:
    """The body under ``heading`` (its text without the ``#``s) on whichever page holds it: up to the
    next heading of the same or a higher level, or the page's end. Headings inside code blocks do not count."""
    for page in SITE:
        lines, fence, start, level = page.read_text().split("\n"), False, None, 0
        for i, line in enumerate(lines):
            if line.startswith("```"):
                fence = not fence
            m = None if fence else re.match(r"(#+) (.*)", line)
            if not m:
                continue
            if start is None and m.group(2).strip() == heading:
                start, level = i + 1, len(m.group(1))
            elif start is not None and len(m.group(1)) <= level:
                return "\n".join(lines[start:i])
        if start is not None:
            return "\n".join(lines[start:])
    raise AssertionError(f"no page of the docs has the heading {heading!r}")
