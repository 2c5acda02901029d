"""Lab 2's verdicts (utils/tools/grade/verdicts/lab2_ddp.py) through the checker.

Fair and firm, shown by grading each submission twice and getting the same points (the cases' shapes are seeded by
the submission, so every grading meets the same ones; the values are fresh each time; no part is judged on timing).
The two correct ones, the lab's reference and a wrapper of another structure (tests/fixtures/lab2_submissions.py:
buckets planned at construction in reverse definition order, ReduceOp.AVG, futures), earn every part. Each wrong
one is graded on the part it breaks, and loses it:
  - overlap: a work.wait() right after the asynchronous all-reduce in the hook; a blocking send/recv ring in the
    hook; a wait for the earlier bucket's handle before launching the next; a dist.barrier() after an
    asynchronous launch (each a stall, said as what it is); every bucket launched in
    finish_gradient_synchronization() (no stall, nothing in flight);
  - training: bucket_size_mb ignored, one all-reduce per gradient; bucket_size_mb ignored, one bucket; a sum
    instead of the average;
  - accumulation: gradients divided by the number of micro-batches too (off by exactly k, diagnosed).
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
GRADINGS = 2
CAP = "self.cap_bytes = bucket_size_mb * 2**20"


def lab_cells(replace=None, source=None, prepend="", more=()):
    """The lab's cells as the grader prepares them, the solution cell edited by `replace` = (old, new) and each
    of `more`, or replaced by `source`; `prepend` goes before it."""
    with tempfile.TemporaryDirectory() as folder:   # this lab alone (another lab may lack its verdicts yet)
        shutil.copy(ROOT / "labs" / "lab2_ddp.ipynb", folder)
        lab = grade.load_labs(folder)["lab2_ddp"]
        nb = read_notebook(lab.path)
        if replace is not None:
            cell = next(c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade_id") == "ddp_bucketed_code")
            for old, new in [replace, *more]:
                assert old in cell.source, f"the reference solution changed: update this test ({old})"
                cell.source = cell.source.replace(old, new)
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


SUBMITTED = {   # name: (how the solution cell is made, parts graded, parts lost, what a lost part's message says)
    "reference": (dict(), PARTS, set(), ""),
    "another structure": (dict(source=SUBMISSIONS.read_text()), PARTS, set(), ""),
    "waits in the hook": (dict(replace=(ISSUE, ISSUE + "\n        work.wait()   # right here: backward waits")),
                          ["overlap"], {"overlap"}, "(right after the call)"),
    "blocking ring in the hook": (dict(replace=(ISSUE, "work = ring_all_reduce_blocking(flat)"), prepend=_ring()),
                                  ["overlap"], {"overlap"}, "(it returns once its data has moved)"),
    "waits for the earlier bucket": (dict(replace=(ISSUE, "if self.in_flight:\n            self.in_flight[-1][0].wait()"
                                                          "   # the bucket before\n        " + ISSUE)),
                                     ["overlap"], {"overlap"}, "(an earlier bucket's)"),
    "barrier after the launch": (dict(replace=(ISSUE, ISSUE + "\n        dist.barrier()")), ["overlap"], {"overlap"},
                                 "a blocking dist.barrier()"),
    "launches after backward": (dict(replace=(LAUNCH_EARLY, "if False:  # every bucket waits for finish_gradient_"
                                                            "synchronization()")),
                                ["overlap"], {"overlap"}, "were still in flight when a later gradient became ready"),
    "one all-reduce per gradient": (dict(replace=(CAP, "self.cap_bytes = 0   # bucket_size_mb ignored")),
                                    ["training"], {"training"}, "must give one all-reduce; seen"),
    "one bucket": (dict(replace=(CAP, "self.cap_bytes = float('inf')   # bucket_size_mb ignored")), ["training"],
                   {"training"}, "must give one all-reduce per gradient"),
    "sums": (dict(replace=(AVERAGE, "torch.cat([g.flatten() for g in grads])")), ["training"], {"training"},
             "the SUM over the"),
    "divides by the micro-batches": (dict(replace=(AVERAGE, "torch.cat([g.flatten() for g in grads]).div_(self.world_"
                                                            "size * self.micro)"),
                                          more=[("        self.synchronizing = False\n        try:",
                                                 "        self.synchronizing = False\n        self.micro = getattr(self, "
                                                 "'micro', 1) + 1\n        try:"),
                                                ("        self.in_flight, self.ready = [], 0",
                                                 "        self.in_flight, self.ready, self.micro = [], 0, 1"),
                                                ("        self.synchronizing = True                  # False inside",
                                                 "        self.micro = 1\n        self.synchronizing = True  "
                                                 "                # False inside")]),
                                     ["accumulation"], {"accumulation"}, "the number of micro-batches per step"),
}


@pytest.mark.parametrize("name", SUBMITTED)
def test_the_same_submission_gets_the_same_points_on_every_grading(name):
    how, graded, loses, says = SUBMITTED[name]
    prepared = lab_cells(**how)
    points = dict(prepared[1])
    scores = []
    for _ in range(GRADINGS):
        parts = judge(prepared, graded)
        scores.append({p: points[p] if parts[p]["passed"] else 0 for p in graded})
        print(f"{name}: {scores[-1]} = {sum(scores[-1].values())} of {sum(points[p] for p in graded)}")
        for part in loses:
            assert says in parts[part]["message"] and "DDPBucketed at N=2" in parts[part]["message"], \
                parts[part]["message"]
    want = {p: 0 if p in loses else points[p] for p in graded}
    assert scores == [want] * GRADINGS, scores


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
