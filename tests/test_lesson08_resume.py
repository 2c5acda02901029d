"""Lesson 08's bitwise-resume check can fail: it passes with the whole state restored and fails when one item is left out.

The lesson's own cells (parameters, imports, the sampler, train_run and compare_runs) are run here as they are
stored, so the test checks the code the student reads, not a copy.
"""
import json
import tempfile
from pathlib import Path

import pytest

import utils
from utils.checks import check

LESSON = Path(__file__).resolve().parents[1] / "lessons" / "08_checkpoints_and_failures.ipynb"
CELL_STARTS = ("# Parameters", "import contextlib", "class ResumableSampler", "STATE_ITEMS")


@pytest.fixture(scope="module")
def lesson():
    cells = [c for c in json.loads(LESSON.read_text())["cells"] if c["cell_type"] == "code"]
    namespace = {"__name__": "lesson08"}
    for start in CELL_STARTS:
        found = [c for c in cells if "".join(c["source"]).startswith(start)]
        assert len(found) == 1, f"lesson 08 has one code cell starting {start!r}"
        exec(compile("".join(found[0]["source"]), f"<lesson 08: {start}>", "exec"), namespace)
    namespace.update(steps=6, save_at=3)          # shorter than the lesson's run, still across an epoch boundary
    return namespace


def bitwise_claim(lesson, folder, leave_out=(), derive=None):
    straight = utils.launch(lesson["train_run"], 6, folder, world_size=4)
    utils.launch(lesson["train_run"], 3, folder, save_at=3, world_size=4)
    resumed = utils.launch(lesson["train_run"], 6, folder, resume=True, leave_out=leave_out, derive=derive,
                           world_size=4)
    part, diff = lesson["compare_runs"](straight, resumed, 4)
    check(part is None, "resumed run bitwise equal to the straight one", f"they part at step {part} by {diff:.3g}")


def test_full_state_resumes_bitwise(lesson):
    with tempfile.TemporaryDirectory() as folder:
        bitwise_claim(lesson, folder)


@pytest.mark.parametrize("item", ["rng", "sampler", "optimizer"])
def test_check_fails_when_an_item_is_left_out(lesson, item):
    with tempfile.TemporaryDirectory() as folder:
        with pytest.raises(AssertionError, match="part at step 4"):
            bitwise_claim(lesson, folder, leave_out=(item,))


def test_state_derived_from_the_step_resumes_bitwise_and_the_check_can_fail(lesson):
    """Section 1 sets the sampler and the schedule from the step instead of loading them: the lesson's derivation
    resumes bitwise, and one that is a step off parts at the first resumed step."""
    cell = next(c for c in json.loads(LESSON.read_text())["cells"]
                if "".join(c["source"]).startswith("def sampler_state_after"))
    exec("".join(cell["source"]).split("\nearly = ")[0], lesson)            # its definitions, not its runs
    right = lesson["from_the_step"]
    with tempfile.TemporaryDirectory() as folder:
        bitwise_claim(lesson, folder, leave_out=("sampler", "schedule"), derive=right)
    with tempfile.TemporaryDirectory() as folder:
        with pytest.raises(AssertionError, match="part at step 4"):
            bitwise_claim(lesson, folder, leave_out=("sampler", "schedule"),
                          derive=lambda sampler, schedule, step: right(sampler, schedule, step + 1))
