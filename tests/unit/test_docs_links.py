"""Every relative link in README.md and docs/*.md resolves to a file or folder of the repository."""
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# [text](target) and ![alt](target); the target up to a space (a title may follow) or the closing parenthesis.
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def relative_links(text: str) -> list[str]:
    """The link targets that point into the repository (not URLs, not in-page anchors), without anchors."""
    text = re.sub(r"```.*?```", "", text, flags=re.DOTALL)  # code blocks hold code, not links
    targets = (m.group(1) for m in LINK.finditer(text))
    return [t.split("#", 1)[0] for t in targets if not re.match(r"[a-z][a-z0-9+.-]*:", t) and not t.startswith("#")]


def test_the_link_finder_sees_links_and_skips_urls_anchors_and_code():
    text = ("see [the math](docs/gspo.md#notation) and ![plot](a/b.png \"t\"), [paper](https://arxiv.org/abs/1), "
            "[up](#status)\n```\n[not](a link.md)\n```\n")
    assert relative_links(text) == ["docs/gspo.md", "a/b.png"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(page):
    broken = [t for t in relative_links(page.read_text()) if not (page.parent / t).exists()]
    assert not broken, f"{page.relative_to(REPO)} links to missing paths: {broken}"
