"""Which stored results the documentation cites, and docs/results/README.md, their index.

    python scripts/results_index.py            # lists what no page cites, and broken links
    python scripts/results_index.py --write    # rewrites docs/results/README.md

A file under docs/results/ is cited when

* a page links to it or shows it (README.md, CONTRIBUTING.md, or a page of docs/ outside
  docs/results/), or a cited report (a ``.md`` under docs/results/) does; or
* it is ``X.json`` beside a cited report ``X.md``: the report's data (the benchmarks write
  both with ``--out docs/results/X``).

The index (docs/results/README.md) is not a citing page: it lists every file, one line
each, under the page that cites it. tests/test_results_index.py checks all of this.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys
from typing import Iterator, Optional

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
RESULTS = DOCS / "results"
INDEX = RESULTS / "README.md"

_FENCE = re.compile(r"^ *```")
_LINK = re.compile(r"(?<!`)(!?)\[([^\]\n]*)\]\(([^)\s]+)\)")


def links(page: pathlib.Path) -> Iterator[tuple[pathlib.Path, str, bool]]:
    """(resolved target, link text, is an image) of each relative link outside code."""
    inside = False
    for line in page.read_text().splitlines():
        if _FENCE.match(line):
            inside = not inside
            continue
        if inside:
            continue
        for bang, text, target in _LINK.findall(re.sub(r"`[^`]*`", "``", line)):
            if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue
            yield (page.parent / target.split("#", 1)[0]).resolve(), text, bool(bang)


def _nav_order() -> list[pathlib.Path]:
    """docs pages in mkdocs.yml's nav order (the nav's lines name them)."""
    nav = (ROOT / "mkdocs.yml").read_text().split("\nnav:", 1)[-1]
    return [(DOCS / m).resolve() for m in re.findall(r"([\w./-]+\.md)\s*$", nav, re.M)]


def citing_pages() -> list[pathlib.Path]:
    """The benchmarks pages, the other docs pages outside docs/results/ (in the nav's order
    first), README.md and CONTRIBUTING.md."""
    docs = [p.resolve() for p in sorted(DOCS.rglob("*.md")) if RESULTS not in p.parents]
    ordered = [p for p in _nav_order() if p in docs]
    ordered += [p for p in docs if p not in ordered]
    bench = (DOCS / "benchmarks").resolve()  # a result is listed under its benchmark first
    ordered = [p for p in ordered if bench in p.parents] + [p for p in ordered
                                                              if bench not in p.parents]
    pages = ordered + [ROOT / "README.md", ROOT / "CONTRIBUTING.md"]
    return [p.resolve() for p in pages if p.exists()]


def stored() -> list[pathlib.Path]:
    """Every file under docs/results/ but the index."""
    return sorted(p.resolve() for p in RESULTS.rglob("*") if p.is_file() and p != INDEX)


def citations() -> tuple[dict[pathlib.Path, tuple[pathlib.Path, str]], list[str]]:
    """{cited file: (the citing page it was first reached from, a description)} and the
    links into docs/results/ that point at no file ("page: target")."""
    results = RESULTS.resolve()
    cited: dict[pathlib.Path, tuple[pathlib.Path, str]] = {}
    broken: list[str] = []

    def visit(page: pathlib.Path, root: pathlib.Path) -> None:
        for target, text, image in links(page):
            if results not in target.parents or target == INDEX.resolve():
                continue
            if not target.is_file():
                broken.append(f"{page.relative_to(ROOT)}: {target.relative_to(ROOT)}")
                continue
            if target in cited:
                continue
            cited[target] = (root, text if image else "")
            if target.suffix == ".md":
                data = target.with_suffix(".json")
                if data.is_file() and data not in cited:
                    cited[data] = (root, f"data of {target.name}")
                visit(target, root)

    for page in citing_pages():
        visit(page, page)
    return cited, broken


def uncited() -> list[pathlib.Path]:
    cited, _ = citations()
    return [p for p in stored() if p not in cited]


def _short(text: str, n: int = 110) -> str:
    """``text`` without its links (the index links each file once), cut to about n characters
    outside a code span."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)
    if len(text) <= n:
        return text
    cut = text[:n].rsplit(" ", 1)[0]
    if cut.count("`") % 2:
        cut = cut[:cut.rindex("`")].rstrip()
    return cut + " ..."


