"""The documentation site as a reader's browser shows it.

The site is built (``mkdocs build --strict``) into a temporary folder, served on
127.0.0.1, and the getting-started and benchmarks pages are opened in headless Chromium
through Playwright (Debian's ``chromium``, which scripts/install-system-deps.sh installs:
``playwright install`` is never run). On each page:

* the navigation renders: the sidebar links to every page of mkdocs.yml's nav and marks
  this one;
* code blocks render: one highlighted, non-empty block per fenced block of the page's
  Markdown (an unclosed fence fails, and so does a ``````` left in the prose), and the
  theme's script has added a copy button to each; tables and images as in the Markdown;
* every ``<img>`` has loaded (``naturalWidth > 0``);
* no console error, no script error, no failed request, no HTTP error, and no request
  leaves the site.

Two small pages made here show the checker passing a clean page and catching a missing
image, a console error and a request to another site. The tests skip only when no Chromium
executable is found (``CGX_CHROMIUM`` names one explicitly).
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import os
import pathlib
import re
import shutil
import struct
import subprocess
import sys
import threading
import zlib

import pytest
import yaml

pytestmark = pytest.mark.browser

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = ["getting-started.md", "benchmarks/index.md"]
EXECUTABLES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def _executable() -> str | None:
    named = os.environ.get("CGX_CHROMIUM")
    if named:
        return named if os.access(named, os.X_OK) else None
    return next((p for p in map(shutil.which, EXECUTABLES) if p), None)


@pytest.fixture(scope="module")
def browser():
    exe = _executable()
    if exe is None:
        pytest.skip("no Chromium executable found (looked for CGX_CHROMIUM, then "
                    f"{', '.join(EXECUTABLES)} on PATH): scripts/install-system-deps.sh "
                    "installs Debian's chromium")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("the playwright package is missing: it is in the dev extra "
                    "(pip install -c requirements/pins.txt -e '.[dev]'; make test does)",
                    pytrace=False)
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=exe, headless=True)
        yield b
        b.close()


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@contextlib.contextmanager
def _serve(folder: pathlib.Path):
    """Serve ``folder`` on 127.0.0.1 (a free port) from a thread; yields the base URL."""
    httpd = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(_Quiet, directory=str(folder)))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(10)


_IMAGES = """() => Array.from(document.images).map(
    i => [i.currentSrc || i.src, i.complete, i.naturalWidth])"""


def visit(browser, url: str):
    """Open ``url``; return the page (still open) and what went wrong loading it."""
    origin = re.match(r"https?://[^/]+", url).group(0)
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    page = context.new_page()
    problems: list[str] = []

    def route(r):
        if r.request.url.startswith((origin + "/", "data:", "blob:")):
            r.continue_()
        else:
            problems.append(f"a request outside the site: {r.request.url}")
            r.abort()

    page.route("**/*", route)
    page.on("console", lambda m: m.type == "error" and problems.append(
        f"console error: {m.text} ({m.location.get('url', '')})"))
    page.on("pageerror", lambda e: problems.append(f"script error: {e}"))
    page.on("requestfailed", lambda r: problems.append(f"failed request: {r.url} ({r.failure})"))
    page.on("response", lambda r: r.status >= 400 and problems.append(
        f"HTTP {r.status}: {r.url}"))
    response = page.goto(url, wait_until="load")
    if response is None or not response.ok:
        problems.append(f"{url}: HTTP {response and response.status}")
    page.wait_for_load_state("networkidle")
    for src, complete, width in page.evaluate(_IMAGES):
        if not complete or width == 0:
            problems.append(f"an image that did not load: {src}")
    return page, problems


def _url(base: str, page: str) -> str:
    """Where mkdocs puts a page (directory URLs): a.md at a/, b/index.md at b/."""
    path = re.sub(r"(^|/)(index|README)\.md$", r"\1", page)
    return base + re.sub(r"\.md$", "/", path)


def _nav_urls(base: str) -> dict[str, str]:
    """{absolute URL: title} of every page in mkdocs.yml's nav."""
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    out: dict[str, str] = {}

    def walk(items):
        for item in items:
            title, target = (None, item) if isinstance(item, str) else next(iter(item.items()))
            if isinstance(target, list):
                walk(target)
                continue
            out[_url(base, target)] = title or ""

    walk(nav)
    return out


def _source(md: pathlib.Path) -> dict[str, int]:
    """What the Markdown holds: fence lines, tables, images (outside code blocks)."""
    fences = tables = images = 0
    inside = False
    for line in md.read_text().splitlines():
        if re.match(r"^\s*```", line):
            fences += 1
            inside = not inside
            continue
        if inside:
            continue
        tables += bool(re.match(r"^\|?\s*:?-{3,}:?\s*(\|\s*:?-{3,}:?\s*)*\|?\s*$", line))
        images += len(re.findall(r"!\[[^\]\n]*\]\([^)\s]+\)", re.sub(r"`[^`]*`", "", line)))
    return {"fences": fences, "tables": tables, "images": images}


