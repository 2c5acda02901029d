"""The trusted verdict step: judge a submission's solution cells without running any of its code here.

    python -m utils.tools.grade.checker < job.json > verdicts.json      (started by the grader per submission)

job.json: {"verdicts": path of the lab's verdict module, "cells": [[label, source], ...] (the lab's definition
cells and the submission's solution cells, in notebook order), "parts": [grade_id, ...], "task_timeout": s}.
verdicts.json: {"parts": {grade_id: {"passed": bool, "message": str}}, "cell_errors": {label: error}}.

This process never executes, imports or unpickles anything a submission wrote. It starts the verdict
processes (utils/tools/grade/rank.py: one process that forks a pool of ranks, as many as the lab's largest
world size, in a session of their own, TMPDIR private, what each rank prints read and dropped), hosts the gloo
rendezvous store they connect to, draws every case's values from os.urandom and its shapes from a generator
seeded by the submission's cells (so a regrade of one submission meets the same cases), sends each rank only its own
inputs, reads raw tensors and JSON numbers back (utils/tools/grade/wire.py), computes the expected values and
asks the part's judge. A part scores when every case at every world size is judged right. A hang (no reply
within task_timeout) or a crash fails the part it happened in; the pool is then killed and a fresh one started
for the next part. Every process it started is killed on every path.
"""
from __future__ import annotations

import hashlib
import json
import os
import queue
import random
import subprocess
import sys
import threading
import time
from datetime import timedelta

from . import wire
from .processes import (become_subreaper, child_environment, die_with_parent, exit_on_signals,
                        kill_descendants, kill_tree, make_undumpable)
from .verdicts import InProcess, OnRanks, Result, load_module

STARTUP_TIMEOUT = 120.0  # seconds for a pool to import torch and run the solution cells
MAX_REPLY = 64 << 20     # bytes of tensors one rank may send back for one task
ERROR_GRACE = 3.0        # seconds the other ranks get to reply after one rank's code raised
MAX_PROBLEMS = 5         # problem lines per failed part in the feedback
TAIL = 2000              # characters of a process's own output kept, to explain a crash


class PoolFailure(Exception):
    """The pool could not finish a task: the message says why, in the student's terms."""