def _describe(path: pathlib.Path, text: str) -> str:
    """A line for the index: an image's alt text, a report's title, or what it says first."""
    if path.suffix == ".json":
        report = path.with_suffix(".md")
        return f"data of {report.name}" if report.is_file() else "data"
    if text:
        return text
    if path.suffix != ".md":
        return "plot" if path.suffix == ".png" else path.suffix.lstrip(".")
    page = path.read_text()
    lines = [line.strip() for line in page.splitlines()[:8] if line.strip()]
    for line in lines[:3]:
        if line.startswith(("# ", "## ")):
            return line.lstrip("#").strip()
    # benchmarks/train.py's reports: a section per setting and seed
    settings, seeds = [], []
    heads = re.findall(r"^### (.+)$", page, re.M)
    if any(re.search(r", seed \d+$", h) for h in heads):  # the settings, not the summaries
        heads = [h for h in heads if re.search(r", seed \d+$", h)]
    for h in heads:
        m = re.match(r"(.*), seed (\d+)$", h)
        name, seed = (m.group(1), m.group(2)) if m else (h, None)
        settings += [name] if name not in settings else []
        seeds += [seed] if seed is not None and seed not in seeds else []
    if settings:
        return _short("; ".join(settings) + (f" (seed{'s' * (len(seeds) > 1)} "
                                                f"{', '.join(seeds)})" if seeds else ""))
    # a report starts with its command; the line after it says what was run
    prose = [line for line in lines if not line.startswith(("Command", "`", "|"))]
    if prose:
        return _short(prose[0])
    for line in lines:
        m = re.search(r"`([^`]+)`", line)
        if m:
            cmd = m.group(1)
            return f"`{cmd}`" if len(cmd) <= 90 else f"`{cmd[:90].rsplit(' ', 1)[0]} ...`"
    if lines and lines[0].startswith("|"):  # a table alone: its columns
        return "table: " + _short(", ".join(c.strip() for c in lines[0].strip("|").split("|")))
    return path.name


def _title(page: pathlib.Path) -> str:
    for line in page.read_text().splitlines():
        if line.startswith("# "):
            return line[2:].strip()
    return page.name


def render() -> str:
    cited, _ = citations()
    lines = [
        "# Benchmark results",
        "",
        "The stored results, grouped by the page that cites them, one line each (a report, the",
        "JSON it was written with, the plots it shows). Every figure on those pages gives the",
        "command that produced it and the machine; [benchmarks](../benchmarks/index.md) shows",
        "the current ones as tables and plots. A result that no page cites leaves this folder",
        "(git history keeps it); `python scripts/results_index.py --write` rewrites this list",
        "and tests/test_results_index.py checks it.",
    ]
    for page in citing_pages():
        files = sorted((p for p, (root, _) in cited.items() if root == page),
                       key=lambda p: (p.with_suffix(""), p.suffix != ".md", p.name))
        if not files:
            continue
        rel = page.relative_to(ROOT)
        title = _title(page)
        if DOCS in page.parents:
            target = pathlib.Path("..") / page.relative_to(DOCS)
            lines += ["", f"## [{title}]({target.as_posix()})", ""]
        else:
            lines += ["", f"## {rel} (outside the site)", ""]
        for p in files:
            name = p.relative_to(RESULTS.resolve()).as_posix()
            lines.append(f"* [{name}]({name}): {_describe(p, cited[p][1])}")
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", action="store_true", help="rewrite docs/results/README.md")
    args = ap.parse_args(argv)
    _, broken = citations()
    for p in uncited():
        print(f"cited by no page: {p.relative_to(ROOT)}")
    for b in broken:
        print(f"links to a missing result: {b}")
    if args.write:
        INDEX.write_text(render())
        print(f"wrote {INDEX.relative_to(ROOT)}")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
