"""Lab 3's verdicts (utils/tools/grade/verdicts/lab3_sharded_optimizer.py) through the checker.

Each kind of submission is graded twice (the cases' shapes are seeded by the submission, so both gradings meet the
same ones; the values are fresh each time, and no part is judged on timing) and must earn the same parts both
times. The two correct ones, the reference and flat shards held as plain views (tests/fixtures/lab3_submissions.py),
earn every part; each wrong one is graded on the parts it breaks (and, where the rubric is the point, on all):
  - a split by position, a split that counts frozen elements as load (ZeroRedundancyOptimizer's partitioner), an
    inner optimizer over every parameter with the others' gradients set to None: no sharded_state;
  - groups added later given to every rank's inner optimizer: no param_groups;
  - one that ignores a learning rate changed in param_groups mid-run: no param_groups;
  - an optimizer that keeps the whole state and never communicates: training only (2 of 10);
  - a sharded optimizer that forgets the synchronisation: sharded_state and param_groups (6 of 10);
  - torch's ZeroRedundancyOptimizer: nothing.
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
POINTS = {"training": 2, "sharded_state": 4, "synchronisation": 2, "param_groups": 2}
FLAT = (ROOT / "tests" / "fixtures" / "lab3_submissions.py").read_text()

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
COUNTS_FROZEN = ("self.loads[owner] += p.numel() if p.requires_grad else 0   # a frozen parameter has no state",
                 "self.loads[owner] += p.numel()")
ADDED_TO_EVERY_RANK = [("        super().__init__(params, kwargs)       # calls self.add_param_group once per group",
                        "        super().__init__(params, kwargs)       # calls self.add_param_group once per group\n"
                        "        self.built = True"),
                       ('self.shard.add_param_group({**options, "params": mine})',
                        'self.shard.add_param_group({**options, "params": group["params"] if getattr(self, "built", '
                        'False) else mine})')]
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


def judge(cells, parts=PARTS):
    job = {"verdicts": str(module_path("lab3_sharded_optimizer")), "task_timeout": 60, "parts": list(parts),
           "cells": cells}
    return checker.check(job)["parts"]


KINDS = {   # name: (cells, parts graded, parts earned, what a lost part's message says)
    "reference": (lambda: lab_cells(), PARTS, set(PARTS), ""),
    "flat shards, plain views": (lambda: lab_cells(FLAT), PARTS, set(PARTS), ""),
    "index split": (lambda: lab_cells(edited(INDEX_SPLIT, INDEX_OWNER)), ["sharded_state"], set(),
                    "the split is unbalanced"),
    "balance counts frozen elements": (lambda: lab_cells(edited(COUNTS_FROZEN)), ["sharded_state"], set(),
                                       "the split is unbalanced"),
    "full inner, None gradients": (lambda: lab_cells(edited(*FULL_INNER)), ["sharded_state"], set(), "hold all"),
    "added groups on every rank": (lambda: lab_cells(edited(*ADDED_TO_EVERY_RANK)), ["param_groups"], set(),
                                   "must be shared out too"),
    "ignores a mid-run lr change": (lambda: lab_cells(edited(IGNORES_LR)), ["param_groups"], set(),
                                    "copy every group's options"),
    "whole state, no communication": (lambda: lab_cells(FULL_STATE), PARTS, {"training"}, "rank"),
    "sharded, never synchronised": (lambda: lab_cells(skip_sync=True), PARTS, {"sharded_state", "param_groups"},
                                    "rank"),
    "ZeroRedundancyOptimizer": (lambda: lab_cells(ZERO), ["training", "sharded_state"], set(),
                                "ZeroRedundancyOptimizer"),
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_each_kind_earns_the_same_parts_on_every_grading(kind):
    make_cells, graded, passing, message = KINDS[kind]
    cells = make_cells()
    earned = []
    for _ in range(GRADINGS):   # the same cases, fresh values each time
        parts = judge(cells, graded)
        earned.append({p for p in graded if parts[p]["passed"]})
        for p in set(graded) - passing:
            assert message in parts[p]["message"], parts[p]["message"]
    print(f"{kind}: points over {GRADINGS} gradings (of {sum(POINTS[p] for p in graded)} graded): "
          f"{[sum(POINTS[p] for p in e) for e in earned]}, parts missed: {[sorted(set(graded) - e) for e in earned]}")
    assert earned == [passing] * GRADINGS, earned


def test_the_rubric_follows_sharding_then_synchronisation():
    """The notebook's points: sharding weighs most, then synchronisation; training is what an unsharded optimizer
    earns too (INSTRUCTORS.md says why)."""
    nb = read_notebook(ROOT / "labs" / "lab3_sharded_optimizer.ipynb")
    points = {c.metadata["nbgrader"]["grade_id"]: c.metadata["nbgrader"]["points"] for c in nb.cells
              if c.metadata.get("nbgrader", {}).get("grade")}
    assert points == POINTS, points


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


def test_instructors_md_says_what_the_code_does(capsys):
    """INSTRUCTORS.md's lab-3 facts, read against the code they describe: how often the tests grade each kind, the
    steps of the fixed cases, and `grade --parts` naming the cells verdicts run by their ids in the notebook file."""
    import inspect
    from utils.labchecks import lab3
    text = " ".join((ROOT / "INSTRUCTORS.md").read_text().split())
    assert f"tests/test_grade_verdicts_lab3.py grades each kind twice (`GRADINGS = {GRADINGS}`)" in text
    assert GRADINGS == 2 and "three times" not in text
    group, change = lab3.GROUP, lab3.LR_CHANGE
    assert (f"`wte.weight` added with `add_param_group` (lr {group['options']['lr']:g}) before step {group['step']}, "
            f"every lr halved in `param_groups` before step {change['step']}") in text and change["factor"] == 0.5
    assert f"`wte.weight` added before step {group['step']}, lr halved before step {change['step']}" in text
    sync = inspect.signature(lab3.check_synchronisation).parameters
    assert (f"the last rank's parameters perturbed before step {sync['at_step'].default} of "
            f"{sync['steps'].default}") in text
    assert grade.main(["--parts", "--labs", str(ROOT / "labs")]) == 0
    out = capsys.readouterr().out
    assert "by cell id (each cell's \"id\" in the notebook file)" in out
    listed = re.search(r"lab3_sharded_optimizer:.*?by cell id [^:]*: (.*?), then the solution cells", out, re.S)
    ids = [i.split()[0] for i in listed.group(1).split(", ")]
    nb = read_notebook(ROOT / "labs" / "lab3_sharded_optimizer.ipynb")
    assert ids and set(ids) <= {c.id for c in nb.cells}, ids