class Pool:
    """`size` ranks (utils/tools/grade/rank.py) that ran the solution cells and wait for tasks."""

    def __init__(self, size, setup, task_timeout, env, cwd):
        self.size, self.task_timeout = size, task_timeout
        self.events = queue.Queue()
        self.commands, self.results, self.outputs = [], [], []
        self.tails = [bytearray() for _ in range(size + 1)]  # the last: the first process's own
        self.cell_errors = {}
        self.started = time.time()
        self.proc = None
        theirs = []
        try:
            for _ in range(size):
                pipes = [os.pipe() for _ in range(3)]  # commands (to it), results and output (from it)
                theirs.append([pipes[0][0], pipes[1][1], pipes[2][1]])
                self.commands.append(os.fdopen(pipes[0][1], "wb"))
                self.results.append(os.fdopen(pipes[1][0], "rb"))
                self.outputs.append(os.fdopen(pipes[2][0], "rb"))
            self.proc = subprocess.Popen([sys.executable, "-m", "utils.tools.grade.rank"], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                         pass_fds=[fd for fds in theirs for fd in fds], env=env, cwd=cwd,
                                         start_new_session=True)
            child_fds = [list(fds) for fds in theirs]  # pass_fds keeps the numbers
            for fd in (fd for fds in theirs for fd in fds):
                os.close(fd)
            theirs = []
            for index in range(size):
                threading.Thread(target=self._drain, args=(self.outputs[index], index), daemon=True).start()
                threading.Thread(target=self._replies, args=(index,), daemon=True).start()
            threading.Thread(target=self._drain, args=(self.proc.stdout, size), daemon=True).start()
            self._write(self.proc.stdin, dict(setup, ranks=child_fds), b"", close=True)
            replies = self._collect(range(size), time.monotonic() + max(STARTUP_TIMEOUT, task_timeout),
                                    "running your solution cells", "code at the top level of a cell that never ends?")
        except BaseException:
            for fd in (fd for fds in theirs for fd in fds):
                os.close(fd)
            self.kill()
            raise
        for header, _ in replies.values():
            if header.get("ready") is not True:
                self.kill()
                raise PoolFailure("a verdict process did not start properly")
            errors = header.get("cell_errors")
            if isinstance(errors, dict):
                self.cell_errors.update({str(k)[:100]: str(v)[:2000] for k, v in errors.items()})

    # -------------------------------------------------------------- reading the processes

    def _drain(self, stream, index):
        """A process's own output (what the student's code prints): read as it comes, only its tail kept, to
        explain a crash. It never reaches a verdict, so printing does not change a grade; the time limit bounds
        how long a process may spend printing."""
        while chunk := stream.read1(1 << 16):
            self.tails[index] = (self.tails[index] + chunk)[-TAIL:]

    def _replies(self, index):
        try:
            while (frame := wire.read_frame(self.results[index], MAX_REPLY)) is not None:
                self.events.put(("reply", index, frame))
        except (wire.WireError, OSError, ValueError) as error:
            self.events.put(("garbled", index, str(error)))
            return
        self.events.put(("exit", index, None))

    def _tail(self, index) -> str:
        text = self.tails[index].decode("utf-8", "replace").strip()
        return "\n".join(text.splitlines()[-8:])

    def _collect(self, ranks, deadline, doing, hang_hint=None) -> dict:
        """{rank: frame} once every rank in `ranks` replied; PoolFailure at the first hang or crash."""
        ranks, replies, raised_at = set(ranks), {}, None
        while ranks - replies.keys():
            limit = deadline if raised_at is None else min(deadline, raised_at + ERROR_GRACE)
            try:
                kind, index, data = self.events.get(timeout=max(0.0, limit - time.monotonic()))
            except queue.Empty:
                if raised_at is not None:  # some rank's code raised and the others wait for it
                    return replies
                waiting = sorted(ranks - replies.keys())
                seconds = max(STARTUP_TIMEOUT, self.task_timeout) if hang_hint else self.task_timeout
                if hang_hint:
                    raise PoolFailure(f"no result after {seconds:g} s while {doing}: {hang_hint}") from None
                if len(ranks) == 1:
                    raise PoolFailure(f"no result after {self.task_timeout:g} s while {doing}: an endless loop, "
                                      "or a call that waits forever?") from None
                raise PoolFailure(f"no result after {self.task_timeout:g} s while {doing}: likely a deadlock "
                                  f"(every rank waiting for another) or an endless loop; rank(s) "
                                  f"{', '.join(map(str, waiting))} never replied") from None
            if kind == "reply" and index in ranks:
                replies[index] = data
                cases = data[0].get("cases")
                if raised_at is None and isinstance(cases, list) and any(
                        isinstance(c, dict) and "error" in c for c in cases):
                    raised_at = time.monotonic()
            elif kind == "garbled":
                raise PoolFailure(f"a process sent back something unreadable while {doing} ({data[:200]})")
            elif kind == "exit":
                time.sleep(0.2)  # let the drain thread read the last words
                tail = self._tail(index)
                who = f"the process of rank {index}" if self.size > 1 else "the verdict process"
                raise PoolFailure(f"{who} exited while {doing}"
                                  + (f"; its last output:\n{tail}" if tail else ""))
        return replies

    # -------------------------------------------------------------- tasks

    @staticmethod
    def _write(stream, header, payload, close=False):
        """Write one frame without ever blocking the checker on a stuck process."""
        def write():
            try:
                wire.write_frame(stream, header, payload)
                if close:
                    stream.close()
            except (OSError, ValueError):
                pass  # it died: its reader reports that
        threading.Thread(target=write, daemon=True).start()

    def run(self, frames: dict, doing: str) -> dict:
        """Send frames[rank] = (header, payload) to those ranks; return {rank: reply frame}."""
        for index, (header, payload) in frames.items():
            self._write(self.commands[index], header, payload)
        return self._collect(frames, time.monotonic() + self.task_timeout, doing)

    def kill(self):
        """Kill the first process and every rank (with anything they started); close our pipe ends."""
        if self.proc is not None:  # the first process leads a session its ranks stay in (unless they leave it:
            # then they are its descendants, or, orphaned, the checker's, which kills all it has when it ends)
            kill_tree(self.proc.pid, self.proc.poll() is None, (self.proc.pid,), self.started)
            self.proc.wait()
        for stream in self.commands + self.results + self.outputs:
            try:
                stream.close()
            except OSError:
                pass
        self.proc = None


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
        frames[rank] = ({"part": grade_id, "world_size": n, "rank": rank, "prefix": prefix,
                         "timeout": task_timeout, "cases": headers}, payload)
    return frames


