"""Fixtures shared by the browser tests (tests/test_browser.py: JupyterLab; tests/test_book.py: the website)."""
import os

import pytest

from browser import INSTALL_HINT, find_browser


@pytest.fixture(scope="module")
def browser():
    """A headless Chromium from this machine, or a skip (a failure with COURSE_REQUIRE_BROWSER=1)."""
    def unavailable(why):
        if os.environ.get("COURSE_REQUIRE_BROWSER") == "1":
            pytest.fail(f"browser test required (COURSE_REQUIRE_BROWSER=1) but {why}; {INSTALL_HINT}")
        pytest.skip(f"browser test skipped: {why}; to run it, {INSTALL_HINT}")

    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        unavailable("the playwright package is missing (make install adds it)")
    executable = find_browser()
    if executable is None:
        unavailable("no Chromium or Chrome found")
    args = ["--disable-dev-shm-usage", "--disable-gpu"] + (["--no-sandbox"] if os.geteuid() == 0 else [])
    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=executable, headless=True, args=args)
        try:
            yield chromium
        finally:
            chromium.close()
