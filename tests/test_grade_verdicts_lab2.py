"""Lab 2's verdicts (utils/tools/grade/verdicts/lab2_ddp.py) through the checker.

The lab's reference solution earns every part; a wrapper that sums the gradients instead of averaging them
keeps construction only, and one that launches every bucket in finish_gradient_synchronization() (no overlap)
keeps construction and training.
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
PARTS = ["construction", "training", "overlap"]
AVERAGE = "torch.cat([g.flatten() for g in grads]).div_(self.world_size)"
LAUNCH_EARLY = "if self.filled_bytes >= self.cap_bytes or self.ready == len(self.params):"


def lab_cells(replace=None):
    """The lab's cells as the grader prepares them, the solution cell edited by `replace` = (old, new)."""
    with tempfile.TemporaryDirectory() as folder:   # this lab alone (another lab may lack its verdicts yet)
        shutil.copy(ROOT / "labs" / "lab2_ddp.ipynb", folder)
        lab = grade.load_labs(folder)["lab2_ddp"]
        nb = read_notebook(lab.path)
        if replace is not None:
            cell = next(c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade_id") == "ddp_bucketed_code")
            assert replace[0] in cell.source, "the reference solution changed: update this test"
            cell.source = cell.source.replace(*replace)
        return grade.prepare(nb, lab).cells


def judge(cells):
    job = {"verdicts": str(module_path("lab2_ddp")), "task_timeout": 60, "parts": PARTS, "cells": cells}
    return checker.check(job)["parts"]


def test_the_reference_earns_every_part():
    parts = judge(lab_cells())
    assert all(parts[p]["passed"] for p in PARTS), parts


@pytest.mark.parametrize("replace, passing, says", [
    ((AVERAGE, "torch.cat([g.flatten() for g in grads])"), {"construction"},
     ("training", "the SUM over the 2 ranks, not the average")),
    ((LAUNCH_EARLY, "if False:  # every bucket waits for finish_gradient_synchronization()"),
     {"construction", "training"}, ("overlap", "started before backward ended; at least 50% must")),
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
