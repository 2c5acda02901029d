"""Grading many submissions: each one prepared, judged by its verdicts, run for feedback; then the reports."""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ..release import LabFormatError, names_used, nbgrader_meta, read_notebook, solution_functions, write_notebook
from . import __doc__ as PACKAGE_DOC  # noqa: N812
from .preparation import prepare
from .processes import (REPO_ROOT, child_environment, exit_on_signals, kill_tree, make_undumpable,
                        short_temporary_folder)
from .reports import Outcome, num, safe_name, write_reports
from .submissions import MAX_NOTEBOOK_BYTES, find_submissions, load_labs
from .verdicts import InProcess, VerdictError, load_module

DEFAULT_TIMEOUT = 600.0          # seconds for each of a submission's two runs (verdicts; feedback notebook)
DEFAULT_CELL_TIMEOUT = 300.0     # seconds per notebook cell; a cell that runs longer is interrupted and fails
DEFAULT_VERDICT_TIMEOUT = 60.0   # seconds per verdict step (one part at one world size); longer fails the part
DEFAULT_MAX_OUTPUT = 1 << 20     # bytes one notebook cell may print
LOG_BYTES = 64 << 10             # bytes of each child's own output kept in logs/ per submission
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

    def __init__(self, submission, lab, out_dir, limits: Limits):
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
        self.log.add(b"[grader: verdicts]\n")
        self.phase_start = time.monotonic()
        self.child = _Child([sys.executable, "-m", "utils.tools.grade.checker"], self.judging,
                            child_environment(self.temp), self.log, stdin=json.dumps(job).encode(), keep=VERDICT_BYTES)

    def _start_feedback(self):
        notebook = self.work / f"{self.lab.name}.ipynb"
        write_notebook(self.prepared.notebook, notebook)
        env = child_environment(self.temp, COURSE_OUTPUT="grouped", JUPYTER_PLATFORM_DIRS="1",
                                JUPYTER_RUNTIME_DIR=self.private / "runtime")
        command = [sys.executable, "-m", "utils.tools.grade.notebook", str(notebook),
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
        if self.phase != "feedback":
            return []
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
            if timed_out:
                self.outcome.verdicts = "timeout"
            else:
                try:
                    self.verdict_answer = json.loads(bytes(self.child.kept))
                    if not isinstance(self.verdict_answer.get("parts"), dict):
                        raise ValueError("no parts")
                except (ValueError, AttributeError):
                    self.verdict_answer = {}
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
        elif results.get("kernel_died_in_cell") is not None:
            self.outcome.status = "kernel died"
        elif self.child.proc.returncode != 0 or not results.get("finished"):
            self.outcome.status = "grader error"
        self.phase = "done"

    def _notebook_results(self) -> dict:
        try:
            return json.loads((self.private / "result.json").read_text())
        except (OSError, ValueError):
            return {}

    # -------------------------------------------------------------- the outcome

    def finish(self) -> Outcome:
        """Score, save the executed notebook and the log; remove the private folder."""
        outcome = self.outcome
        outcome.seconds = time.monotonic() - self.start
        outcome.scores = self._scores()
        if self.prepared is not None:
            results = self._notebook_results().get("cells", {})
            for index, cell in enumerate(self.prepared.notebook.cells):
                grade_id = nbgrader_meta(cell).get("grade_id")
                if grade_id and str(index) in results:
                    status, message = results[str(index)]["status"], results[str(index)]["message"]
                    if status == "timeout":
                        running = student_functions_called(cell.source, self.prepared.notebook)
                        if running:
                            message += f" (it was running your {', '.join(running)})"
                    outcome.checks[grade_id] = (status, message)
        name = f"{safe_name(outcome.student)}/{safe_name(outcome.lab)}"
        executed = self.private / "executed.ipynb"
        if executed.exists():
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
        reason = {"timeout": f"not judged: the verdicts reached their time limit ({self.limits.timeout:g} s)",
                  "grader error": "not judged: the grader's verdict step failed (see logs/)",
                  "not run": "not judged: the notebook could not be read",
                  "judged": "not judged"}[self.outcome.verdicts]
        scores = []
        for grade_id, points in self.lab.parts:
            verdict = parts.get(grade_id)
            if isinstance(verdict, dict) and isinstance(verdict.get("message"), str):
                passed = verdict.get("passed") is True
                scores.append((grade_id, points if passed else 0, points, verdict["message"][:5000]))
            else:
                scores.append((grade_id, 0, points, reason))
        return scores


def student_functions_called(source: str, notebook) -> list:
    """The names of the notebook's solution-cell functions (and classes) that `source` mentions, in order."""
    defined = solution_functions(notebook)
    return [name for name in names_used(source) if name in defined]


# ------------------------------------------------------------------ grading many

def grade(submissions: list, labs: dict, out_dir, limits: Limits = None, jobs=1, log=print) -> list:
    """Grade each submission (at most `jobs` at a time); return their Outcomes in the given order."""
    limits = limits or Limits()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    pending = list(enumerate(submissions))
    running, outcomes = [], [None] * len(submissions)
    try:
        while pending or running:
            while pending and len(running) < jobs:
                index, sub = pending.pop(0)
                running.append((index, Job(sub, labs[sub.lab], out_dir, limits)))
            for item in list(running):
                index, job = item
                if job.poll():
                    running.remove(item)
                    outcome = outcomes[index] = job.finish()
                    log(f"{outcome.student:>16}  {outcome.lab:<24} {num(outcome.points):>5}/{num(outcome.max_points):<5}"
                        f" {outcome.status:<12} {outcome.seconds:6.1f} s")
            time.sleep(0.05)
    finally:  # interrupted (Ctrl-C): leave nothing running
        for _, job in running:
            job.abort()
    return outcomes


# ------------------------------------------------------------------ command line

def print_parts(labs: dict) -> None:
    """Each lab's parts and points, how its verdicts run them, and which of its cells they run."""
    for lab in labs.values():
        module = load_module(lab.verdicts)
        try:
            shown = lab.verdicts.relative_to(Path.cwd())
        except ValueError:
            shown = lab.verdicts
        print(f"{lab.name}: {len(lab.parts)} parts, {num(lab.max_points)} points (verdicts: {shown})")
        for grade_id, points in lab.parts:
            spec = module.PARTS[grade_id]
            where = "in one process" if isinstance(spec, InProcess) else \
                f"on {', '.join(map(str, spec.world_sizes))} ranks"
            print(f"    {grade_id:<28} {num(points):>4}   {spec.what}, {where}")
        print(f"  verdicts run, from the lab's cells by cell id (each cell's \"id\" in the notebook file): "
              f"{', '.join(verdict_cells(lab)) or '(none)'}, then the solution cells")


def verdict_cells(lab) -> list:
    """The lab's cells the verdicts run, by cell id: 'a0c9d43b' (the whole cell: imports and definitions) or
    'a0c9d43b (definitions)' (a cell that also prints or launches: only its definitions)."""
    out = []
    for label, _ in prepare(lab.nb, lab).cells:
        if label.startswith("<lab cell "):
            number, _, rest = label.strip("<>").removeprefix("lab cell ").partition(",")
            cell = lab.nb.cells[int(number) - 1]
            out.append(f"{cell.get('id') or 'cell ' + number}{' (definitions)' if rest else ''}")
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m utils.tools.grade", description=PACKAGE_DOC.split("\n")[0])
    parser.add_argument("submissions", nargs="*", help="folders or .ipynb files to grade")
    parser.add_argument("--out", default="build/grades", help="report folder (default: build/grades)")
    parser.add_argument("--labs", default=None, help="folder of reference labs (default: ./labs, else the course's labs/)")
    parser.add_argument("--verdicts", default=None,
                        help="folder of the labs' verdict modules (default: utils/tools/grade/verdicts)")
    parser.add_argument("--student", default=None, help="owner of files not named <student>__<lab>.ipynb")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds for each of a submission's two runs, verdicts and notebook (default: the lab's "
                             "own limit, else 600)")
    parser.add_argument("--cell-timeout", type=float, default=None,
                        help="seconds per notebook cell (default: the lab's own limit, else 300)")
    parser.add_argument("--verdict-timeout", type=float, default=None,
                        help="seconds per verdict step, one part at one world size (default: the lab's own limit, "
                             "else 60)")
    parser.add_argument("--max-output", type=int, default=DEFAULT_MAX_OUTPUT,
                        help="bytes a notebook cell may print (default 1 MiB)")
    parser.add_argument("--jobs", type=int, default=1, help="submissions graded at once (default 1)")
    parser.add_argument("--parts", action="store_true", help="list the labs' parts and points, grade nothing")
    parser.add_argument("--merge", action="store_true",
                        help="regrade: replace only these submissions' rows in --out's gradebook, keep everyone else's "
                             "rows and feedback")
    parser.add_argument("--roster", default=None,
                        help="CSV of id, name, email (ids as the LMS names them) for the gradebook")
    args = parser.parse_args(argv)
    for name in ("timeout", "cell_timeout", "verdict_timeout", "max_output", "jobs"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")

    labs_dir = Path(args.labs) if args.labs else (Path("labs") if Path("labs").is_dir() else REPO_ROOT / "labs")
    if not labs_dir.is_dir():
        parser.error(f"{labs_dir} is not a folder of labs")
    if args.verdicts and not Path(args.verdicts).is_dir():
        parser.error(f"--verdicts {args.verdicts} is not a folder")
    try:
        labs = load_labs(labs_dir, args.verdicts)
    except (LabFormatError, VerdictError) as error:
        print(f"grading stopped: {error}", file=sys.stderr)
        return 1
    if not labs:
        print(f"no lab notebooks in {labs_dir}", file=sys.stderr)
        return 1
    if args.parts:
        print_parts(labs)
        return 0
    if not args.submissions:
        parser.error("give a folder of submissions (make grade SUBMISSIONS=dir)")
    if Path(args.out).exists() and not Path(args.out).is_dir():
        parser.error(f"--out {args.out} exists and is not a folder")
    if args.roster and not Path(args.roster).is_file():
        parser.error(f"--roster {args.roster} is not a file")
    unpacked = short_temporary_folder("grade-archives-")  # .zip exports are unpacked here, removed at the end
    try:
        return _grade_found(args, labs, labs_dir, unpacked)
    finally:
        shutil.rmtree(unpacked, ignore_errors=True)


def _grade_found(args, labs, labs_dir, unpacked) -> int:
    from .reports import read_roster

    submissions, problems = find_submissions(args.submissions, labs, args.student, unpack_into=unpacked)
    for problem in problems:
        print(f"warning: {problem}", file=sys.stderr)
    if not submissions:
        print("no submissions to grade", file=sys.stderr)
        return 1
    limits = Limits(args.timeout, args.cell_timeout, args.verdict_timeout, args.max_output)
    for name in sorted({s.lab for s in submissions}):
        own = limits.for_lab(labs[name])
        print(f"grading {sum(s.lab == name for s in submissions)} submissions of {name} against {labs_dir} (limits: "
              f"{own.timeout:g} s per run, {own.cell_timeout:g} s per cell, {own.verdict_timeout:g} s per verdict step)")
    make_undumpable()  # the processes running student code are our descendants: keep them out of our memory
    exit_on_signals()  # SIGTERM and SIGHUP clean up like Ctrl-C
    try:
        outcomes = grade(submissions, labs, args.out, limits, args.jobs)
    except KeyboardInterrupt:
        print("grading interrupted: every process it started is stopped; no reports written", file=sys.stderr)
        return 130
    write_reports(outcomes, args.out, problems, merge=args.merge,
                  roster=read_roster(args.roster) if args.roster else None)
    print(f"wrote {Path(args.out) / 'gradebook.csv'}, grades.csv, summary.csv, feedback/ ({len(outcomes)} submissions"
          f"{', merged into the previous reports' if args.merge else ''})")
    return 0
