"""Lab 3's verdicts (utils/tools/grade/verdicts/lab3_sharded_optimizer.py) through the checker.

The lab's reference solution earns every part; an optimizer that keeps the whole state and never communicates
earns only the training part (its parameters are right), and one that skips the synchronisation earns nothing.
"""
import re
import shutil
import tempfile
from pathlib import Path

import pytest

from utils.tools import grade
from utils.tools.grade import checker
from utils.tools.grade.verdicts import module_path
from utils.tools.release import read_notebook

ROOT = Path(__file__).resolve().parents[1]
PARTS = ["training", "sharded_state", "synchronisation", "param_groups"]

FULL_STATE = '''class ShardedOptimizer(torch.optim.Optimizer):
    def __init__(self, params, optimizer_cls, **kwargs):
        self.inner, self.optimizer_cls, self.kwargs = None, optimizer_cls, kwargs
        super().__init__(params, kwargs)

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        if self.inner is None:
            self.inner = self.optimizer_cls([dict(self.param_groups[-1])], **self.kwargs)
        else:
            self.inner.add_param_group(dict(self.param_groups[-1]))

    def step(self, closure=None):
        self.inner.step()
'''


def lab_cells(solution=None, skip_sync=False):
    with tempfile.TemporaryDirectory() as folder:   # this lab alone (another lab may lack its verdicts yet)
        shutil.copy(ROOT / "labs" / "lab3_sharded_optimizer.ipynb", folder)
        lab = grade.load_labs(folder)["lab3_sharded_optimizer"]
        nb = read_notebook(lab.path)
        for cell in nb.cells:
            if cell.metadata.get("nbgrader", {}).get("grade_id") == "sharded_optimizer_code":
                if solution is not None:
                    cell.source = solution
                elif skip_sync:
                    cell.source = re.sub(r"dist\.broadcast\(.*\)", "pass", cell.source)
        return grade.prepare(nb, lab).cells


def judge(cells):
    job = {"verdicts": str(module_path("lab3_sharded_optimizer")), "task_timeout": 60, "parts": PARTS,
           "cells": cells}
    return checker.check(job)["parts"]


def test_the_reference_earns_every_part():
    parts = judge(lab_cells())
    assert all(parts[p]["passed"] for p in PARTS), parts


@pytest.mark.parametrize("cells, passing", [
    (lambda: lab_cells(FULL_STATE), {"training", "param_groups"}),
    (lambda: lab_cells(skip_sync=True), set()),
])
def test_wrong_optimizers_lose_the_parts_they_break(cells, passing):
    parts = judge(cells())
    assert {p for p in PARTS if parts[p]["passed"]} == passing, parts
    if "sharded_state" not in passing:
        assert "rank" in parts["sharded_state"]["message"]


def test_random_tied_models_tie_equal_widths():
    import random
    from utils.tools.grade.verdicts import lab3_sharded_optimizer as verdicts
    from utils.labchecks import lab3
    tied = [spec for spec in (verdicts._model(random.Random(seed), "m") for seed in range(200)) if spec["tied"]]
    assert len(tied) > 50
    for spec in tied:
        assert spec["widths"][0] == spec["widths"][-1], spec
        model = lab3.build_model(spec)
        assert model.head.weight is model.wte.weight and model.head.in_features == spec["widths"][0]


def test_note_names_everything_measured_in_the_ranks():
    from utils.tools.grade.verdicts import lab3_sharded_optimizer as verdicts
    assert all(word in verdicts.NOTE for word in ("Optimizer-state bytes", "torch.optim.Optimizer", "param_groups"))
