"""The verdict machinery (utils/tools/grade/checker.py, rank.py, wire.py) on its own.

The checker is called directly here, on lab 1's verdicts and on solution cells written to fail in every way a
process can: a wrong answer, a deadlock, a crash, a syntax error. Each must fail its own part with a message in
the lab checks' words, within the time limit, and leave no process behind; printing changes nothing.
"""
import io
import pickle
import re
import time
from pathlib import Path

import psutil
import pytest

from utils.tools.grade import checker, wire
from utils.tools.grade.verdicts import module_path
from utils.tools.release import read_notebook

import test_lab1_checks  # its wrong solutions, graded here as solution cells

ROOT = Path(__file__).resolve().parents[1]
TASK_TIMEOUT = 5


# ------------------------------------------------------------------ the wire format

def frame(header, payload=b""):
    stream = io.BytesIO()
    wire.write_frame(stream, header, payload)
    return stream.getvalue()


def test_frames_round_trip_tensors_as_raw_bytes():
    import torch

    tensors = [torch.arange(5, dtype=torch.int64), torch.tensor([[0.5, -1.25]], dtype=torch.float32),
               torch.tensor([True, False]), torch.empty(0, dtype=torch.float64)]
    descriptors, payload = wire.pack(tensors)
    header, got = wire.read_frame(io.BytesIO(frame({"tensors": descriptors}, payload)))
    back = wire.unpack(header["tensors"], got)
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(tensors, back))


@pytest.mark.parametrize("data, complaint", [
    (frame({"a": 1})[:10], "ended inside a frame"),
    ((1 << 40).to_bytes(8, "big"), "frame header of"),
    (len(b"[1]").to_bytes(8, "big") + b"[1]" + (0).to_bytes(8, "big"), "not a JSON object"),
    (len(b"{x").to_bytes(8, "big") + b"{x", "not JSON"),
])
def test_malformed_frames_are_refused(data, complaint):
    with pytest.raises(wire.WireError, match=complaint):
        wire.read_frame(io.BytesIO(data))


@pytest.mark.parametrize("descriptor, complaint", [
    ({"dtype": "object", "shape": [1], "offset": 0, "nbytes": 8}, "no allowed dtype"),
    ({"dtype": "int64", "shape": [2], "offset": 0, "nbytes": 8}, "does not match"),
    ({"dtype": "int64", "shape": [1], "offset": 4, "nbytes": 8}, "does not match"),
    ({"dtype": "int64", "shape": "1", "offset": 0, "nbytes": 8}, "malformed"),
])
def test_tensor_descriptors_must_match_their_bytes(descriptor, complaint):
    with pytest.raises(wire.WireError, match=complaint):
        wire.unpack([descriptor], bytes(8))


def test_a_pickle_is_just_bytes():
    """A payload that is a pickle (say, of an object whose __reduce__ runs code) is read as numbers."""
    payload = pickle.dumps(print) + bytes(-len(pickle.dumps(print)) % 8)
    (tensor,) = wire.unpack([{"dtype": "uint8", "shape": [len(payload)], "offset": 0, "nbytes": len(payload)}],
                            payload)
    assert bytes(tensor.tolist()) == payload


# ------------------------------------------------------------------ the checker on lab 1

def lab_cells(**solutions):
    """The lab's definition cells and the given solution sources, labelled and ordered as the grader does."""
    from utils.tools import grade

    lab = grade.load_labs(ROOT / "labs")["lab1_collectives"]
    nb = read_notebook(lab.path)
    for cell in nb.cells:
        grade_id = cell.metadata.get("nbgrader", {}).get("grade_id")
        if grade_id in solutions:
            cell.source = solutions[grade_id]
    return grade.prepare(nb, lab).cells


