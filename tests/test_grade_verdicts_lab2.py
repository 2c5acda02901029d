"""Lab 2's verdicts (utils/tools/grade/verdicts/lab2_ddp.py) through the checker.

Fair and firm, shown by grading each submission three times and getting the same points (the cases' shapes are
seeded by the submission, so every grading meets the same ones; the values are fresh each time): every part the
first time, then the part judged on timing, overlap, twice more (the other parts' verdicts do not depend on timing): the lab's reference earns every part, and so does a correct wrapper of another structure
(tests/fixtures/lab2_submissions.py: buckets planned in reverse definition order, ReduceOp.AVG, futures); the
reference with a `work.wait()` right after its asynchronous all-reduce in the hook, and the reference averaging
each bucket with a blocking send/recv ring in the hook, lose the overlap part only. A wrapper that sums the
gradients instead of averaging them keeps construction only, and one that launches every bucket in
finish_gradient_synchronization() (no overlap) keeps everything but overlap.
"""
import shutil
import tempfile
from pathlib import Path

import pytest

from utils.tools import grade
from utils.tools.grade import checker
from utils.tools.grade.verdicts import module_path
from utils.tools.release import read_notebook

ROOT = Path(__file__).resolve().parents[1]
PARTS = ["construction", "training", "overlap", "accumulation"]
AVERAGE = "torch.cat([g.flatten() for g in grads]).div_(self.world_size)"
LAUNCH_EARLY = "if self.filled_bytes >= self.cap_bytes or self.ready == len(self.params):"
ISSUE = "work = dist.all_reduce(flat, async_op=True)"
SUBMISSIONS = ROOT / "tests" / "fixtures" / "lab2_submissions.py"
GRADINGS = 3


def lab_cells(replace=None, source=None, prepend=""):
    """The lab's cells as the grader prepares them, the solution cell edited by `replace` = (old, new), or
    replaced by `source`; `prepend` goes before it."""
    with tempfile.TemporaryDirectory() as folder:   # this lab alone (another lab may lack its verdicts yet)
        shutil.copy(ROOT / "labs" / "lab2_ddp.ipynb", folder)
        lab = grade.load_labs(folder)["lab2_ddp"]
        nb = read_notebook(lab.path)
        if replace is not None:
            cell = next(c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade_id") == "ddp_bucketed_code")
            assert replace[0] in cell.source, "the reference solution changed: update this test"
            cell.source = cell.source.replace(*replace)
        if source is not None or prepend:
            cell = next(c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade_id") == "ddp_bucketed_code")
            cell.source = prepend + (cell.source if source is None else source)
        return grade.prepare(nb, lab).cells, dict(lab.parts)


def judge(prepared, parts=PARTS):
    cells, _ = prepared
    job = {"verdicts": str(module_path("lab2_ddp")), "task_timeout": 60, "parts": parts, "cells": cells}
    return checker.check(job)["parts"]


def _ring():
    """The fixture's blocking ring, as source a solution cell can hold."""
    source = SUBMISSIONS.read_text()
    return source[source.index("class Done:"):] + "\n\n"


SUBMITTED = {
    "reference": dict(),
    "another structure": dict(source=SUBMISSIONS.read_text()),
    "waits in the hook": dict(replace=(ISSUE, ISSUE + "\n        work.wait()   # right here: backward waits")),
    "blocking ring in the hook": dict(replace=(ISSUE, "work = ring_all_reduce_blocking(flat)"), prepend=_ring()),
}
LOSES = {"reference": set(), "another structure": set(), "waits in the hook": {"overlap"},
         "blocking ring in the hook": {"overlap"}}


@pytest.mark.parametrize("name", SUBMITTED)
def test_the_same_submission_gets_the_same_points_on_every_grading(name):
    prepared = lab_cells(**SUBMITTED[name])
    points = dict(prepared[1])
    scores = []
    for grading in range(GRADINGS):
        graded = PARTS if grading == 0 else ["overlap"]
        parts = judge(prepared, graded)
        scores.append({p: points[p] if parts[p]["passed"] else 0 for p in graded})
        print(f"{name}: {scores[-1]} = {sum(scores[-1].values())} of {sum(points[p] for p in graded)}")
        for part in LOSES[name]:
            message = parts[part]["message"]
            assert "were still in flight when a later gradient became ready" in message, message
            assert ("waited for before the next gradient was ready" if "waits" in name else "blocking") in message
    want = {p: 0 if p in LOSES[name] else points[p] for p in PARTS}
    assert scores == [want] + [{"overlap": want["overlap"]}] * (GRADINGS - 1), scores


@pytest.mark.parametrize("replace, passing, says", [
    ((AVERAGE, "torch.cat([g.flatten() for g in grads])"), {"construction"},
     ("training", "the SUM over the 2 ranks, not the average")),
    ((LAUNCH_EARLY, "if False:  # every bucket waits for finish_gradient_synchronization()"),
     {"construction", "training", "accumulation"},
     ("overlap", "were still in flight when a later gradient became ready; at least 50% must")),
])
def test_wrong_wrappers_lose_the_parts_they_break(replace, passing, says):
    parts = judge(lab_cells(replace))
    assert {p for p in PARTS if parts[p]["passed"]} == passing, parts
    part, text = says
    assert text in parts[part]["message"] and "DDPBucketed at N=2" in parts[part]["message"], parts[part]


def test_each_rank_gets_its_own_inputs_and_no_seed():
    import random
    import torch
    from utils.tools.grade.verdicts import lab2_ddp as verdicts
    case = verdicts._training_cases(3, random.Random(0))[0]
    assert "seed" not in case.params
    assert len(case.inputs) == 3
    xs = [inputs[1] for inputs in case.inputs]          # [state, x, y] per rank
    assert not torch.equal(xs[0], xs[1]) and not torch.equal(case.inputs[0][0], case.inputs[1][0])
    assert sum(x.shape[1] for x in xs) == case.params["batch"]   # the ranks' shards, together the batch
