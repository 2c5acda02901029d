"""One submission's grading: prepared here, judged by the verdict checker, then its notebook run for feedback.

Both runs that execute the submission's code do it in the submission's sandbox (utils/tools/grade/sandbox.py)
when the grader has one: the checker itself runs here (it runs no student code) and starts its verdict processes
in the sandbox; the feedback worker and its kernel run in it. Everything the sandbox wrote (result.json, the
executed notebook) is read as untrusted input.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ..release import names_used, nbgrader_meta, read_notebook, solution_functions, write_notebook
from .preparation import prepare
from .processes import child_environment, kill_tree, short_temporary_folder
from .reports import Outcome, safe_name
from .submissions import MAX_NOTEBOOK_BYTES

DEFAULT_TIMEOUT = 600.0          # seconds for each of a submission's two runs (verdicts; feedback notebook)
DEFAULT_CELL_TIMEOUT = 300.0     # seconds per notebook cell; a cell that runs longer is interrupted and fails
DEFAULT_VERDICT_TIMEOUT = 60.0   # seconds per verdict step (one part at one world size); longer fails the part
DEFAULT_MAX_OUTPUT = 1 << 20     # bytes one notebook cell may print
LOG_BYTES = 64 << 10             # bytes of each child's own output kept in logs/ per submission
EXECUTED_BYTES = 64 << 20        # bytes of an executed notebook copied to the reports at most
VERDICT_BYTES = 4 << 20          # bytes of the checker's answer read at most


@dataclass
class Limits:
    """A field set to None takes the lab's own limit (its verdict module's LIMITS or its notebook's "grading"
    metadata: submissions.lab_limits), else the default above."""
    timeout: float | None = DEFAULT_TIMEOUT
    cell_timeout: float | None = DEFAULT_CELL_TIMEOUT
    verdict_timeout: float | None = DEFAULT_VERDICT_TIMEOUT
    max_output: int = DEFAULT_MAX_OUTPUT

    def for_lab(self, lab) -> "Limits":
        own = getattr(lab, "limits", {}) or {}
        defaults = {"timeout": DEFAULT_TIMEOUT, "cell_timeout": DEFAULT_CELL_TIMEOUT,
                    "verdict_timeout": DEFAULT_VERDICT_TIMEOUT}
        return Limits(**{name: getattr(self, name) if getattr(self, name) is not None else own.get(name, default)
                         for name, default in defaults.items()}, max_output=self.max_output)


class _Child:
    """A grader child in its own session, its output drained by threads: stdout kept (up to `keep` bytes) or
    logged, stderr logged, the log capped."""

    def __init__(self, command, cwd, env, log, stdin: bytes | None = None, keep: int = 0):
        self.log, self.keep, self.kept = log, keep, bytearray()
        self.proc = subprocess.Popen(command, cwd=cwd, env=env,
                                     stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE if keep else subprocess.STDOUT,
                                     start_new_session=True)
        self.threads = [threading.Thread(target=self._drain, args=(self.proc.stdout, bool(keep)), daemon=True)]
        if keep:
            self.threads.append(threading.Thread(target=self._drain, args=(self.proc.stderr, False), daemon=True))
        if stdin is not None:
            self.threads.append(threading.Thread(target=self._feed, args=(stdin,), daemon=True))
        for thread in self.threads:
            thread.start()

    def _feed(self, data):
        try:
            self.proc.stdin.write(data)
            self.proc.stdin.close()
        except OSError:
            pass

    def _drain(self, stream, keep):
        while chunk := stream.read1(1 << 16):
            if keep:
                self.kept += chunk[:max(0, self.keep - len(self.kept))]
            else:
                self.log.add(chunk)

    def join(self):
        for thread in self.threads:
            thread.join(timeout=5)


class _Log:
    """The grader's own log of one submission, capped."""

    def __init__(self):
        self.data, self.total = bytearray(), 0

    def add(self, chunk):
        self.total += len(chunk)
        if len(self.data) < LOG_BYTES:
            self.data += chunk[:LOG_BYTES - len(self.data)]

    def text(self) -> bytes:
        dropped = self.total - len(self.data)
        tail = f"\n[grader: {dropped} more bytes of output dropped]\n".encode() if dropped > 0 else b""
        return bytes(self.data) + tail


