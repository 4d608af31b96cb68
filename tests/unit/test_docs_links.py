"""The README is a front door: its links, and the docs pages' links, reach files that exist."""

import re

import pytest

from tests.conftest import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)#\s]+)(#[^)]*)?\)")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_resolve(page):
    broken = [target for target, _ in LINK.findall(page.read_text())
              if "://" not in target and not (page.parent / target).exists()]
    assert not broken, f"{page.relative_to(REPO)}: links to missing files: {broken}"


def test_readme_is_a_front_door():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 220, "the README is the front door: move details to docs/"
    for page in ("install", "configuration", "tuning", "storage", "merging", "checkpoints", "reliability",
                 "planning"):
        assert f"(docs/{page}.md)" in text, f"the README links docs/{page}.md"
    for command in ("make demo", "make test", "slurm/prep.sbatch", "hvctr plan", "slurm/train.sbatch",
                    "slurm/eval.sbatch", "hvctr export"):
        assert command in text
