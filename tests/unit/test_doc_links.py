"""The documentation's relative links lead somewhere: in README.md and every docs/**/*.md, each
inline link or image target (http(s)://, mailto: and a bare `#anchor` aside, code spans and
fenced blocks set aside) is a file or folder relative to the page, and a `#fragment` into a
Markdown page names one of its headings (GitHub's slugs). A link into `../shared/` (the spec
beside the checkout) is checked where that folder exists and skipped with the reason where it
does not, except under CI, where it fails (the suite never skips silently there)."""

from __future__ import annotations

import os
import re
from functools import cache
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[2]
SHARED = ROOT.parent / "shared"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

FENCE = re.compile(r"^ {0,3}(```|~~~).*?^ {0,3}\1[^\n]*$", re.M | re.S)
CODE_SPAN = re.compile(r"(`+)(?!`).*?(?<!`)\1(?!`)", re.S)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^ {0,3}#{1,6}[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$", re.M)


def _prose(text: str) -> str:
    """The page without its fenced blocks and code spans, where a `[x](y)` is not a link."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text lowercased, punctuation but `-` and `_`
    dropped, each space a `-`."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


@cache
def anchors(page: Path) -> frozenset[str]:
    """Every heading anchor of a Markdown page, repeated headings numbered as GitHub does."""
    seen: dict[str, int] = {}
    found = set()
    for heading in HEADING.findall(FENCE.sub("", page.read_text())):
        base = slug(heading)
        found.add(f"{base}-{seen[base]}" if base in seen else base)
        seen[base] = seen.get(base, 0) + 1
    return frozenset(found)


def problem(page: Path, target: str) -> str | None:
    """Why `target` (a link on `page`) is broken, or None when it resolves."""
    path, _, fragment = unquote(target).partition("#")
    resolved = (page.parent / path).resolve()
    if not resolved.exists():
        return f"{target}: no such file or folder"
    if fragment and resolved.suffix == ".md" and fragment not in anchors(resolved):
        return f"{target}: no heading #{fragment} in {resolved.name}"
    return None


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    targets = [t for t in LINK.findall(_prose(page.read_text())) if not re.match(r"(https?:|mailto:|#|$)", t)]
    outside = [t for t in targets if (page.parent / t.partition("#")[0]).resolve().is_relative_to(SHARED)]
    unchecked = None
    if outside and not SHARED.is_dir():
        unchecked = f"{SHARED} is not beside this checkout; unchecked: {', '.join(outside)}"
        if os.environ.get("CI"):
            pytest.fail(unchecked)
        targets = [t for t in targets if t not in outside]
    broken = [p for t in targets if (p := problem(page, t))]
    assert broken == [], f"{page.relative_to(ROOT)}: " + "; ".join(broken)
    if unchecked:
        pytest.skip(unchecked)


def test_the_pages_are_found() -> None:
    assert (ROOT / "README.md") in PAGES and len(PAGES) > 1
