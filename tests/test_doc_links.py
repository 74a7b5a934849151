"""The README and the docs pages link to what exists: every relative link and image resolves to a file of the
repository, and every ``#anchor`` names a heading of its page (as GitHub makes anchors from headings). The README
also keeps the shape issue 41 gave it: under 300 lines, the ComfyUI install section within its first 80."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
#: ``[text](target)`` and ``![alt](target)``; a target ends at the first space (a title may follow) or ``)``.
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
#: ``<img src="...">`` in HTML blocks (the README's thumbnail table).
IMG_SRC = re.compile(r"<img\s[^>]*src=\"([^\"]+)\"")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
INLINE_CODE = re.compile(r"`[^`\n]*`")


def _prose(text: str) -> str:
    """``text`` without fenced code blocks and inline code (links there are examples, not links)."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, markup and punctuation dropped, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text stays
    text = text.strip().lower().replace("`", "")
    text = "".join(ch for ch in text if ch.isalnum() or ch in " -_")
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every anchor of ``page``'s headings (a repeated heading gets ``-1``, ``-2``, ... as on GitHub)."""
    found: set[str] = set()
    counts: dict[str, int] = {}
    for line in FENCE.sub("", page.read_text(encoding="utf-8")).splitlines():
        match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            base = slug(match.group(1))
            n = counts.get(base, 0)
            counts[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(page: Path) -> list[str]:
    text = _prose(page.read_text(encoding="utf-8"))
    return LINK.findall(text) + IMG_SRC.findall(text)


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in links(page):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ... (not checked offline)
            continue
        path_part, _, anchor = target.partition("#")
        resolved = (page.parent / path_part).resolve() if path_part else page
        if not resolved.exists():
            broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
        elif not resolved.is_relative_to(ROOT):
            broken.append(f"{page.relative_to(ROOT)}: {target} (outside the repository)")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{page.relative_to(ROOT)}: {target} (no heading with that anchor)")
    return broken


def test_every_relative_link_and_anchor_resolves():
    assert len(PAGES) > 8
    broken = [b for page in PAGES for b in broken_links(page)]
    assert broken == []


def test_the_checker_sees_links_and_anchors(tmp_path):
    # GitHub's anchors: punctuation dropped (so "a × b" keeps two hyphens), code marks dropped
    assert slug("End-to-end benchmark: every task × every method") == "end-to-end-benchmark-every-task--every-method"
    assert slug("Batch runs: `python -m tools.batch`") == "batch-runs-python--m-toolsbatch"
    page = tmp_path / "page.md"
    page.write_text(
        "# Title\n\n## Part\n\n[ok](#part) [bad](#nope) ![img](missing.png) `[code](x.md)`\n"
        '<img src="gone.png">\n```\n[fenced](gone.md)\n```\n',
        encoding="utf-8",
    )
    assert links(page) == ["#part", "#nope", "missing.png", "gone.png"]
    assert anchors(page) == {"title", "part"}


def test_the_readme_is_a_users_page():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) < 300
    install = next(i for i, line in enumerate(lines, 1) if re.match(r"##\s+Install into an existing ComfyUI", line))
    assert install <= 80
    # the two commands of a fresh machine, exactly
    text = "\n".join(lines)
    assert "make demo" in text and "make test-all" in text
    # every docs page is linked from the README
    linked = {(README.parent / t.partition("#")[0]).resolve() for t in links(README) if not t.startswith("http")}
    unlinked = [p.name for p in PAGES[1:] if p.resolve() not in linked]
    assert unlinked == []


#: The pages that took the README's former sections (issue 41): each opens with what it answers.
MOVED_PAGES = ("engine", "equivalence", "benchmarks", "quality", "memory", "calibration", "host", "development")


def test_every_moved_page_says_what_it_answers():
    for name in MOVED_PAGES:
        head = [line for line in (ROOT / "docs" / f"{name}.md").read_text(encoding="utf-8").splitlines() if line]
        assert head[0].startswith("# "), name
        assert head[1].startswith("This page answers:"), name