OFF_BY_ONE = '''def reduce_scatter(tensor):
    rank, n = dist.get_rank(), dist.get_world_size()
    chunks = [chunk.clone() for chunk in tensor.tensor_split(n)]
    right, left = (rank + 1) % n, (rank - 1) % n
    inbox = torch.empty_like(chunks[0])
    for step in range(n - 1):
        outgoing, incoming = chunks[(rank - step) % n], chunks[(rank - 1 - step) % n]
        exchange(outgoing, right, inbox[:incoming.numel()], left)
        incoming += inbox[:incoming.numel()]
    return chunks[(rank + 1) % n]
'''
DEADLOCK = '''def all_gather(chunk, length):
    print("waiting for a message nobody sends")
    dist.recv(torch.empty(1), (dist.get_rank() + 1) % dist.get_world_size())
'''
CRASH = '''def all_reduce_halving_doubling(tensor):
    import os
    if dist.get_rank() == 1:
        print("rank 1 goes away")
        os._exit(7)
    return tensor.clone()
'''
SYNTAX_ERROR = '''def ring_time(n, nbytes, alpha, beta):
    return 2 * (n - 1) * (alpha + nbytes / n * beta)

def halving_doubling_time(n, nbytes, alpha, beta
'''


def reference_solution(grade_id):
    """The reference lab's solution cell `grade_id` (markers included: they are comments)."""
    nb = read_notebook(ROOT / "labs" / "lab1_collectives.ipynb")
    return next(c.source for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade_id") == grade_id)


def verdict_processes():
    def line(p):
        try:
            return " ".join(p.cmdline())
        except psutil.Error:
            return ""
    return [p for p in psutil.Process().children(recursive=True) if "utils.tools.grade.rank" in line(p)]


@pytest.fixture(scope="module")
def judged():
    job = {"verdicts": str(module_path("lab1_collectives")), "task_timeout": TASK_TIMEOUT,
           "parts": ["reduce_scatter", "all_gather", "halving_doubling", "cost_comparison"],
           "cells": lab_cells(reduce_scatter_code=OFF_BY_ONE, all_gather_code=DEADLOCK,
                              halving_doubling_code=CRASH, cost_model_code=SYNTAX_ERROR)}
    start = time.monotonic()
    result = checker.check(job)
    return result, time.monotonic() - start


def message(judged, part):
    verdict = judged[0]["parts"][part]
    assert verdict["passed"] is False
    return verdict["message"]


def test_a_wrong_answer_is_named_by_rank_and_case(judged):
    text = message(judged, "reduce_scatter")
    assert text.startswith("✗ reduce_scatter at N=2:\n  rank ")
    assert re.search(r"rank \d, length \d+, \w+: returned chunk \d of the sum, expected chunk \d = elements", text)
    assert "off by one chunk?" in text


def test_a_deadlock_fails_its_part_at_the_time_limit(judged):
    """Every rank waits, none computes: a deadlock scores 0 at once (no retry), on a busy machine too."""
    text = message(judged, "all_gather")
    assert f"no result after {TASK_TIMEOUT} s while running all_gather at N=2: a deadlock (every rank waiting" in text
    assert "not graded" not in text


def test_a_crashed_rank_fails_its_part_with_its_last_words(judged):
    text = message(judged, "halving_doubling")
    assert "the process of rank 1 exited" in text and "rank 1 goes away" in text


def test_a_syntax_error_is_reported_and_fails_what_it_defines(judged):
    text = message(judged, "cost_comparison")
    assert "ring_time is not defined" in text
    errors = judged[0]["cell_errors"]
    assert list(errors) == ["<solution cell 'cost_model_code'>"] and "SyntaxError" in errors[
        "<solution cell 'cost_model_code'>"]


def test_failures_cost_their_time_limit_and_leave_nothing_running(judged):
    assert judged[1] < 3 * TASK_TIMEOUT + 120, "one deadlock, three fresh pools"
    assert verdict_processes() == []


CHATTY = """def ring_time(n, nbytes, alpha, beta):
    print("ring_time says hello " * 5000)
    return 2 * (n - 1) * (alpha + nbytes / n * beta)
"""


def test_what_student_code_prints_never_reaches_a_verdict():
    """A correct function that prints a lot (here ~5 MB) still passes: its output is read and dropped."""
    job = {"verdicts": str(module_path("lab1_collectives")), "task_timeout": 60, "parts": ["cost_comparison"],
           "cells": lab_cells(cost_model_code=CHATTY + "\n\ndef halving_doubling_time" + reference_solution(
               "cost_model_code").split("\n\ndef halving_doubling_time", 1)[1])}
    result = checker.check(job)
    assert result["parts"]["cost_comparison"]["passed"], result
    assert verdict_processes() == []


def test_solution_cells_that_never_finish_fail_every_part_once(monkeypatch):
    """A top-level endless loop: the ranks never get ready. It computes, as a busy machine would, so it is judged
    again with the longer limit, then every part is "not graded: ran out of time" (no points, never 0), after
    those two waits, not two per part."""
    from utils.tools.grade import pool

    monkeypatch.setattr(pool, "STARTUP_TIMEOUT", 5)
    job = {"verdicts": str(module_path("lab1_collectives")), "task_timeout": 5,
           "parts": ["reduce_scatter", "cost_comparison"],
           "cells": lab_cells(reduce_scatter_code="while True:\n    pass")}
    start = time.monotonic()
    result = checker.check(job)
    assert time.monotonic() - start < 5 + 12.5 + 60
    for part in ("reduce_scatter", "cost_comparison"):
        message = result["parts"][part]["message"]
        assert message.startswith("not graded: ran out of time"), message
        assert "while running your solution cells: code at the top level" in message
    assert verdict_processes() == []


# ------------------------------------------------------------------ traffic loopholes, graded again and again

def renamed(function, name):
    """A wrong solution of tests/test_lab1_checks.py as a solution cell's source, under the lab's name."""
    import inspect

    return inspect.getsource(function).replace(f"def {function.__name__}(", f"def {name}(", 1)


def padded_halving_doubling():
    """The reference halving-doubling run on the tensor padded to a multiple of p: right sums, more bytes."""
    source = reference_solution("halving_doubling_code").replace(
        "def all_reduce_halving_doubling(tensor):", "def _unpadded(tensor):")
    return source + '''

def all_reduce_halving_doubling(tensor):
    n = dist.get_world_size()
    p = 1 << (n.bit_length() - 1)
    padded = torch.zeros(-(-tensor.numel() // p) * p, dtype=tensor.dtype, device=tensor.device)
    padded[:tensor.numel()] = tensor
    return _unpadded(padded)[:tensor.numel()]
'''


def test_padding_and_extra_messages_score_zero_on_every_grading():
    """Right sums, wrong traffic: each affected part fails on every grading (the same cases each time, seeded by
    the submission, fresh values; among them always a length N does not divide); the untouched part passes every time."""
    job = {"verdicts": str(module_path("lab1_collectives")), "task_timeout": 60,
           "parts": ["reduce_scatter", "all_gather", "halving_doubling", "cost_comparison"],
           "cells": lab_cells(reduce_scatter_code=renamed(test_lab1_checks.rs_padded, "reduce_scatter"),
                              all_gather_code=renamed(test_lab1_checks.ag_in_two_messages, "all_gather"),
                              halving_doubling_code=padded_halving_doubling())}
    for grading in range(3):
        parts = checker.check(job)["parts"]
        assert not parts["reduce_scatter"]["passed"] and "(M minus chunk" in parts["reduce_scatter"]["message"]
        assert not parts["all_gather"]["passed"] and "at most" in parts["all_gather"]["message"] and \
            "N-1 steps around the ring" in parts["all_gather"]["message"]
        assert not parts["halving_doubling"]["passed"] and "all ranks together" in \
            parts["halving_doubling"]["message"]
        assert parts["cost_comparison"]["passed"], parts["cost_comparison"]
    assert verdict_processes() == []


# ------------------------------------------------------------------ lab 1's cost cases: firm and fair

def test_cost_cases_are_the_same_at_every_grading_and_judge_the_subtractions_the_same_way():
    """Part 4's random cases are drawn from a generator seeded by the submission, so a regrade meets the same
    ones; over many submissions' cases, the subtraction with a tolerance on the slopes (right up to round-off)
    always passes and the one that tests the slopes against 0 always fails (on the fixed N = 16 case)."""
    import random

    from utils.tools.grade import reference
    from utils.tools.grade.verdicts import Result
    from utils.tools.grade.verdicts import lab1_collectives as verdicts

    def draw(seed):
        return [(case.params["calls"], [want for _, _, want in case.expected])
                for case in verdicts._cost_cases(random.Random(seed))]

    assert draw(b"one submission") == draw(b"one submission") != draw(b"another submission")
    ring, hd = reference.lab1_ring_time, reference.lab1_halving_doubling_time
    for seed in range(300):
        crossover = [c for c in verdicts._cost_cases(random.Random(seed)) if c.params["function"] == "crossover_bytes"][0]
        for tolerant, passes in ((True, True), (False, False)):
            answers = [test_lab1_checks.crossover_by_subtraction(*args, ring, hd, tolerant=tolerant)
                       for args in crossover.params["calls"]]
            problems = verdicts._judge_cost(crossover, Result(value=answers))
            assert (problems == []) is passes, (seed, tolerant, problems)


# ------------------------------------------------------------------ what the lab's cells define, the verdicts provide

USES_THE_LABS_HELPER = '''def all_reduce_halving_doubling(tensor):
    """The fold by hand, then the lab's own table of ranges (halving_doubling_ranges, defined in a cell that also
    prints) for every halving and doubling step of this rank's position."""
    rank, n = dist.get_rank(), dist.get_world_size()
    result = tensor.clone()
    p = 1 << (n.bit_length() - 1)
    extra = n - p
    if rank < 2 * extra:
        if rank % 2 == 0:
            dist.send(result, rank + 1)
            dist.recv(result, rank + 1)
            return result
        inbox = torch.empty_like(result)
        dist.recv(inbox, rank - 1)
        result += inbox
        me = rank // 2
    else:
        me = rank - extra
    real = lambda q: 2 * q + 1 if q < extra else q + extra   # noqa: E731
    inbox = torch.empty_like(result)
    for step, q, partner, out, into, _ in halving_doubling_ranges(p, result.numel()):
        if q != me:
            continue
        if step.startswith("halve"):
            exchange(result[out[0]:out[1]], real(partner), inbox[into[0]:into[1]], real(partner))
            result[into[0]:into[1]] += inbox[into[0]:into[1]]
        else:
            exchange(result[out[0]:out[1]], real(partner), result[into[0]:into[1]], real(partner))
    if rank < 2 * extra:
        dist.send(result, rank - 1)
    return result
'''


def test_a_solution_may_call_what_the_labs_cells_define():
    """Part 3 solved with `halving_doubling_ranges`, which the lab defines in a cell that also prints: the visible
    check passes (the notebook ran that cell), and so must the verdict, on both gradings (it was a NameError:
    verdicts ran only cells made of definitions). The cell's definitions run, its prints do not."""
    cells = lab_cells(halving_doubling_code=USES_THE_LABS_HELPER)
    helper = [source for label, source in cells if "its definitions" in label and "def halving_doubling_ranges" in source]
    assert len(helper) == 1 and "print(" not in helper[0].split("return rows")[-1], helper
    job = {"verdicts": str(module_path("lab1_collectives")), "task_timeout": 30, "parts": ["halving_doubling"],
           "cells": cells}
    for _ in range(2):
        part = checker.check(job)["parts"]["halving_doubling"]
        assert part["passed"], part["message"]


def test_the_visible_check_accepts_the_helper_reusing_solution():
    import torch
    import torch.distributed as dist
    from utils.labchecks import lab1
    nb = read_notebook(ROOT / "labs" / "lab1_collectives.ipynb")
    namespace = {"torch": torch, "dist": dist, "__name__": "lab1_student"}
    for cell in nb.cells:   # the cells a student's notebook runs before part 3's check, their prints aside
        if cell.cell_type == "code" and ("def exchange" in cell.source or "def halving_doubling_ranges" in cell.source):
            exec(compile(cell.source.split("span = lambda")[0], "<lab cell>", "exec"), namespace)
    exec(compile(USES_THE_LABS_HELPER, "<solution>", "exec"), namespace)
    lab1.check_halving_doubling(namespace["all_reduce_halving_doubling"], world_sizes=(3, 4), lengths=(7, 10))
