"""Every relative link in the README, the changelog and the docs names a file that exists (and, for
a ``#fragment``, a heading of that file)."""

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = ["README.md", "CHANGELOG.md", "benchmarks/README.md", *sorted(
    str(p.relative_to(REPO)) for p in (REPO / "docs").rglob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchors(path: Path) -> set:
    """GitHub's heading anchors: lower case, punctuation but ``-`` and ``_`` dropped, spaces to ``-``."""
    out = set()
    for line in path.read_text().splitlines():
        m = re.match(r"#+ (.*)", line)
        if m:
            out.add(re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return out


@pytest.mark.parametrize("page", PAGES)
def test_relative_links_resolve(page):
    src = REPO / page
    bad = []
    for target in LINK.findall(src.read_text()):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, frag = target.partition("#")
        dest = (src.parent / path).resolve() if path else src
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif frag and dest.suffix == ".md" and frag not in _anchors(dest):
            bad.append(f"{target}: no heading #{frag}")
    assert not bad, bad
