"""The course website (`make book`, utils/tools/book.py), read in a headless Chromium as a reader would.

The site is built once from the stored notebooks into build/book-test and served on 127.0.0.1. For every page:
no console error, every image loaded, every internal link resolves (its file and its #anchor), the headings are
the notebook's, and no request leaves 127.0.0.1. Search finds a term of lesson 06 and opens that page. No page
or file holds a line of a reference solution or hidden test (tests/leakcheck.py). A screenshot of a lesson
page goes to build/book-test-shots/. Skipped without Chromium, like tests/test_browser.py.
"""
import functools
import http.server
import json
import os
import re
import shutil
import threading
import urllib.parse
from html.parser import HTMLParser
from pathlib import Path

import pytest
from markdown_it import MarkdownIt

from leakcheck import find_leaks, texts
from utils.tools import book

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "build" / "book-test"
SHOTS = ROOT / "build" / "book-test-shots"
STUDENT_REPO, BRANCH = "https://github.com/acme/dp-student", "fall26"
SEARCH_TERM, SEARCH_PAGE = "Adafactor", "lessons/06_zero.html"   # a word only lesson 06 uses


@pytest.fixture(scope="module")
def site():
    if shutil.which("npm") is None and not (OUT.parent / ".cache" / f"mathjax-{book.MATHJAX_VERSION}").is_dir():
        why = "the site bundles MathJax from npm, and npm is missing (Debian: apt-get install npm)"
        if os.environ.get("COURSE_REQUIRE_BROWSER") == "1":
            pytest.fail(f"website test required (COURSE_REQUIRE_BROWSER=1) but {why}")
        pytest.skip(f"website test skipped: {why}")
    seconds = book.build(OUT, STUDENT_REPO, BRANCH)
    print(f"built in {seconds:.0f} s, {book.site_bytes(OUT) / 1e6:.1f} MB")
    return OUT


@pytest.fixture(scope="module")
def server(site):
    handler = functools.partial(_QuietHandler, directory=str(site))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def pages(site):
    """Every page a reader reaches from the table of contents (the notebooks and the guides)."""
    names = ["index.html", "README.html", "INSTRUCTORS.html"]
    names += sorted(p.relative_to(site).as_posix() for p in site.glob("l*/*.html"))
    return names


def notebook_headings(path: Path) -> list:
    """The text of every markdown heading of a notebook, as a browser shows it."""
    md, found = MarkdownIt("commonmark"), []
    for cell in json.loads(path.read_text())["cells"]:
        if cell["cell_type"] != "markdown":
            continue
        tokens = md.parse("".join(cell["source"]))
        for opening, inline in zip(tokens, tokens[1:]):
            if opening.type == "heading_open":
                found.append(_plain("".join(t.content for t in inline.children if t.type in ("text", "code_inline"))))
    return found


