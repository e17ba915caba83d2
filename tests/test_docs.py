"""The documentation: README's length, the strict site build, links and code blocks.

* README.md has at most 200 lines (it is also the package's long description).
* ``mkdocs build --strict`` succeeds (a broken link or nav entry fails it).
* Every relative link in README.md, CONTRIBUTING.md and docs/ (docs/results/ aside: those
  are stored benchmark reports) points to an existing file, or to the page that
  docs/gen_config.py generates during the build.
* Every fenced ```python block there compiles, and is exactly one of:

  - preceded by the line ``<!-- runs -->``: it runs in a fresh process and must exit 0;
  - preceded by the line ``<!-- runs on 2 ranks -->``: it runs on 2 ranks under cgxrun
    (``python -m cgx.launch.cli -np 2``) and must exit 0 (a block that appears on several
    pages, as the README's quick starts do in the guides, runs once);
  - not runnable (a fragment, a cluster launch, a GPU or a downloaded model needed): its
    first line says so where the reader sees it, ``# not run: <reason>``.
* Every shell block (set-up, benchmark and GPU command lines) starts with
  ``# not run: <reason>``, and the scripts and modules it names exist.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
RUNS = "<!-- runs -->"
RUNS_2 = "<!-- runs on 2 ranks -->"
NOT_RUN = "# not run:"


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
    """(first line number, language, source, the non-blank line before it) of each block."""
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
        yield i + 1, lang, "\n".join(body) + "\n", prev
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
    """(page, first line, source, marker line) of every ```python block."""
    for page in _pages():
        for line, lang, src, prev in _blocks(page):
            if lang in ("python", "py"):
                yield page, line, src, prev


def _kinds(src: str, prev: str) -> list[str]:
    """What a block says it is: run here, run on 2 ranks, not run (the reason given)."""
    first = src.lstrip("\n").split("\n", 1)[0].strip()
    kinds = [k for k, marked in (("runs", prev == RUNS), ("runs on 2 ranks", prev == RUNS_2),
                                 ("not run", first.startswith(NOT_RUN))) if marked]
    if "not run" in kinds and not first[len(NOT_RUN):].strip():
        kinds.append("no reason")
    return kinds


def _marked(marker: str):
    """Blocks marked ``marker``; a block shown on several pages once, under its first."""
    seen: dict[str, list] = {}
    for page, line, src, prev in _python_blocks():
        if prev == marker:
            seen.setdefault(src, []).append(f"{_name(page)}:{line}")
    return [pytest.param(src, places, id=places[0]) for src, places in seen.items()]


@pytest.mark.parametrize("page,line,src", [
    pytest.param(page, line, src, id=f"{_name(page)}:{line}")
    for page, line, src, _ in _python_blocks()])
def test_python_blocks_compile(page, line, src):
    # a SyntaxError names the page and the block's first line
    compile(src, f"{_name(page)}:{line}", "exec")


def test_every_python_block_runs_or_says_why_not():
    wrong = []
    for page, line, src, prev in _python_blocks():
        kinds = _kinds(src, prev)
        if kinds != ["runs"] and kinds != ["runs on 2 ranks"] and kinds != ["not run"]:
            wrong.append(f"{_name(page)}:{line}: {' + '.join(kinds) or 'unmarked'}")
    for page in _pages():  # a marker before another language's block would be ignored
        for line, lang, _, prev in _blocks(page):
            if prev in (RUNS, RUNS_2) and lang not in ("python", "py"):
                wrong.append(f"{_name(page)}:{line}: {prev} before a {lang or 'plain'} block")
    assert not wrong, (
        f"each ```python block is preceded by {RUNS!r} (runs here) or {RUNS_2!r} (runs "
        f"under cgxrun -np 2), or starts with '{NOT_RUN} <reason>', exactly one of them:\n"
        + "\n".join(wrong))


def _shell_blocks():
    """(page, first line, source) of every shell block (```bash, sh, shell, console)."""
    for page in _pages():
        for line, lang, src, _ in _blocks(page):
            if lang in ("bash", "sh", "shell", "console"):
                yield page, line, src


def test_every_shell_block_says_why_it_is_not_run():
    # the shell blocks are set-up, benchmark and GPU command lines: each says so visibly
    wrong = [f"{_name(page)}:{line}" for page, line, src in _shell_blocks()
             if _kinds(src, "") != ["not run"]]
    assert not wrong, (f"each shell block starts with '{NOT_RUN} <reason>' (the commands "
                       "there run in benchmarks, not in the tests):\n" + "\n".join(wrong))


def test_shell_blocks_name_scripts_and_modules_that_exist():
    missing = []
    for page, line, src in _shell_blocks():
        for path in re.findall(r"\b((?:benchmarks|scripts|examples)/[\w/.-]+\.(?:py|sh))", src):
            if not (ROOT / path).exists():
                missing.append(f"{_name(page)}:{line}: {path}")
        for module in re.findall(r"python3? -m ([\w.]+)", src):
            if importlib.util.find_spec(module.split(".")[0]) is None or (
                    module.startswith(("cgx", "benchmarks")) and not _module_exists(module)):
                missing.append(f"{_name(page)}:{line}: -m {module}")
    assert not missing, "shell blocks name what does not exist:\n" + "\n".join(missing)


def _module_exists(module: str) -> bool:
    path = ROOT / module.replace(".", "/")
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


@pytest.mark.multiproc
def test_runnable_blocks_run(tmp_path):
    marked = [(p, line, src) for p, line, src, prev in _python_blocks() if prev == RUNS]
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


def test_some_blocks_run_on_2_ranks():
    assert _marked(RUNS_2), f"no block is marked {RUNS_2!r}"


@pytest.mark.multiproc
@pytest.mark.parametrize("src,places", _marked(RUNS_2))
def test_two_rank_blocks_run_under_cgxrun(tmp_path, src, places):
    if re.search(r"^import (keras|tensorflow)", src, re.M) and \
            importlib.util.find_spec("tensorflow") is None:
        pytest.skip("TensorFlow is not installed (the `tensorflow` extra)")
    script = tmp_path / "train.py"
    script.write_text(src)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    # a session of its own: on a timeout, cgxrun and its ranks are stopped together
    proc = subprocess.Popen(
        [sys.executable, "-m", "cgx.launch.cli", "-np", "2", sys.executable, str(script)],
        cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{', '.join(places)}: cgxrun -np 2 ran past 300 s:\n{out[-3000:]}")
    assert proc.returncode == 0, (f"{', '.join(places)}: cgxrun -np 2 exited {proc.returncode}:"
                                  f"\n{out[-2000:]}\n{err[-3000:]}")


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