class Job:
    """One submission: prepared here, then judged by the verdict checker, then its notebook run for feedback
    (two child processes, one after the other, each in its own session, each within `timeout`)."""

    def __init__(self, submission, lab, out_dir, limits: Limits, sandbox=None):
        self.submission, self.lab, self.out_dir, self.limits = submission, lab, Path(out_dir), limits.for_lab(lab)
        self.outcome = Outcome(submission.student, lab.name, submission.path, lab_note=lab.note,
                               name=getattr(submission, "name", ""), lms_id=getattr(submission, "lms_id", ""),
                               late=getattr(submission, "late", False))
        if getattr(submission, "note", ""):
            self.outcome.notes.append(submission.note)
        self.start, self.started_at = time.monotonic(), time.time()
        self.tmp = short_temporary_folder("grade-")
        self.work, self.private, self.temp, self.judging = (self.tmp / n for n in ("work", "grader", "tmp", "verdicts"))
        for folder in (self.work, self.private, self.temp, self.judging):
            folder.mkdir()
        self.view = sandbox.view(self.tmp) if sandbox is not None else None  # the submission's own sandbox
        self.log, self.child, self.phase, self.verdict_answer = _Log(), None, "verdicts", {}
        self.prepared = None
        try:
            if submission.path.stat().st_size > MAX_NOTEBOOK_BYTES:
                raise ValueError(f"file larger than {MAX_NOTEBOOK_BYTES >> 20} MiB")
            self.prepared = prepare(read_notebook(submission.path), lab)
        except Exception as error:
            self.outcome.status, self.outcome.verdicts, self.phase = "unreadable", "not run", "done"
            too_big = submission.path.exists() and submission.path.stat().st_size > MAX_NOTEBOOK_BYTES
            self.outcome.notes.append(f"the file is larger than {MAX_NOTEBOOK_BYTES >> 20} MiB — please resubmit"
                                      if too_big else "the file is not a notebook — please resubmit")
            self.log.add(f"[grader: could not read the notebook: {type(error).__name__}: {error}]\n"[:500].encode())
            return
        self.outcome.notes.extend(self.prepared.notes)
        try:
            self._start_verdicts()
        except BaseException:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise

    # -------------------------------------------------------------- the two runs

    def _start_verdicts(self):
        job = {"verdicts": str(self.lab.verdicts), "cells": self.prepared.cells,
               "parts": [grade_id for grade_id, _ in self.lab.parts],
               "task_timeout": self.limits.verdict_timeout}
        if self.view is not None:
            job["sandbox"] = {"prefix": self.view.prefix, "env": self.view.env}
        self.log.add(b"[grader: verdicts]\n")
        self.phase_start = time.monotonic()
        self.child = _Child([sys.executable, "-m", "utils.tools.grade.checker"], self.judging,
                            child_environment(self.temp), self.log, stdin=json.dumps(job).encode(), keep=VERDICT_BYTES)

    def _start_feedback(self):
        notebook = self.work / f"{self.lab.name}.ipynb"
        write_notebook(self.prepared.notebook, notebook)
        env = child_environment(self.temp, COURSE_OUTPUT="grouped", JUPYTER_PLATFORM_DIRS="1",
                                JUPYTER_RUNTIME_DIR=self.private / "runtime",
                                **(self.view.env if self.view is not None else {}))
        command = [*(self.view.prefix if self.view is not None else []), sys.executable, "-m", "utils.tools.grade.notebook", str(notebook),
                   "--result", str(self.private / "result.json"), "--executed", str(self.private / "executed.ipynb"),
                   "--cell-timeout", str(self.limits.cell_timeout), "--max-output", str(self.limits.max_output),
                   "--sockets", str(self.tmp)]
        self.log.add(b"[grader: feedback notebook]\n")
        self.phase_start = time.monotonic()
        self.child = _Child(command, self.work, env, self.log)

    def poll(self) -> bool:
        """True once both runs are over (finished or killed at their time limit)."""
        if self.phase == "done":
            return True
        if self.child.proc.poll() is not None:
            self._end_phase(timed_out=False)
        elif time.monotonic() - self.phase_start > self.limits.timeout:
            self._kill(alive=True)
            self._end_phase(timed_out=True)
        return self.phase == "done"

    def _sessions(self):
        if self.phase != "feedback" or self.view is not None:  # in a sandbox the kernel's pid is the sandbox's
            return []                                           # own; its process namespace dies with it
        kernel = self._notebook_results().get("kernel_pid")
        return [kernel] if kernel else []

    def _kill(self, alive):
        if self.child is not None:
            kill_tree(self.child.proc.pid, alive and self.child.proc.poll() is None, self._sessions(), self.started_at)
            self.child.proc.wait()

    def _end_phase(self, timed_out):
        self._kill(alive=False)  # anything left behind
        self.child.join()
        self.log.add(f"[grader: {self.phase} {'stopped at the time limit' if timed_out else 'done'} after "
                     f"{time.monotonic() - self.phase_start:.1f} s]\n".encode())
        if self.phase == "verdicts":
            self.verdict_answer = verdict_lines(bytes(self.child.kept))
            if timed_out:  # the parts judged before the limit keep their verdicts
                self.outcome.verdicts = "timeout"
            elif "cell_errors" not in self.verdict_answer:
                self.outcome.verdicts = "grader error"
            errors = self.verdict_answer.get("cell_errors") or {}
            for label, error in list(errors.items())[:10]:
                self.outcome.notes.append(f"{label} raised when the verdicts ran it: {str(error)[:300]}")
            self.phase = "feedback"
            self._start_feedback()
            return
        results = self._notebook_results()
        if timed_out:
            self.outcome.status = "timeout"
        elif results.get("kernel_died_in_cell") not in (None, False):
            self.outcome.status = "kernel died"
        elif self.child.proc.returncode != 0 or not results.get("finished"):
            self.outcome.status = "grader error"
        self.phase = "done"

    def _notebook_results(self) -> dict:
        """The feedback run's result.json (written in the sandbox: read as untrusted input)."""
        try:
            path = self.private / "result.json"
            if path.is_symlink() or path.stat().st_size > VERDICT_BYTES:
                return {}
            results = json.loads(path.read_text())
        except (OSError, ValueError, RecursionError):
            return {}
        return results if isinstance(results, dict) else {}

    # -------------------------------------------------------------- the outcome

    def finish(self) -> Outcome:
        """Score, save the executed notebook and the log; remove the private folder."""
        outcome = self.outcome
        outcome.seconds = time.monotonic() - self.start
        outcome.scores = self._scores()
        if self.prepared is not None:
            results = self._notebook_results().get("cells", {})
            results = results if isinstance(results, dict) else {}
            for index, cell in enumerate(self.prepared.notebook.cells):
                grade_id = nbgrader_meta(cell).get("grade_id")
                result = results.get(str(index))
                if grade_id and isinstance(result, dict):
                    status, message = str(result.get("status"))[:50], str(result.get("message"))[:5000]
                    if status == "timeout":
                        running = student_functions_called(cell.source, self.prepared.notebook)
                        if running:
                            message += f" (it was running your {', '.join(running)})"
                    outcome.checks[grade_id] = (status, message)
        name = f"{safe_name(outcome.student)}/{safe_name(outcome.lab)}"
        executed = self.private / "executed.ipynb"
        if executed.is_file() and not executed.is_symlink() and executed.stat().st_size <= EXECUTED_BYTES:
            (self.out_dir / "executed" / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(executed, self.out_dir / "executed" / f"{name}.ipynb")
        (self.out_dir / "logs").mkdir(parents=True, exist_ok=True)
        (self.out_dir / "logs" / f"{safe_name(outcome.student)}__{safe_name(outcome.lab)}.log").write_bytes(
            self.log.text())
        shutil.rmtree(self.tmp, ignore_errors=True)
        return outcome

    def abort(self):
        """Interrupted: kill whatever runs, remove the private folder."""
        if self.child is not None:
            self._kill(alive=True)
        shutil.rmtree(self.tmp, ignore_errors=True)

    def _scores(self) -> list:
        parts = self.verdict_answer.get("parts") or {}
        reason = {"timeout": f"not graded: ran out of time (the verdicts reached their limit of "
                             f"{self.limits.timeout:g} s for the whole submission)",
                  "grader error": "not judged: the grader's verdict step failed (see logs/)",
                  "not run": "not judged: the notebook could not be read",
                  "judged": "not judged"}[self.outcome.verdicts]
        scores = []
        for grade_id, points in self.lab.parts:
            verdict = parts.get(grade_id)
            if isinstance(verdict, dict) and isinstance(verdict.get("message"), str):
                passed = verdict.get("passed") is True
                earned = None if verdict.get("out_of_time") is True else points if passed else 0
                scores.append((grade_id, earned, points, verdict["message"][:5000]))
            else:  # ran out of time: no points recorded, never 0 (reports.py lists it for a regrade)
                scores.append((grade_id, None if self.outcome.verdicts == "timeout" else 0, points, reason))
        return scores


def verdict_lines(output: bytes) -> dict:
    """The checker's answer: {"parts": {grade_id: verdict}} from its per-part lines, and with its last line
    ({"parts", "cell_errors"}) where it finished."""
    answer = {"parts": {}}
    for line in output.splitlines():
        try:
            item = json.loads(line)
        except ValueError:
            continue
        if not isinstance(item, dict):
            continue
        if isinstance(item.get("part"), str) and isinstance(item.get("verdict"), dict):
            answer["parts"][item["part"]] = item["verdict"]
        elif isinstance(item.get("parts"), dict):
            answer = {"parts": {**answer["parts"], **item["parts"]},
                      "cell_errors": item.get("cell_errors") if isinstance(item.get("cell_errors"), dict) else {}}
    return answer


def student_functions_called(source: str, notebook) -> list:
    """The names of the notebook's solution-cell functions (and classes) that `source` mentions, in order."""
    defined = solution_functions(notebook)
    return [name for name in names_used(source) if name in defined]


