"""The documentation: README's length, the strict site build, links and code blocks.

* README.md has at most 200 lines (it is also the package's long description).
* ``mkdocs build --strict`` succeeds (a broken link or nav entry fails it).
* Every relative link in README.md, CONTRIBUTING.md and docs/ (docs/results/ aside: those
  are stored benchmark reports) points to an existing file, or to the page that
  docs/gen_config.py generates during the build.
* Every fenced ```python block there compiles; a block preceded by the line
  ``<!-- runs -->`` also runs, in a fresh process, and must exit 0. Multi-rank snippets
  say ``# launch with: ...`` in their first line and are compiled only.
"""

from __future__ import annotations

import pathlib
import re
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
RUNS = "<!-- runs -->"


def _generated() -> set[pathlib.Path]:
    """Pages that docs/gen_config.py (run by mkdocs-gen-files) writes at build time."""
    src = (DOCS / "gen_config.py").read_text()
    return {DOCS / m for m in re.findall(r'^PAGE = "([^"]+)"', src, re.M)}


def _pages() -> list[pathlib.Path]:
    pages = [ROOT / "README.md", ROOT / "CONTRIBUTING.md"]
    pages += sorted(p for p in DOCS.rglob("*.md") if DOCS / "results" not in p.parents)
    return [p for p in pages if p.exists()]


def _name(page: pathlib.Path) -> str:
    return str(page.relative_to(ROOT))


_FENCE = re.compile(r"^( *)```+ *([\w+-]*)")


def _blocks(page: pathlib.Path):
    """(first line number, language, source, marked runnable) of each fenced block."""
    lines = page.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, lang = len(m.group(1)), m.group(2)
        prev = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        body, j = [], i + 1
        while j < len(lines) and not re.match(r"^ *```+ *$", lines[j]):
            body.append(lines[j][indent:] if lines[j][:indent].isspace() else lines[j])
            j += 1
        yield i + 1, lang, "\n".join(body) + "\n", prev == RUNS
        i = j + 1


_LINK = re.compile(r"(?<!`)\[[^\]\n]*\]\(([^)\s]+)\)")


def _links(page: pathlib.Path):
    """Relative link targets outside code blocks and code spans: (line number, target)."""
    inside = False
    for n, line in enumerate(page.read_text().splitlines(), 1):
        if _FENCE.match(line):
            inside = not inside
            continue
        if inside:
            continue
        for m in _LINK.finditer(re.sub(r"`[^`]*`", "``", line)):
            yield n, m.group(1)


def test_readme_is_at_most_200_lines():
    n = len((ROOT / "README.md").read_text().splitlines())
    assert n <= 200, f"README.md has {n} lines; move detail into docs/ (at most 200)"


def test_relative_links_point_to_existing_files():
    broken, generated = [], _generated()
    assert generated, "docs/gen_config.py declares no PAGE"
    for page in _pages():
        for n, target in _links(page):
            if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue  # a URL, mailto:, or an anchor on the same page
            path = target.split("#", 1)[0]
            resolved = (page.parent / path).resolve()
            if not resolved.exists() and resolved not in generated:
                broken.append(f"{_name(page)}:{n}: {target}")
    assert not broken, "links to missing files:\n" + "\n".join(broken)


def _python_blocks():
    for page in _pages():
        for line, lang, src, runs in _blocks(page):
            if lang in ("python", "py"):
                yield pytest.param(page, line, src, runs, id=f"{_name(page)}:{line}")


@pytest.mark.parametrize("page,line,src,runs", list(_python_blocks()))
def test_python_blocks_compile(page, line, src, runs):
    # a SyntaxError names the page and the block's first line
    compile(src, f"{_name(page)}:{line}", "exec")


def test_runnable_blocks_run(tmp_path):
    marked = [(p, line, src) for p in _pages() for line, lang, src, runs in _blocks(p)
              if runs and lang in ("python", "py")]
    assert marked, f"no block is marked {RUNS!r}"
    failures = []
    for page, line, src in marked:
        script = tmp_path / "snippet.py"
        script.write_text(src)
        proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                              text=True, timeout=120)
        if proc.returncode:
            failures.append(f"{_name(page)}:{line} exited {proc.returncode}:\n{proc.stderr[-2000:]}")
    assert not failures, "\n\n".join(failures)


def test_mkdocs_build_strict(tmp_path):
    mkdocs = shutil.which("mkdocs", path=str(pathlib.Path(sys.executable).parent))
    if mkdocs is None:
        pytest.skip("mkdocs is not installed (the `docs` extra)")
    env = {"PATH": str(pathlib.Path(sys.executable).parent) + ":/usr/bin:/bin",
           "NO_MKDOCS_2_WARNING": "1", "DISABLE_MKDOCS_2_WARNING": "true",
           "HOME": str(tmp_path)}
    proc = subprocess.run([mkdocs, "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    warnings = [l for l in proc.stderr.splitlines() if "WARNING" in l or "ERROR" in l]
    assert proc.returncode == 0, "mkdocs build --strict failed:\n" + "\n".join(warnings or
                                                                              [proc.stderr[-3000:]])
    assert (tmp_path / "site" / "reference" / "config" / "index.html").exists()