_RENDERED = """() => {
  const article = document.querySelector('article');
  const blocks = Array.from(article.querySelectorAll('pre > code'));
  const prose = article.cloneNode(true);
  prose.querySelectorAll('pre, code').forEach(e => e.remove());
  return {
    blocks: blocks.length,
    empty: blocks.filter(c => !c.textContent.trim()).length,
    highlighted: article.querySelectorAll('div.highlight pre > code').length,
    copy: article.querySelectorAll(
      'pre button[data-md-type="copy"], pre button.md-clipboard').length,
    tables: article.querySelectorAll('table').length,
    images: article.querySelectorAll('img').length,
    backticks: prose.textContent.includes('```'),
  };
}"""

_NAV = """() => Array.from(document.querySelectorAll('nav.md-nav--primary a.md-nav__link'))
  .map(a => [a.href, a.textContent.trim(), a.classList.contains('md-nav__link--active'),
             a.getClientRects().length > 0])"""


def check_site_page(page, url: str, md: pathlib.Path, nav: dict[str, str]) -> list[str]:
    """The navigation and the content of one page of the site, against its Markdown."""
    problems: list[str] = []
    links = page.evaluate(_NAV)
    hrefs = {re.sub(r"#.*$", "", h) for h, *_ in links}
    missing = [u for u in nav if u not in hrefs]
    if missing:
        problems.append(f"the navigation lacks {len(missing)} of mkdocs.yml's "
                        f"{len(nav)} pages: {', '.join(missing[:5])}")
    if not any(shown for *_, shown in links):
        problems.append("no navigation link is visible")
    if not any(active and re.sub(r"#.*$", "", h) == url for h, _, active, _ in links):
        problems.append("the navigation does not mark this page")
    want, got = _source(md), page.evaluate(_RENDERED)
    if want["fences"] % 2:
        problems.append(f"{md.name} has {want['fences']} fence lines: one is not closed")
    elif got["blocks"] != want["fences"] // 2:
        problems.append(f"{got['blocks']} code blocks shown, {want['fences'] // 2} in {md.name}")
    if got["empty"] or got["highlighted"] != got["blocks"]:
        problems.append(f"of {got['blocks']} code blocks, {got['empty']} empty, "
                        f"{got['highlighted']} highlighted")
    if got["copy"] != got["blocks"]:
        problems.append(f"{got['copy']} copy buttons for {got['blocks']} code blocks "
                        "(the theme's script did not run?)")
    if got["backticks"]:
        problems.append("``` shown as text outside the code blocks")
    for what in ("tables", "images"):
        if got[what] != want[what]:
            problems.append(f"{got[what]} {what} shown, {want[what]} in {md.name}")
    return problems


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> pathlib.Path:
    mkdocs = shutil.which("mkdocs", path=str(pathlib.Path(sys.executable).parent))
    if mkdocs is None:
        pytest.fail("mkdocs is missing: it is in the docs extra (make test installs it)",
                    pytrace=False)
    out = tmp_path_factory.mktemp("site")
    env = {"PATH": str(pathlib.Path(sys.executable).parent) + ":/usr/bin:/bin",
           "NO_MKDOCS_2_WARNING": "1", "DISABLE_MKDOCS_2_WARNING": "true", "HOME": str(out)}
    proc = subprocess.run([mkdocs, "build", "--strict", "--site-dir", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, env=env)
    warnings = [line for line in proc.stderr.splitlines() if "WARNING" in line or "ERROR" in line]
    assert proc.returncode == 0, "mkdocs build --strict failed:\n" + "\n".join(
        warnings or [proc.stderr[-3000:]])
    return out


def test_the_site_renders_in_a_browser(browser, site):
    failures = []
    with _serve(site) as base:
        nav = _nav_urls(base)
        for name in PAGES:
            url = _url(base, name)
            page, problems = visit(browser, url)
            problems += check_site_page(page, url, DOCS / name, nav)
            page.context.close()
            failures += [f"{name}: {p}" for p in problems]
    assert not failures, "\n".join(failures)


def _png() -> bytes:
    """A 1 x 1 red PNG."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 1, 1, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\x00\xff\x00\x00")) + chunk(b"IEND", b""))


_HTML = """<!doctype html><html><head><meta charset="utf-8">
<link rel="icon" href="data:,"><title>t</title></head><body>{}</body></html>"""


def test_the_checker_passes_a_clean_page(browser, tmp_path):
    (tmp_path / "red.png").write_bytes(_png())
    (tmp_path / "index.html").write_text(_HTML.format('<p>fine</p><img src="red.png">'))
    with _serve(tmp_path) as base:
        page, problems = visit(browser, base)
        page.context.close()
    assert problems == []


def test_the_checker_catches_a_missing_image(browser, tmp_path):
    (tmp_path / "red.png").write_bytes(_png())
    (tmp_path / "index.html").write_text(_HTML.format(
        '<img src="red.png"><img src="missing.png">'
        '<img src="http://203.0.113.1/elsewhere.png">'
        '<script>console.error("something broke")</script>'))
    with _serve(tmp_path) as base:
        page, problems = visit(browser, base)
        page.context.close()
    text = "\n".join(problems)
    assert f"an image that did not load: {base}missing.png" in problems, text
    assert f"HTTP 404: {base}missing.png" in problems, text
    assert "a request outside the site: http://203.0.113.1/elsewhere.png" in problems, text
    assert any(p.startswith("console error: something broke") for p in problems), text
    assert not any("red.png" in p for p in problems), text
