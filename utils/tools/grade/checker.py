"""The trusted verdict step: judge a submission's solution cells without running any of its code here.

    python -m utils.tools.grade.checker < job.json > verdicts.json      (started by the grader per submission)

job.json: {"verdicts": path of the lab's verdict module, "cells": [[label, source], ...] (the lab's definition
cells and the submission's solution cells, in notebook order), "parts": [grade_id, ...], "task_timeout": s,
"sandbox": {"prefix": [bwrap and its arguments], "env": {...}} or absent (utils/tools/grade/sandbox.py)}.
verdicts.json: one line {"part": grade_id, "verdict": {"passed": bool, "message": str, "out_of_time": bool}}
per part as it is judged, then {"parts": {grade_id: verdict}, "cell_errors": {label: error}}.

This process never executes, imports or unpickles anything a submission wrote. It starts the verdict
processes (utils/tools/grade/rank.py: one process that forks a pool of ranks, as many as the lab's largest
world size, in the submission's sandbox, TMPDIR private, what each rank prints read and dropped; the verdict
module reaches them as text), draws every case's values from os.urandom and its shapes from a generator seeded
by the submission's cells (so a regrade of one submission meets the same cases), sends each rank only its own
inputs, reads raw tensors and JSON numbers back (utils/tools/grade/wire.py), computes the expected values and
asks the part's judge. A part scores when every case at every world size is judged right. A crash fails the part
it happened in, and its message says how the process ended (exit code, or the signal and where it came from).
A part that runs out of time (no reply within task_timeout) is judged again from the start, on the same cases,
with RETRY_FACTOR times the limit: a busy machine must not change a grade. If it runs out again it is "not
graded: ran out of time" (out_of_time: the grader records no points, and lists it for a regrade), never 0.
After a failure the pool is killed and a fresh one started for the next part. Every process it started is killed
on every path.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import sys
import time
from pathlib import Path

from . import wire
from .pool import Pool, PoolFailure
from .processes import (become_subreaper, child_environment, die_with_parent, exit_on_signals, kill_descendants,
                        make_undumpable)
from .verdicts import InProcess, OnRanks, Result, load_module

MAX_PROBLEMS = 5         # problem lines per failed part in the feedback
RANK_TIMEOUT_MARGIN = 60.0  # seconds a rank's collectives wait beyond the checker's limit (it kills them first)
RETRY_FACTOR = 2.5       # a part that ran out of time is judged once more with this many times the limit


# ------------------------------------------------------------------ judging

def _error_line(name, error: str, where: str) -> str:
    """One feedback line for an error the student's code raised (`name`: the function, `where`: rank and case)."""
    if error.startswith("NotImplementedError"):
        return (f"{name} is not implemented yet: it raised NotImplementedError. Replace the "
                "`raise NotImplementedError()` line in its solution cell with your code.")
    if error.startswith("NotDefined"):
        return error.split(": ", 1)[-1]
    return f"{where}: raised {error}"


def _results(reply_cases, count, tensors_payload=None, on_ranks=True) -> list:
    """Results for `count` cases from one reply; a malformed reply becomes errors, never an exception."""
    out = []
    cases = reply_cases if isinstance(reply_cases, list) else []
    for i in range(count):
        case = cases[i] if i < len(cases) and isinstance(cases[i], dict) else {"error": "no reply for this case"}
        if "error" in case:
            out.append(Result(error=str(case["error"])[:2500]))
        elif on_ranks:
            outputs, measured = case.get("outputs"), case.get("measured")
            try:
                tensors = wire.unpack([d for d in outputs if "type" not in d], tensors_payload)
                it = iter(tensors)
                value = [str(d["type"])[:100] if "type" in d else next(it) for d in outputs]
            except (wire.WireError, TypeError, KeyError, AttributeError):
                out.append(Result(error="its reply could not be read"))
                continue
            if not isinstance(measured, dict):
                measured = {}
            out.append(Result(value=value, measured={k: v for k, v in measured.items() if type(v) in (int, float)}))
        else:
            out.append(Result(value=case.get("value")))
    return out


def _frames(grade_id, n, cases, prefix, task_timeout) -> dict:
    """{rank: (header, payload)}: every case's parameters, and only this rank's inputs."""
    frames = {}
    for rank in range(n):
        headers, payload = [], b""
        for case in cases:
            descriptors, raw = wire.pack(case.inputs[rank])
            for descriptor in descriptors:
                descriptor["offset"] += len(payload)
            payload += raw
            headers.append({"params": case.params, "tensors": descriptors})
        # The ranks' own collectives wait longer than the checker: at its limit they are still blocked, so what
        # the checker sees then (pool.py: waiting or computing) is the submission's state, not their timeout's.
        frames[rank] = ({"part": grade_id, "world_size": n, "rank": rank, "prefix": prefix,
                         "timeout": task_timeout + RANK_TIMEOUT_MARGIN, "cases": headers}, payload)
    return frames


