"""The docs a newcomer reads (issue 44): every relative link between README.md and
docs/*.md points to a file (and heading) that exists, the README keeps the two commands of
a fresh machine, and the pages stay within the lengths that keep them readable: README.md
<= 300 lines (the user's page), docs/architecture.md <= 200 (the map),
docs/network-model.md <= 400 (the model; the lab's runs are docs/validation-log.md).

    pytest tests/test_docs.py
"""

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
MAX_LINES = {"README.md": 300, "docs/architecture.md": 200, "docs/network-model.md": 400}
MAIN_JOB = ("python3 -m venv .venv && .venv/bin/pip install -c constraints.txt -e . "
            "&& .venv/bin/commbench sweep configs/quickstart.yaml")


def slug(heading: str) -> str:
    """A heading's anchor as GitHub writes it: lower case, punctuation dropped, spaces to -."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, re.M)}


def links(page: Path) -> list[str]:
    text = FENCE.sub("", page.read_text())
    return [target for target in LINK.findall(text)
            if not re.match(r"[a-z]+:", target)]  # http:, https:, mailto: are not checked


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_points_to_an_existing_file(page):
    broken = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        shown = dest.relative_to(REPO) if dest.is_relative_to(REPO) else dest
        if not dest.exists():
            broken.append(f"{target} (no file {shown})")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target} (no heading #{anchor} in {shown})")
    assert not broken, f"{page.relative_to(REPO)}: broken links: {broken}"


def test_the_pages_a_newcomer_reads_stay_short():
    too_long = {name: n for name, limit in MAX_LINES.items()
                if (n := len((REPO / name).read_text().splitlines())) > limit}
    assert not too_long, f"over the line limit {MAX_LINES}: {too_long}"


def test_the_readme_keeps_the_main_job_command():
    assert f"```bash\n{MAIN_JOB}\n```" in (REPO / "README.md").read_text()


def test_the_link_check_sees_a_broken_link(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n[ok](page.md#title) [gone](missing.md) [bad](page.md#nope)\n"
                    "```\n[in a fence](not-checked.md)\n```\n[web](https://example.org)\n")
    assert links(page) == ["page.md#title", "missing.md", "page.md#nope"]
    assert anchors(page) == {"title"}