def _failed(what, problems) -> tuple:
    problems = list(dict.fromkeys(problems))  # every rank raising the same error says it once
    more = f"\n  … and {len(problems) - MAX_PROBLEMS} more" if len(problems) > MAX_PROBLEMS else ""
    return False, f"✗ {what}:\n  " + "\n  ".join(problems[:MAX_PROBLEMS]) + more


def judge_on_ranks(grade_id, spec: OnRanks, pool_for, rng, counter, task_timeout):
    """(passed, message) for a distributed part: every case at every world size, until the first failure."""
    for n in spec.world_sizes:
        cases = spec.cases(n, rng)
        try:
            replies = pool_for(n).run(_frames(grade_id, n, cases, f"task{next(counter)}", task_timeout),
                                      f"running {spec.what} at N={n}")
        except PoolFailure as failure:
            pool_for(None)  # kill it: the next part gets a fresh pool
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


def judge_in_process(grade_id, spec: InProcess, pool_for, rng):
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
            return False, f"✗ {spec.what}: {failure}"
        result = _results(replies[0][0].get("cases"), 1, on_ranks=False)[0]
        problems = [_error_line(case.label, result.error, case.label)] if result.error else spec.judge(case, result)
        if problems:
            return _failed(spec.what, problems)
    return True, f"✓ {spec.what}: {spec.summary}"


def log(line):
    """The grader keeps the checker's stderr in logs/<student>__<lab>.log."""
    print(f"[verdicts] {line}", file=sys.stderr, flush=True)


def check(job: dict) -> dict:
    """Judge every part of one submission; returns the verdicts (see the module docstring)."""
    verdicts = load_module(job["verdicts"])
    task_timeout = float(job["task_timeout"])
    specs = {grade_id: verdicts.PARTS[grade_id] for grade_id in job["parts"]}
    size = max([max(s.world_sizes) for s in specs.values() if isinstance(s, OnRanks)] + [1])
    distributed = any(isinstance(s, OnRanks) for s in specs.values())
    store = None
    if distributed:
        import torch.distributed as dist
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=max(task_timeout, 30)))
    cells = [list(cell) for cell in job["cells"]]
    leading = next((i for i, (label, _) in enumerate(cells) if label.startswith("<solution")), len(cells))
    setup = {"verdicts": job["verdicts"], "cells": cells, "leading": leading, "timeout": task_timeout,
             "store_port": store.port if store else None}
    env = child_environment(os.environ.get("TMPDIR", "/tmp"), OMP_NUM_THREADS=1, OPENBLAS_NUM_THREADS=1,
                            MKL_NUM_THREADS=1, MPLBACKEND="Agg", COURSE_OUTPUT="grouped")
    state = {"pool": None, "failure": None}
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
                state["pool"] = Pool(size, setup, task_timeout, env, os.getcwd())
            except PoolFailure as failure:
                state["failure"] = failure
                raise
            cell_errors.update(state["pool"].cell_errors)
            log(f"started {size} verdict process(es) in {time.monotonic() - started:.1f} s")
        return state["pool"]

    # Shapes and lengths depend on the submission only: the same submission meets the same cases at every grading
    # (firm points), another submission other ones. Values stay unpredictable (os.urandom in the verdicts).
    rng = random.Random(hashlib.sha256(json.dumps(job["cells"]).encode()).digest())
    counter = iter(range(1, 1 << 30))
    parts = {}
    try:
        for grade_id, spec in specs.items():
            started = time.monotonic()
            if isinstance(spec, OnRanks):
                passed, message = judge_on_ranks(grade_id, spec, pool_for, rng, counter, task_timeout)
            else:
                passed, message = judge_in_process(grade_id, spec, pool_for, rng)
            parts[grade_id] = {"passed": passed, "message": message}
            log(f"{grade_id}: {'passed' if passed else 'failed'} in {time.monotonic() - started:.1f} s")
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
        result = check(job)
        sys.stdout.write(json.dumps(result, allow_nan=True))
        sys.stdout.flush()
        return 0
    finally:
        kill_descendants()


if __name__ == "__main__":
    sys.exit(main())
