"""docs/results/ holds what the documentation cites, and its index lists it.

* Every file under docs/results/ is cited (scripts/results_index.py says how: a page of
  docs/, README.md or CONTRIBUTING.md links to it or shows it, or a cited report does, or it
  is the JSON beside a cited report); a result no page cites is removed (git keeps it).
* No page, nor a cited report, links to a result that is not there.
* docs/results/README.md links every stored file once, and nothing else in the folder.
* The checker itself finds an uncited file and a missing one in a small made-up tree.
"""

from __future__ import annotations

import importlib.util
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("results_index", ROOT / "scripts" / "results_index.py")
results_index = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(results_index)


def _rel(paths) -> str:
    return "\n".join(str(p.relative_to(results_index.ROOT)) for p in paths)


def test_every_stored_result_is_cited():
    uncited = results_index.uncited()
    assert not uncited, (
        "no page cites these files in docs/results/: link them from the page whose figures "
        "they hold, or `git rm` them (history keeps them), then run `python "
        "scripts/results_index.py --write`:\n" + _rel(uncited))


def test_no_page_links_to_a_missing_result():
    _, broken = results_index.citations()
    assert not broken, "links to results that are not there:\n" + "\n".join(broken)


def test_the_index_lists_every_result_once():
    index = results_index.INDEX
    targets = [(index.parent / t.split("#")[0]).resolve()
               for t in re.findall(r"\]\(([^)\s#]+)(?:#[^)]*)?\)", index.read_text())]
    inside = [t for t in targets if results_index.RESULTS.resolve() in t.parents]
    missing = [t for t in inside if not t.is_file()]
    assert not missing, "docs/results/README.md links to missing files:\n" + _rel(missing)
    twice = sorted({t for t in inside if inside.count(t) > 1})
    assert not twice, "docs/results/README.md lists these more than once:\n" + _rel(twice)
    unlisted = [p for p in results_index.stored() if p not in inside]
    assert not unlisted, ("docs/results/README.md does not list these (run `python "
                          "scripts/results_index.py --write`):\n" + _rel(unlisted))


@pytest.fixture
def tree(tmp_path, monkeypatch):
    """A repository of two pages and a results folder, as scripts/results_index.py sees it."""
    docs, results = tmp_path / "docs", tmp_path / "docs" / "results"
    results.mkdir(parents=True)
    (tmp_path / "mkdocs.yml").write_text("site_name: t\nnav:\n  - Home: index.md\n")
    (tmp_path / "README.md").write_text("# t\n")
    (docs / "index.md").write_text(
        "# Home\n\nSee [the run](results/run.md) and ![plot](results/plot.png).\n\n"
        "```\n[not a link](results/inside-a-code-block.md)\n```\n")
    (results / "run.md").write_text("Command: `python x.py`\n\nRun alone; see [old](old.md).\n")
    (results / "run.json").write_text("{}")
    (results / "plot.png").write_bytes(b"png")
    (results / "inside-a-code-block.md").write_text("x\n")
    (results / "stray.json").write_text("{}")
    for name, value in (("ROOT", tmp_path), ("DOCS", docs), ("RESULTS", results),
                        ("INDEX", results / "README.md")):
        monkeypatch.setattr(results_index, name, value)
    return results


def test_the_checker_finds_uncited_and_missing_results(tree):
    cited, broken = results_index.citations()
    assert sorted(p.name for p in cited) == ["plot.png", "run.json", "run.md"]
    assert [p.name for p in results_index.uncited()] == ["inside-a-code-block.md", "stray.json"]
    assert broken == ["docs/results/run.md: docs/results/old.md"]
    index = results_index.render()
    assert "## [Home](../index.md)" in index
    for line in ("* [run.md](run.md): Run alone; see old.",
                 "* [run.json](run.json): data of run.md", "* [plot.png](plot.png): plot"):
        assert line in index