def _failed(what, problems) -> tuple:
    problems = list(dict.fromkeys(problems))  # every rank raising the same error says it once
    more = f"\n  … and {len(problems) - MAX_PROBLEMS} more" if len(problems) > MAX_PROBLEMS else ""
    return False, f"✗ {what}:\n  " + "\n  ".join(problems[:MAX_PROBLEMS]) + more


def judge_on_ranks(grade_id, spec: OnRanks, pool_for, rng, counter, task_timeout, on_failure=lambda failure: None):
    """(passed, message) for a distributed part: every case at every world size, until the first failure."""
    for n in spec.world_sizes:
        cases = spec.cases(n, rng)
        try:
            replies = pool_for(n).run(_frames(grade_id, n, cases, f"task{next(counter)}", task_timeout),
                                      f"running {spec.what} at N={n}")
        except PoolFailure as failure:
            pool_for(None)  # kill it: the next part gets a fresh pool
            on_failure(failure)
            return False, f"✗ {spec.what} at N={n}: {failure}"
        if len(replies) < n:
            pool_for(None)  # a rank raised and the others are still waiting for it in the student's code
        stuck = [Result(error="no reply (still waiting for another rank)")] * len(cases)
        per_rank = [_results(replies[rank][0].get("cases"), len(cases), replies[rank][1]) if rank in replies
                    else stuck for rank in range(n)]
        for i, case in enumerate(cases):
            results = [per_rank[rank][i] for rank in range(n)]
            errors = [(rank, r.error) for rank, r in enumerate(results) if r.error]
            raised = [(rank, e) for rank, e in errors if not e.startswith("no reply")] or errors
            problems = ([_error_line(spec.what, e, f"rank {rank}, {case.label}") for rank, e in raised]
                        if errors else spec.judge(n, case, results))
            if problems:  # the first failing case says enough
                return _failed(f"{spec.what} at N={n}", problems)
    return True, f"✓ {spec.what}: {spec.summary}"


def judge_in_process(grade_id, spec: InProcess, pool_for, rng, on_failure=lambda failure: None):
    """Each case in its own task, so a hang names the student's function that was running (the case's
    params["function"], where the verdict module names one)."""
    for case in spec.cases(rng):
        frames = {0: ({"part": grade_id, "world_size": 0, "rank": 0, "prefix": "", "timeout": 0,
                       "cases": [{"params": case.params, "tensors": []}]}, b"")}
        function = case.params.get("function") if isinstance(case.params, dict) else None
        try:
            replies = pool_for(1).run(frames, f"running {function if isinstance(function, str) else spec.what}")
        except PoolFailure as failure:
            pool_for(None)
            on_failure(failure)
            return False, f"✗ {spec.what}: {failure}"
        result = _results(replies[0][0].get("cases"), 1, on_ranks=False)[0]
        problems = [_error_line(case.label, result.error, case.label)] if result.error else spec.judge(case, result)
        if problems:
            return _failed(spec.what, problems)
    return True, f"✓ {spec.what}: {spec.summary}"


def log(line):
    """The grader keeps the checker's stderr in logs/<student>__<lab>.log."""
    print(f"[verdicts] {line}", file=sys.stderr, flush=True)


def hidden_modules() -> list:
    """The grader's modules a verdict process must not import (stand-ins there: rank.Hidden), e.g. the private
    reference formulas a verdict module imports for its checker-side functions: every module of this package that
    does not run inside the sandbox (sandbox.INSIDE)."""
    from .sandbox import INSIDE

    here = Path(__file__).resolve().parent
    return sorted(f"utils.tools.grade.{path.stem}" for path in here.glob("*.py")
                  if f"tools/grade/{path.name}" not in INSIDE)


