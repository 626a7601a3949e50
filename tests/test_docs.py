"""The lab manual (docs/) keeps up with the experiments: a page per experiment, every
parameter named on it, every page linked from the index (the tour's chapters first,
in the tour's order). Reads files only: no root, no network, no fabric."""
import dataclasses
import re
from pathlib import Path

import pytest

from lab import runner, tour

DOCS = Path(__file__).resolve().parent.parent / "docs"
PAGES = DOCS / "experiments"
INDEX = DOCS / "README.md"
EXPERIMENTS = runner.available()


@pytest.fixture(autouse=True)
def no_lab_objects_left():
    """Overrides conftest's sweep of lab objects: this module creates none, and must not
    tear down a fabric that another run on this machine is using."""
    yield


def page(name: str) -> str:
    path = PAGES / f"{name}.md"
    assert path.exists(), f"experiment {name} has no page: write {path.relative_to(DOCS.parent)}"
    return path.read_text()


def index_links() -> list[str]:
    """The experiment pages the index links to, in order."""
    return re.findall(r"\]\(experiments/([^)#]+)\.md\)", INDEX.read_text())


@pytest.mark.parametrize("name", sorted(EXPERIMENTS))
def test_every_experiment_has_a_page_naming_every_parameter(name):
    text = page(name)
    missing = [f.name for f in dataclasses.fields(EXPERIMENTS[name].Params)
               if f"`{f.name}`" not in text]
    assert not missing, f"docs/experiments/{name}.md does not name parameter(s) {missing}"


def test_every_page_is_linked_from_the_index():
    links = index_links()
    unlinked = sorted(set(EXPERIMENTS) - set(links))
    assert not unlinked, f"docs/README.md links no page for {unlinked}"
    stray = sorted(set(links) - set(EXPERIMENTS))
    assert not stray, f"docs/README.md links pages of no experiment: {stray}"
    assert len(links) == len(set(links)), "docs/README.md links a page twice"


def test_no_page_for_an_experiment_that_does_not_exist():
    pages = {p.stem for p in PAGES.glob("*.md")}
    assert not pages - set(EXPERIMENTS), f"pages without an experiment: {pages - set(EXPERIMENTS)}"


def test_index_lists_the_tour_first_in_its_order():
    chapters = [c.experiment for c in tour.CHAPTERS]
    assert index_links()[:len(chapters)] == chapters
