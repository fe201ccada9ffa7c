"""The README's Python examples run as written and print what their comments say."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


@pytest.mark.parametrize("name", ["rk.capture", "rk.TrainStep"])
def test_example_runs_and_prints_its_comment(name):
    code = next(b for b in BLOCKS if f"{name}(" in b)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, f"README:{name}", "exec"), {})
    said = re.search(r"print\(.*\)\s+# (\{.*)", code).group(1)
    expected = [p.strip() for p in re.split(r"\.\.\.[,}]?", said) if p.strip()]
    for part in expected:
        part = part.rstrip(",} ").lstrip("{")
        assert part in out.getvalue(), (part, out.getvalue())


MAX_LINES = 250


def test_readme_stays_a_first_hour_page():
    """The README is what a newcomer reads first: tables, history and the full reference live in
    docs/, runs/README.md and DESIGN.md, so it stays short enough to read."""
    lines = README.read_text().count("\n")
    assert lines <= MAX_LINES, (
        f"README.md has {lines} lines (at most {MAX_LINES}): move detail to docs/"
    )


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as hyphens."""
    heads = re.findall(r"^#+ (.+)$", page.read_text(), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def test_relative_links_of_the_readme_and_docs_name_files_and_headings_that_exist():
    root = README.parent
    pages = [README, root / "runs" / "README.md", *sorted((root / "docs").glob("*.md"))]
    for page in pages:
        for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)]*))?\)", page.read_text()):
            if "://" in target:
                continue
            linked = (page.parent / target) if target else page
            assert linked.exists(), f"{page.name} links to a missing {target}"
            if anchor and linked.suffix == ".md":
                assert anchor in _anchors(linked), f"{page.name} links to a missing #{anchor}"