def check(job: dict, report=lambda grade_id, verdict: None) -> dict:
    """Judge every part of one submission; returns the verdicts (see the module docstring). report(grade_id,
    verdict) is called as each part is judged, so a run stopped at its time limit keeps the parts it judged."""
    verdicts = load_module(job["verdicts"])
    task_timeout = float(job["task_timeout"])
    specs = {grade_id: verdicts.PARTS[grade_id] for grade_id in job["parts"]}
    size = max([max(s.world_sizes) for s in specs.values() if isinstance(s, OnRanks)] + [1])
    distributed = any(isinstance(s, OnRanks) for s in specs.values())
    cells = [list(cell) for cell in job["cells"]]
    leading = next((i for i, (label, _) in enumerate(cells) if label.startswith("<solution")), len(cells))
    source = Path(job["verdicts"]).read_text()
    setup = {"verdicts": {"name": verdicts.__name__, "source": source}, "hidden": hidden_modules(),
             "cells": cells, "leading": leading, "timeout": task_timeout, "store": distributed}
    # CUDA_VISIBLE_DEVICES="": the verdicts run on gloo, on the CPU, on any grading machine; with no GPU visible the
    # first verdict process cannot initialise CUDA before it forks the ranks (a forked process cannot use it)
    env = child_environment(os.environ.get("TMPDIR", "/tmp"), OMP_NUM_THREADS=1, OPENBLAS_NUM_THREADS=1,
                            MKL_NUM_THREADS=1, MPLBACKEND="Agg", COURSE_OUTPUT="grouped", CUDA_VISIBLE_DEVICES="")
    state = {"pool": None, "failure": None, "timeout": task_timeout}
    cell_errors = {}

    def pool_for(n):
        """The live pool (started when needed); pool_for(None) kills it."""
        if n is None:
            if state["pool"] is not None:
                state["pool"].kill()
            state["pool"] = None
            return None
        if state["failure"] is not None:  # the solution cells could not even be run: no use trying again
            raise state["failure"]
        if state["pool"] is None:
            started = time.monotonic()
            try:
                state["pool"] = Pool(size, dict(setup, timeout=state["timeout"]), state["timeout"], env,
                                     os.getcwd(), job.get("sandbox"))
            except PoolFailure as failure:
                state["failure"] = failure
                raise
            cell_errors.update(state["pool"].cell_errors)
            log(f"started {size} verdict process(es) in {time.monotonic() - started:.1f} s")
        return state["pool"]

    def judge(grade_id, spec):
        """(passed, message, out of time) for one part at the current limit."""
        outcome = {}

        def failed_in_time(failure):
            outcome["timed_out"] = failure.timed_out
        if isinstance(spec, OnRanks):
            passed, message = judge_on_ranks(grade_id, spec, pool_for, rng, counter, state["timeout"],
                                             failed_in_time)
        else:
            passed, message = judge_in_process(grade_id, spec, pool_for, rng, failed_in_time)
        return passed, message, outcome.get("timed_out", False)

    # Shapes and lengths depend on the submission only: the same submission meets the same cases at every grading
    # (firm points), another submission other ones. Values stay unpredictable (os.urandom in the verdicts).
    rng = random.Random(hashlib.sha256(json.dumps(job["cells"]).encode()).digest())
    counter = iter(range(1, 1 << 30))
    parts = {}
    try:
        for grade_id, spec in specs.items():
            started, drawn = time.monotonic(), rng.getstate()
            passed, message, timed_out = judge(grade_id, spec)
            if timed_out and state.get("hopeless"):  # its solution cells ran out of time even at the longer limit
                message = f"not graded: ran out of time (see the first part's message): {message.removeprefix('✗ ')}"
            elif timed_out:  # a busy machine, or a hang: the same cases again, with a longer limit
                log(f"{grade_id}: ran out of time after {time.monotonic() - started:.1f} s ({message.splitlines()[0]}); "
                    f"judged again with {RETRY_FACTOR:g} × the limit")
                first_limit = state["timeout"]
                state.update(timeout=first_limit * RETRY_FACTOR, failure=None)
                rng.setstate(drawn)
                passed, message, timed_out = judge(grade_id, spec)
                state["timeout"] = first_limit
                if timed_out:
                    pool_for(None)
                    state["hopeless"] = state["failure"] is not None
                    message = (f"not graded: ran out of time (no result within {first_limit:g} s, nor within "
                               f"{first_limit * RETRY_FACTOR:g} s when judged again): {message.removeprefix('✗ ')}")
            parts[grade_id] = {"passed": passed and not timed_out, "message": message, "out_of_time": timed_out}
            report(grade_id, parts[grade_id])
            log(f"{grade_id}: {'ran out of time' if timed_out else 'passed' if passed else 'failed'} in "
                f"{time.monotonic() - started:.1f} s")
    finally:
        pool_for(None)
    return {"parts": parts, "cell_errors": cell_errors}


def main() -> int:
    die_with_parent()
    make_undumpable()
    become_subreaper()
    exit_on_signals()
    try:
        job = json.loads(sys.stdin.read())

        def report(grade_id, verdict):  # one line per part as it is judged: the grader keeps what is done
            sys.stdout.write(json.dumps({"part": grade_id, "verdict": verdict}, allow_nan=True) + "\n")
            sys.stdout.flush()
        result = check(job, report)
        sys.stdout.write(json.dumps(result, allow_nan=True) + "\n")
        sys.stdout.flush()
        return 0
    finally:
        kill_descendants()


if __name__ == "__main__":
    sys.exit(main())
