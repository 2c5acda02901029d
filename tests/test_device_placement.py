"""Tensors that meet a collective are made on the rank's device (a CPU test of a GPU-only bug).

On gloo every tensor lives on the CPU, so a tensor made without `device=` works; on NCCL (one GPU per rank) the
same collective fails: NCCL takes CUDA tensors only. No CPU run can show it, so this test reads the code: in every
function of the lessons, labs, lesson scripts, benchmarks and utils/, a tensor made by a torch factory (torch.zeros,
torch.tensor, ...) without `device=`, or with the CPU named as its device, must not be passed to a collective
(all_reduce, all_gather, broadcast, send, ...) directly, by the name it was assigned to, or in a list. Code that runs
on gloo only says so where it calls: a `# gloo only` comment on the collective's line.

The second part: a function that all-reduces gradients and places nothing on a device is not launched where it
may get NCCL. The third part: a NCCL group is bound to its rank's GPU when it forms (init_process_group(device_id=)), both in the
ranks utils.launch starts and under torchrun.

The fourth part (at the end): a rank's models and batches are moved to its device before they compute gradients
that DDP or an all-reduce hands to NCCL. The rules themselves are in tests/device_rules.py.
"""
from __future__ import annotations

import ast

import pytest
import torch

from device_rules import (GLOO_ONLY, PY_SOURCES, ROOT, SOURCES, _code_cells, findings, launch_findings,
                          unmoved)

@pytest.mark.parametrize("notebook", SOURCES)
def test_tensors_that_meet_a_collective_are_made_on_the_ranks_device_in(notebook):
    offences = [f"{notebook}, cell {index} ({cell_id}), {f}" for index, cell_id, source in _code_cells(ROOT / notebook)
                for f in findings(source)]
    assert not offences, "\n".join(offences)


def test_tensors_that_meet_a_collective_are_made_on_the_ranks_device_in_python_files():
    assert set(GLOO_ONLY) <= set(PY_SOURCES), "GLOO_ONLY names a file that is gone"
    offences = [f"{path}, {f}" for path in PY_SOURCES if path not in GLOO_ONLY
                for f in findings((ROOT / path).read_text())]
    assert not offences, "\n".join(offences)


def test_the_check_finds_what_it_is_for():
    """Lesson 05's cells before issue 35: a gradient and a timing made on the CPU, all-reduced."""
    before = '''
def paced_steps(steps):
    grad = torch.ones(1024)
    for step in range(steps):
        dist.all_reduce(grad)
    slowest = torch.tensor([1.0], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    probe, seconds = torch.zeros(64), []
    link.all_reduce(probe)
    everyone = [torch.zeros(3) for _ in range(4)]
    dist.all_gather(everyone, torch.ones(3, device="cpu"))
'''
    assert [f.split(":")[0] for f in findings(before)] == ["line 5", "line 7", "line 9", "line 11", "line 11"]
    after = '''
def paced_steps(steps, device):
    grad = torch.ones(1024, device=utils.device())
    dist.all_reduce(grad)
    mine = torch.zeros(3)
    mine = mine.to(device)
    dist.all_gather([torch.empty_like(mine) for _ in range(4)], mine)
    flat = torch.zeros(3)
    dist.broadcast(flat, src=0)                                  # gloo only
    dist.broadcast(torch.zeros(3, device=device), src=0)
'''
    assert findings(after) == []


@pytest.mark.parametrize("notebook", SOURCES)
def test_a_launch_that_may_pick_nccl_does_not_all_reduce_cpu_gradients_in(notebook):
    offences = [f"{notebook}, {f}" for f in launch_findings([s for _, _, s in _code_cells(ROOT / notebook)])]
    assert not offences, "\n".join(offences)


def test_the_launch_check_finds_what_it_is_for():
    """Lesson 08's train_run before issue 35, launched with "auto"; then placed, or pinned to gloo."""
    before = '''
def train_run(steps):
    model = GPT(config)
    model(x, y).backward()
    flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    dist.all_reduce(flat)
'''
    assert [f.split(":")[0] for f in launch_findings([before, "straight = utils.launch(train_run, 8, world_size=4)"])] \
        == ["launch(train_run) at line 1"]
    placed = before.replace("GPT(config)", "make_model()") + "\ndef make_model():\n    return GPT(config).to(utils.device())\n"
    assert launch_findings([placed, "utils.launch(train_run, 8, world_size=4)"]) == []
    assert launch_findings([before, 'utils.launch(train_run, 8, world_size=4, backend="gloo")']) == []


