"""Lab 3's verdicts (utils/tools/grade/verdicts/lab3_sharded_optimizer.py) through the checker.

Each kind of submission is graded twice (the cases' shapes are seeded by the submission, so both gradings meet the
same ones; the values are fresh each time, and no part is judged on timing) and must earn the same parts both
times: the reference every part; a split by position (parameter i to rank i mod N) all but
sharded_state (the contract asks for a size-balanced split); an inner optimizer over every parameter, with the
gradients of the parameters a rank does not own set to None, all but sharded_state; one that ignores a learning
rate changed in param_groups mid-run all but param_groups; torch's ZeroRedundancyOptimizer nothing; an optimizer
that keeps the whole state and never communicates training and param_groups; one that skips the synchronisation
nothing.
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
GRADINGS = 2

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
        for group, inner in zip(self.param_groups, self.inner.param_groups):
            inner.update({k: v for k, v in group.items() if k != "params"})
        self.inner.step()
'''

ZERO = '''from torch.distributed.optim import ZeroRedundancyOptimizer

class ShardedOptimizer(ZeroRedundancyOptimizer):
    def __init__(self, params, optimizer_cls, **kwargs):
        super().__init__(params, optimizer_cls, **kwargs)
'''


def reference_source():
    nb = read_notebook(ROOT / "labs" / "lab3_sharded_optimizer.ipynb")
    return next(c.source for c in nb.cells
                if c.metadata.get("nbgrader", {}).get("grade_id") == "sharded_optimizer_code")


def edited(*replacements):
    """The reference solution cell with each (old, new) replaced (each old must be there)."""
    source = reference_source()
    for old, new in replacements:
        assert old in source, old
        source = source.replace(old, new)
    return source


INDEX_SPLIT = (  # parameter i of the group list to rank i mod N: right values, unbalanced on some models
    'for p in sorted(group["params"], key=lambda p: -p.numel()):',
    'for p in group["params"]:')
INDEX_OWNER = ("owner = min(range(self.world_size), key=lambda r: self.loads[r])",
               "owner = len(self.owner) % self.world_size")
# One inner optimizer over every parameter; before its step, the gradients of parameters this rank does not own
# are set to None, so it creates state only for the shard's (for every optimizer but Adagrad).
FULL_INNER = [('self.shard = self.optimizer_cls([{**options, "params": mine}], **self.kwargs)',
               'self.shard = self.optimizer_cls([{**options, "params": group["params"]}], **self.kwargs)'),
              ('self.shard.add_param_group({**options, "params": mine})',
               'self.shard.add_param_group({**options, "params": group["params"]})'),
              ("        self.shard.step(**kwargs)              # skips parameters whose .grad is None\n",
               "        had = {p for g in self.param_groups for p in g['params'] if p.grad is not None}\n"
               "        for p in had:\n"
               "            if self.owner[p] != self.rank:\n"
               "                p.grad = None\n"
               "        self.shard.step()\n"),
              ("                if p.grad is not None:         # without a gradient it did not change",
               "                if p in had:")]
IGNORES_LR = ('shard_group.update({k: v for k, v in group.items() if k != "params"})   # e.g. a scheduler\'s lr',
              "pass")


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


KINDS = {
    "reference": (lambda: lab_cells(), set(PARTS), ""),
    "index split": (lambda: lab_cells(edited(INDEX_SPLIT, INDEX_OWNER)), set(PARTS) - {"sharded_state"},
                    "the split is unbalanced"),
    "full inner, None gradients": (lambda: lab_cells(edited(*FULL_INNER)), set(PARTS) - {"sharded_state"},
                                   "hold all"),
    "ignores a mid-run lr change": (lambda: lab_cells(edited(IGNORES_LR)), set(PARTS) - {"param_groups"},
                                    "copy every group's options"),
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_each_kind_earns_the_same_parts_on_every_grading(kind):
    make_cells, passing, message = KINDS[kind]
    cells = make_cells()
    earned = []
    for _ in range(GRADINGS):   # the same cases, fresh values each time
        parts = judge(cells)
        earned.append({p for p in PARTS if parts[p]["passed"]})
        for p in set(PARTS) - passing:
            assert message in parts[p]["message"], parts[p]["message"]
    points = {"training": 4, "sharded_state": 2, "synchronisation": 2, "param_groups": 2}
    print(f"{kind}: points over {GRADINGS} gradings: {[sum(points[p] for p in e) for e in earned]}, "
          f"parts missed: {[sorted(set(PARTS) - e) for e in earned]}")
    assert earned == [passing] * GRADINGS, earned


@pytest.mark.parametrize("cells, passing", [
    (lambda: lab_cells(FULL_STATE), {"training", "param_groups"}),
    (lambda: lab_cells(skip_sync=True), set()),
    (lambda: lab_cells(ZERO), set()),
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
    assert all(word in verdicts.NOTE for word in ("Optimizer-state bytes", "inner optimizers hold",
                                                  "ZeroRedundancyOptimizer", "zero_grad", "param_groups"))
