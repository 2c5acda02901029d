"""Shared by the lab-check and grader tests (tests/ is on sys.path under pytest's default import mode)."""
import functools
import re
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest

from utils.labchecks.harness import LabCheckFailure
from utils.tools import release

ROOT = Path(__file__).resolve().parents[1]
LABS = ROOT / "labs"


def fails(match, check, *args, **kwargs):
    """Run a check that must fail; return its message (and assert it matches the regex `match`)."""
    with pytest.raises(LabCheckFailure) as info:
        check(*args, **kwargs)
    message = str(info.value)
    assert re.search(match, message, re.S), message
    return message


def stubbed(source: str) -> str:
    """A solution cell as the released copy has it: every solution region replaced by a NotImplementedError."""
    return release.replace_regions(source, release.SOLUTION, "raise NotImplementedError()")


def lab_class(lab: str, class_name: str, student: bool = False):
    """`class_name` from a lab's import cell + its one solution cell (what a student pastes into a .py file).

    student=True stubs every solution region, as the released copy does.
    """
    nb = nbformat.read(str(LABS / f"{lab}.ipynb"), as_version=4)
    module = lab.split("_")[0]
    imports = [c for c in nb.cells if c.cell_type == "code" and f"from utils.labchecks import {module}" in c.source]
    solutions = [c for c in nb.cells if c.metadata.get("nbgrader", {}).get("solution")]
    assert len(imports) == 1 and len(solutions) == 1, f"{lab} has one import cell and one solution cell"
    source = stubbed(solutions[0].source) if student else solutions[0].source
    namespace = {"__name__": f"{module}_student" if student else f"{module}_reference"}
    exec(compile(imports[0].source + "\n" + source, f"<{module}>", "exec"), namespace)
    return namespace[class_name]


@functools.lru_cache(maxsize=1)
def sandbox_arguments() -> tuple:
    """[] where the grader's sandbox can start (or COURSE_REQUIRE_SANDBOX=1 demands it, as CI does), else
    ["--no-sandbox"]: the grader's tests then exercise its unsandboxed mode (tests/test_grade_sandbox.py skips)."""
    import os

    from utils.tools.grade import sandbox

    if os.environ.get("COURSE_REQUIRE_SANDBOX") == "1":
        return ()
    try:
        sandbox.Sandbox().close()
        return ()
    except sandbox.SandboxUnavailable:
        return ("--no-sandbox",)


def run_grader(args, timeout):
    """`python -m utils.tools.grade ARGS` as `make grade` runs it (in the sandbox where one can start); returns
    (seconds, output)."""
    start = time.monotonic()
    args = [*args, *sandbox_arguments()]
    done = subprocess.run([sys.executable, "-m", "utils.tools.grade", *map(str, args)], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout + done.stderr
    return time.monotonic() - start, done.stdout + done.stderr