# ------------------------------------------------------------- NCCL groups are bound to their rank's GPU

class _Formed(Exception):
    pass


@pytest.fixture
def recorded(monkeypatch):
    """init_process_group and set_device recorded instead of run (the group 'forms' by raising _Formed)."""
    from utils import compat, rank_process
    calls = []
    monkeypatch.setattr(rank_process.torch.cuda, "set_device", lambda device: calls.append(("set_device", device)))

    def init(backend, **kwargs):
        calls.append(("init", backend, kwargs))
        raise _Formed
    monkeypatch.setattr(rank_process.dist, "init_process_group", init)
    monkeypatch.setattr(rank_process.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(compat, "_INIT_TAKES_DEVICE_ID", True)
    return calls


def test_under_torchrun_a_nccl_group_is_bound_to_the_local_ranks_gpu(recorded, monkeypatch):
    from utils import rank_process
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(_Formed):
        rank_process.run_under_torchrun(print, (), {}, "nccl")
    cuda1 = torch.device("cuda", 1)
    assert recorded == [("set_device", cuda1), ("init", "nccl", {"device_id": cuda1})]


def test_under_torchrun_auto_picks_nccl_only_with_a_gpu_per_local_rank(recorded, monkeypatch):
    from utils import devices, rank_process
    monkeypatch.setattr(devices, "_gpu_count", lambda: 1)          # Colab: one GPU, two ranks
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(_Formed):
        rank_process.run_under_torchrun(print, (), {}, "auto")
    assert recorded == [("init", "gloo", {})]


def test_without_device_id_in_torch_the_group_still_forms(recorded, monkeypatch):
    from utils import compat, rank_process
    monkeypatch.setattr(compat, "_INIT_TAKES_DEVICE_ID", False)
    assert rank_process._device_options("nccl", 0) == {} and recorded == [("set_device", torch.device("cuda", 0))]
    assert rank_process._device_options("gloo", 0) == {}





@pytest.mark.parametrize("notebook", SOURCES)
def test_models_and_batches_of_a_rank_are_moved_to_its_device_in(notebook):
    cells = list(_code_cells(ROOT / notebook))
    offences = [f"{notebook}, cell {cells[i][0]} ({cells[i][1]}), {f}"
                for i, f in unmoved([ast.parse(source) for _, _, source in cells])]
    assert not offences, "\n".join(offences)


def test_models_and_batches_of_a_rank_are_moved_to_its_device_in_python_files():
    offences = [f"{path}, {f}" for path in PY_SOURCES if path not in GLOO_ONLY
                for _, f in unmoved([ast.parse((ROOT / path).read_text())])]
    assert not offences, "\n".join(offences)


def test_the_model_check_finds_what_it_is_for():
    """Lesson 04's cells before issue 35: models and batches of a rank left on the CPU."""
    before = '''
class UsedBackwards(torch.nn.Module):
    pass

def make_model():
    torch.manual_seed(seed)
    return GPT(model_config)

def train(steps):
    model = make_model()
    x, y = source.batch(0, 4, 32)
    ddp = utils.compat.ddp(UsedBackwards())
    layer = torch.nn.Linear(4, 4)

def on_gloo():
    model = make_model()

utils.launch(train, 2, world_size=4)
utils.launch(on_gloo, world_size=4, backend="gloo")
'''
    assert [f.split(" (")[0] for _, f in unmoved([ast.parse(before)])] == ["line 10", "line 11", "line 12", "line 13"]
    after = '''
class UsedBackwards(torch.nn.Module):
    pass

def make_model():
    torch.manual_seed(seed)
    return GPT(model_config)

def train(steps):
    device = utils.device()
    model = make_model().to(device)
    x, y = (t.to(device) for t in source.batch(0, 4, 32))
    used = UsedBackwards()
    used.to(device)
    ddp = utils.compat.ddp(used)
    layer = torch.nn.Linear(4, 4, device=device)
    x2, y2 = source.batch(1, 4, 32)
    x2, y2 = x2.to(device), y2.to(device)

utils.launch(train, 2, world_size=4)
'''
    assert unmoved([ast.parse(after)]) == []
