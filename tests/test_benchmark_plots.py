"""benchmarks/plots.py: the benchmarks page's plots and tables come from the stored JSON.

* The plots regenerate from the JSON files that ``SOURCES`` names, copied alone into an
  empty folder (so they need no other file), as the PNGs committed in docs/results/plots/.
* docs/benchmarks/index.md shows each table exactly as the script prints it from that
  JSON, embeds every committed plot, links every JSON file a plot is drawn from, and
  every image embedded on a page of docs/ exists.
"""

from __future__ import annotations

import pathlib
import re
import shutil

import pytest

from benchmarks import plots

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "benchmarks" / "index.md"
PNG = b"\x89PNG\r\n\x1a\n"
_IMAGE = re.compile(r"!\[[^\]\n]*\]\(([^)\s]+)\)")


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> pathlib.Path:
    """A results folder holding only the JSON files that SOURCES names."""
    folder = tmp_path_factory.mktemp("results")
    for name in sorted({n for names in plots.SOURCES.values() for n in names}):
        shutil.copy(plots.RESULTS / name, folder / name)
    return folder


def test_plots_regenerate_from_the_cited_json(sources, tmp_path):
    written = plots.write_plots(tmp_path / "plots", results=sources)
    assert sorted(p.name for p in written) == sorted(f"{name}.png" for name in plots.PLOTTERS)
    for path in written:
        data = path.read_bytes()
        assert data.startswith(PNG) and len(data) > 10_000, path.name
    committed = sorted(p.name for p in plots.PLOTS.glob("*"))
    assert committed == sorted(p.name for p in written), (
        "docs/results/plots/ differs from what benchmarks/plots.py writes: run "
        "`python benchmarks/plots.py` and commit the PNGs")


def test_the_page_shows_the_tables_the_json_gives(sources):
    page = PAGE.read_text()
    for name, table in plots.tables(sources).items():
        block = f"<!-- {name}: benchmarks/plots.py --tables -->\n{table}\n"
        assert block in page, (
            f"docs/benchmarks/index.md's {name} table is not what `python benchmarks/plots.py "
            f"--tables` prints from the JSON; paste it again")


def test_the_page_embeds_every_plot_and_links_its_json():
    page = PAGE.read_text()
    embedded = {(PAGE.parent / t).resolve() for t in _IMAGE.findall(page)}
    for png in plots.PLOTS.glob("*.png"):
        assert png.resolve() in embedded, f"docs/benchmarks/index.md does not show {png.name}"
    linked = {(PAGE.parent / t.split("#")[0]).resolve()
              for t in re.findall(r"\]\(([^)\s]+)\)", page)}
    for name in {n for names in plots.SOURCES.values() for n in names}:
        assert (plots.RESULTS / name).resolve() in linked, (
            f"docs/benchmarks/index.md draws from {name} without linking it")


def test_every_embedded_image_exists():
    missing = []
    for page in sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md"]:
        for target in _IMAGE.findall(page.read_text()):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):
                continue
            if not (page.parent / target.split("#")[0]).resolve().is_file():
                missing.append(f"{page.relative_to(ROOT)}: {target}")
    assert not missing, "images that are not there:\n" + "\n".join(missing)
