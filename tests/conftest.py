"""Fixtures shared by the browser tests (tests/test_browser.py: JupyterLab; tests/test_book.py: the website), and
the order in which make test's workers take the files."""
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


# The files that take longest (minutes each: they grade whole labs, drive a browser or run a lesson), first: make test's
# workers take a file at a time in collection order, and a long file taken last keeps one worker busy alone.
LONGEST_FIRST = ["tests/test_grade_labs.py", "tests/test_release_grade.py", "tests/test_grade_verdicts_lab2.py",
                 "tests/test_grade_verdicts_lab3.py", "tests/test_browser.py", "tests/test_grade_gradebook.py",
                 "tests/test_book.py", "lessons/09_communicating_less.ipynb", "lessons/04_bucketing_and_overlap.ipynb",
                 "lessons/02_four_replicas.ipynb", "lessons/07_scaling.ipynb", "lessons/05_stragglers.ipynb",
                 "lessons/03_allreduce_from_scratch.ipynb", "lessons/08_checkpoints_and_failures.ipynb",
                 "tests/test_cluster.py", "tests/test_grade_verdicts.py", "tests/test_colab_setup.py"]


def pytest_collection_modifyitems(session, config, items):
    rank = {path: index for index, path in enumerate(LONGEST_FIRST)}
    root = str(config.rootpath)
    def key(item):
        path = os.path.relpath(str(item.path), root)
        return rank.get(path, len(rank))
    items.sort(key=key)   # stable: each file's own items keep their order