def _plain(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


class _Anchors(HTMLParser):
    """The ids a page defines and the links it holds."""

    def __init__(self):
        super().__init__()
        self.ids, self.links = set(), []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if "id" in attrs:
            self.ids.add(attrs["id"])
        if tag == "a" and attrs.get("href"):
            self.links.append(attrs["href"])


@functools.lru_cache(maxsize=None)   # a lesson page is megabytes (its figures inline) and the target of many links
def _anchors(path: Path) -> _Anchors:
    parsed = _Anchors()
    parsed.feed(path.read_text())
    return parsed


def test_every_page_loads_offline_with_its_images_and_without_errors(site, server, browser):
    SHOTS.mkdir(parents=True, exist_ok=True)
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    problems = []
    for name in pages(site):
        page = context.new_page()
        errors, outside = [], []
        page.on("console", lambda m, errors=errors: m.type == "error" and errors.append(m.text))
        page.on("pageerror", lambda e, errors=errors: errors.append(str(e)))
        page.on("request", lambda r, outside=outside: not r.url.startswith((server, "data:", "blob:"))
                and outside.append(r.url))
        page.goto(f"{server}/{name}", wait_until="networkidle")
        if 'class="math notranslate' in (site / name).read_text():   # MathJax loads asynchronously: a busy
            try:                                                       # machine may still be loading it here
                page.wait_for_function("() => window.MathJax && MathJax.startup && MathJax.startup.promise",
                                       timeout=30_000)
            except Exception:  # noqa: BLE001 — reported below as math not rendered
                pass
        typeset = page.evaluate("() => window.MathJax && MathJax.startup && MathJax.startup.promise ? "
                                "MathJax.startup.promise.then(() => document.querySelectorAll('mjx-container').length)"
                                " : -1")
        if 'class="math notranslate' in (site / name).read_text() and not typeset > 0:
            problems.append(f"{name}: its math was not rendered (MathJax typeset {typeset} formulas)")
        page.wait_for_load_state("networkidle")
        broken = page.evaluate("() => [...document.images].filter(i => !i.complete || i.naturalWidth === 0)"
                               ".map(i => i.getAttribute('src'))")
        headings = page.evaluate("() => [...document.querySelectorAll('article h1, article h2, article h3, "
                                 "article h4, article h5, article h6')].map(h => h.innerText.replace(/#$/, ''))")
        if name.startswith("l"):
            expected = notebook_headings(site.parent / f"{site.name}-src" / name.replace(".html", ".ipynb"))
            if [_plain(h) for h in headings] != expected:
                problems.append(f"{name}: headings {[_plain(h) for h in headings]} != notebook's {expected}")
        if name == "lessons/04_bucketing_and_overlap.html":
            page.screenshot(path=str(SHOTS / "lesson04.png"))
        problems += [f"{name}: console error {e}" for e in errors]
        problems += [f"{name}: request to {u}" for u in outside]
        problems += [f"{name}: image {src} did not load" for src in broken]
        page.close()
    context.close()
    assert problems == []


def test_every_internal_link_resolves(site):
    broken = []
    for page in sorted(site.rglob("*.html")):
        for href in _anchors(page).links:
            parts = urllib.parse.urlsplit(href)
            if parts.scheme or parts.netloc or href.startswith(("mailto:", "javascript:")):
                continue
            target = page if not parts.path else (page.parent / urllib.parse.unquote(parts.path)).resolve()
            if target.is_dir():
                target = target / "index.html"
            if not target.is_file():
                broken.append(f"{page.relative_to(site)}: {href} (no such file)")
            elif parts.fragment and target.suffix == ".html" and parts.fragment not in _anchors(target).ids:
                broken.append(f"{page.relative_to(site)}: {href} (no such anchor)")
    assert broken == []


def test_pages_link_to_the_student_repository_and_to_their_neighbours(site):
    lesson = (site / "lessons" / "06_zero.html").read_text()
    assert re.search(r'<a class="left-prev"\s+href="05_stragglers.html"', lesson)
    assert re.search(r'<a class="right-next"\s+href="07_scaling.html"', lesson)
    assert f"colab.research.google.com/github/acme/dp-student/blob/{BRANCH}/lessons/06_zero.ipynb" in lesson
    assert f"raw.githubusercontent.com/acme/dp-student/{BRANCH}/lessons/06_zero.ipynb" in lesson
    assert 'href="../_sources/lessons/06_zero.ipynb"' in lesson
    served = json.loads((site / "_sources" / "labs" / "lab2_ddp.ipynb").read_text())
    assert "raise NotImplementedError" in "".join("".join(c["source"]) for c in served["cells"])


def test_search_finds_a_lesson_06_term_and_opens_its_page(site, server, browser):
    page = browser.new_page()
    page.goto(f"{server}/index.html", wait_until="networkidle")
    page.goto(f"{server}/search.html?q={SEARCH_TERM}", wait_until="networkidle")
    results = page.locator("#search-results ul.search li a").first
    results.wait_for(timeout=30_000)
    results.click()
    page.wait_for_load_state("networkidle")
    assert page.url.split("?")[0].split("#")[0].endswith(SEARCH_PAGE), page.url
    assert SEARCH_TERM in page.inner_text("article")
    page.close()


def test_widget_outputs_say_they_need_a_live_kernel_and_show_their_stored_state(site):
    widgets = [p for p in sorted(ROOT.glob("l*/*.ipynb")) if f'"{book.WIDGET_VIEW}"' in p.read_text()]
    assert widgets, "the course has widgets; none was found"
    for notebook in widgets:
        page = (site / notebook.relative_to(ROOT)).with_suffix(".html").read_text()
        assert page.count('class="widget-note"') == notebook.read_text().count(f'"{book.WIDGET_VIEW}"'), notebook.name
        assert 'class="widget-stored"' in page, notebook.name


def test_no_page_holds_a_reference_solution_or_hidden_test(site):
    assert find_leaks(texts(site, suffixes={".html", ".ipynb", ".txt", ".js", ".py"})) == []
