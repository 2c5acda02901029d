"""Autograde submitted lab notebooks: hidden checks restored, each run isolated and time-limited.

    python -m utils.tools.grade SUBMISSIONS --out build/grades        (what `make grade SUBMISSIONS=dir` runs)
    python -m utils.tools.grade --parts labs                          (list every lab's parts and points)

SUBMISSIONS is a folder (or notebook files) laid out in either way, mixed freely:
    SUBMISSIONS/<student>/<lab>.ipynb        e.g. submitted/ada/lab1_collectives.ipynb
    SUBMISSIONS/<student>__<lab>.ipynb       e.g. submitted/ada__lab1_collectives.ipynb
Deeper folders (nbgrader's submitted/<student>/<assignment>/<lab>.ipynb) count the first folder as the
student. A file whose name is not a lab's name (e.g. "lab1_collectives (1).ipynb") is matched to the lab
whose grade_ids it carries.

For each submission the grader
  1. restores every graded test cell (and every locked cell) from the reference lab by grade_id, hidden
     checks included, as nbgrader does; a deleted test cell is put back where it was;
  2. runs the notebook in a fresh working folder, in its own process (`--run-one`, a new session), on a
     fresh kernel, every cell even after a failing one, each cell under a time limit;
  3. kills the whole process tree (worker, kernel, rank processes) when the submission's time is up;
  4. caps what a cell may print (a cell printing more fails) and what the worker's log keeps;
  5. scores each graded test cell: its points when it ran without raising, else 0.
Outputs in --out: grades.csv (student, lab, part, points, max), summary.csv (one line per submission,
with its status and grading time), feedback/<student>.txt, executed/<student>/<lab>.ipynb, logs/.

This isolates submissions from each other; it is not a sandbox. Student code runs with your user's
rights: grade untrusted submissions inside a container or VM (see INSTRUCTORS.md).
"""

from __future__ import annotations

import argparse
import copy
import csv
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

from .release import (LabFormatError, check_lab, clear_notebook_run, clear_run, is_graded_test_cell,
                      is_solution_cell, lab_notebooks, nbgrader_meta, read_notebook, student_source,
                      write_notebook)

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TIMEOUT = 600.0        # seconds per submission, kernel start included
DEFAULT_CELL_TIMEOUT = 300.0   # seconds per cell; a cell that runs longer is interrupted and fails
DEFAULT_MAX_OUTPUT = 1 << 20   # bytes one cell may print; a cell printing more is stopped and fails
LOG_BYTES = 64 << 10           # bytes of the worker's own stdout/stderr kept per submission
MAX_NOTEBOOK_BYTES = 50 << 20  # a submitted file larger than this is not read
TIMEOUT_ENAME = "CellTimeout"
# Grading inside a torchrun/SLURM job must not make the lab's utils.launch think it is one of its ranks.
_RANK_ENVIRONMENT = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                     "MASTER_ADDR", "MASTER_PORT", "COURSE_LAUNCHED_RANK"}


# ------------------------------------------------------------------ labs and submissions

@dataclass
class Lab:
    """A reference lab: its notebook and its parts [(grade_id, points)] in notebook order."""
    name: str
    path: Path
    nb: nbformat.NotebookNode
    parts: list

    @property
    def max_points(self):
        return sum(points for _, points in self.parts)


def load_labs(labs_dir) -> dict:
    """Every reference lab in labs_dir by name (the file stem); raises LabFormatError on a bad lab."""
    labs = {}
    for path in lab_notebooks(labs_dir):
        nb = read_notebook(path)
        labs[path.stem] = Lab(path.stem, path, nb, check_lab(nb, path.name))
    return labs


@dataclass
class Submission:
    student: str
    lab: str | None     # None: no lab matched
    path: Path


def _grade_ids(path) -> set:
    try:
        if path.stat().st_size > MAX_NOTEBOOK_BYTES:
            return set()
        nb = read_notebook(path)
    except Exception:
        return set()
    return {nbgrader_meta(c).get("grade_id") for c in nb.cells} - {None}


def _match_lab(stem: str, path: Path, labs: dict) -> str | None:
    if stem in labs:
        return stem
    ids = _grade_ids(path)  # a renamed copy still carries the lab's grade_ids
    overlap = {name: len(ids & {nbgrader_meta(c).get("grade_id") for c in lab.nb.cells}) for name, lab in labs.items()}
    best = max(overlap.values(), default=0)
    winners = [name for name, n in overlap.items() if n == best]
    return winners[0] if best > 0 and len(winners) == 1 else None


def find_submissions(paths, labs: dict, student: str | None = None) -> tuple[list, list]:
    """Submissions found under paths (folders or .ipynb files), and problems to report.

    A file right inside a given folder (or given itself) must be named <student>__<lab>.ipynb unless
    `student` names its owner (e.g. student="reference" to grade the reference labs themselves).
    """
    found, problems = [], []
    for root in map(Path, paths):
        if root.is_file():
            files, base = [root], root.parent
        elif root.is_dir():
            files = sorted(p for p in root.rglob("*.ipynb")
                           if ".ipynb_checkpoints" not in p.parts and not p.name.startswith("."))
            base = root
        else:
            problems.append(f"{root}: no such file or folder")
            continue
        for path in files:
            relative = path.relative_to(base)
            if len(relative.parts) > 1:
                owner, stem = relative.parts[0], path.stem
            elif "__" in path.stem:
                owner, stem = path.stem.rsplit("__", 1)
            elif student:
                owner, stem = student, path.stem
            else:
                problems.append(f"{path}: cannot tell the student; name it <student>__<lab>.ipynb, "
                                "put it in a <student>/ folder, or pass --student")
                continue
            found.append(Submission(owner, _match_lab(stem, path, labs), path))
    graded, seen = [], {}
    for sub in found:
        if sub.lab is None:
            problems.append(f"{sub.path}: does not match any lab ({', '.join(labs)}); not graded")
            continue
        key = (sub.student, sub.lab)
        if key in seen:  # keep the file named exactly like the lab, else the first in sorted order
            kept = seen[key]
            if sub.path.stem == sub.lab and kept.path.stem != sub.lab:
                graded[graded.index(kept)] = sub
                kept, sub = sub, kept
                seen[key] = kept
            problems.append(f"{sub.path}: a second submission of {sub.lab} by {sub.student}; "
                            f"graded {kept.path.name} instead")
            continue
        seen[key] = sub
        graded.append(sub)
    return graded, problems


# ------------------------------------------------------------------ restoring the reference cells

def _restorable(cell) -> bool:
    """Cells the grader takes from the reference: graded test cells and other locked cells."""
    meta = nbgrader_meta(cell)
    return bool(meta.get("grade_id")) and not is_solution_cell(cell) and (
        is_graded_test_cell(cell) or bool(meta.get("locked")))


def _fresh(cell):
    cell = copy.deepcopy(cell)
    clear_run(cell)
    return cell


def prepare(submitted, lab: Lab) -> tuple:
    """The notebook to run: the submission with the reference's graded/locked cells put back.

    Returns (notebook, notes for the student).
    """
    reference = {nbgrader_meta(c)["grade_id"]: c for c in lab.nb.cells if _restorable(c)}
    # Which copy of a cell is the graded one when a student duplicated it: the one that kept the lab's
    # cell id (Jupyter gives a pasted copy a new id), else the first.
    chosen = {}
    for position, cell in enumerate(submitted.cells):
        grade_id = nbgrader_meta(cell).get("grade_id")
        if grade_id not in reference:
            continue
        lab_id = reference[grade_id].get("id")
        keeps_id = lab_id is not None and cell.get("id") == lab_id
        if grade_id not in chosen or (keeps_id and submitted.cells[chosen[grade_id]].get("id") != lab_id):
            chosen[grade_id] = position
    cells, placed, notes = [], set(), []
    for position, cell in enumerate(submitted.cells):
        grade_id = nbgrader_meta(cell).get("grade_id")
        if grade_id in reference and chosen[grade_id] == position:
            original = reference[grade_id]
            if cell.get("source", "") not in (student_source(original), original.source):
                notes.append(f"cell '{grade_id}' differed from the lab's; the lab's version was run")
            cells.append(_fresh(original))
            placed.add(grade_id)
        else:
            cell = _fresh(cell)
            if grade_id in reference:  # a copy of a test cell runs as ordinary code, unscored
                cell.metadata.pop("nbgrader", None)
            cells.append(cell)
    # Put back the cells a student deleted, after the nearest earlier cell both notebooks share.
    for index, original in enumerate(lab.nb.cells):
        grade_id = nbgrader_meta(original).get("grade_id")
        if grade_id not in reference or grade_id in placed:
            continue
        where = 0
        for earlier in reversed(lab.nb.cells[:index]):
            anchor = nbgrader_meta(earlier).get("grade_id")
            present = [i for i, c in enumerate(cells) if anchor and nbgrader_meta(c).get("grade_id") == anchor]
            if present:
                where = present[0] + 1
                break
        else:
            where = min(index, len(cells))
        cells.insert(where, _fresh(original))
        placed.add(grade_id)
        notes.append(f"cell '{grade_id}' was missing; the lab's version was put back")
    for i, cell in enumerate(cells):
        cell["id"] = f"cell-{i}"  # unique ids whatever the student copied
    prepared = nbformat.v4.new_notebook(metadata=copy.deepcopy(lab.nb.metadata))
    prepared.cells = cells
    clear_notebook_run(prepared)
    return prepared, notes


# ------------------------------------------------------------------ running one submission

def _session(pid):
    try:
        return os.getsid(pid)
    except (OSError, AttributeError):
        return None


def kill_tree(pid: int, alive: bool, sessions=(), since: float = 0.0) -> None:
    """SIGKILL a worker, its descendants, and every process in a session one of them leads.

    The kernel and the rank processes start sessions of their own, so killing one process group
    is not enough. alive=False: the worker has exited (its pid may be reused); only sessions are
    swept then. Only our user's processes started after `since` (epoch seconds) are touched, and
    never our own session.
    """
    import psutil

    ours, me, uid = _session(0), os.getpid(), os.getuid()
    for _ in range(5):  # repeat: a process may fork while we look
        procs = []
        if alive:
            try:
                root = psutil.Process(pid)
                procs = [root] + root.children(recursive=True)
            except psutil.Error:
                pass
        swept = ({_session(p.pid) for p in procs} | set(sessions) | {pid}) - {ours, None}
        for proc in psutil.process_iter(["uids", "create_time"]):
            info = proc.info
            if (proc not in procs and _session(proc.pid) in swept and info["uids"] and info["uids"].real == uid
                    and (info["create_time"] or 0) >= since - 1):
                procs.append(proc)
        procs = [p for p in procs if p.pid != me]
        if not procs:
            return
        for proc in procs:
            try:
                proc.send_signal(signal.SIGSTOP)  # freeze first, so nothing restarts what we kill
            except psutil.Error:
                pass
        for proc in procs:
            try:
                proc.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(procs, timeout=5)
        alive = False  # the worker is gone now; later rounds sweep sessions only


@dataclass
class Outcome:
    """What happened to one submission."""
    student: str
    lab: str
    path: Path
    status: str = "finished"   # finished | timeout | kernel died | unreadable | grader error
    seconds: float = 0.0
    scores: list = field(default_factory=list)   # [(grade_id, points, max, message)]
    notes: list = field(default_factory=list)

    @property
    def points(self):
        return sum(s[1] for s in self.scores)

    @property
    def max_points(self):
        return sum(s[2] for s in self.scores)


class _Running:
    """A worker process for one submission, with a thread draining its output (capped)."""

    def __init__(self, submission, lab, out_dir, timeout, cell_timeout, max_output):
        self.submission, self.lab, self.out_dir, self.timeout = submission, lab, Path(out_dir), timeout
        self.outcome = Outcome(submission.student, lab.name, submission.path)
        self.start = time.monotonic()
        self.started_at = time.time()
        self.proc = None
        self.tmp = Path(tempfile.mkdtemp(prefix="grade-"))
        self.work = self.tmp / "work"          # the submission's fresh working folder (its cwd)
        self.private = self.tmp / "grader"     # results and the executed copy, outside the cwd
        self.work.mkdir()
        self.private.mkdir()
        self.log = bytearray()
        self.log_total = 0
        try:
            if submission.path.stat().st_size > MAX_NOTEBOOK_BYTES:
                raise ValueError(f"file larger than {MAX_NOTEBOOK_BYTES >> 20} MiB")
            submitted = read_notebook(submission.path)
            self.prepared, notes = prepare(submitted, lab)
        except Exception as error:
            self.outcome.status = "unreadable"
            self.outcome.notes.append(f"could not read the notebook: {type(error).__name__}: {error}"[:500])
            return
        self.outcome.notes.extend(notes)
        notebook = self.work / f"{lab.name}.ipynb"
        write_notebook(self.prepared, notebook)
        env = {k: v for k, v in os.environ.items() if k not in _RANK_ENVIRONMENT and not k.startswith("TORCHELASTIC_")}
        env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
        env.update(PYTHONUNBUFFERED="1", COURSE_OUTPUT="grouped", JUPYTER_PLATFORM_DIRS="1",
                   JUPYTER_RUNTIME_DIR=str(self.private / "runtime"), PYDEVD_DISABLE_FILE_VALIDATION="1")
        command = [sys.executable, "-m", "utils.tools.grade", "--run-one", str(notebook),
                   "--result", str(self.private / "result.json"),
                   "--executed", str(self.private / "executed.ipynb"),
                   "--cell-timeout", str(cell_timeout), "--max-output", str(max_output)]
        self.proc = subprocess.Popen(command, cwd=self.work, env=env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.reader = threading.Thread(target=self._drain, daemon=True)
        self.reader.start()

    def _drain(self):
        while chunk := self.proc.stdout.read1(1 << 16):
            self.log_total += len(chunk)
            if len(self.log) < LOG_BYTES:
                self.log += chunk[:LOG_BYTES - len(self.log)]

    def poll(self) -> bool:
        """True once the worker is done (finished or killed for its time limit)."""
        if self.proc is None:
            return True
        if self.proc.poll() is not None:
            return True
        if time.monotonic() - self.start > self.timeout:
            self.outcome.status = "timeout"
            kill_tree(self.proc.pid, True, self._kernel_session(), self.started_at)
            self.proc.wait()
            return True
        return False

    def _results(self) -> dict:
        try:
            return json.loads((self.private / "result.json").read_text())
        except (OSError, ValueError):
            return {}

    def _kernel_session(self):
        kernel = self._results().get("kernel_pid")
        return [kernel] if kernel else []

    def finish(self) -> Outcome:
        """Sweep leftover processes, score, save the executed notebook and log; remove the work folder."""
        outcome = self.outcome
        outcome.seconds = time.monotonic() - self.start
        results = self._results()
        if self.proc is not None:
            kill_tree(self.proc.pid, False, self._kernel_session(), self.started_at)  # anything left behind
            self.reader.join(timeout=5)
            if outcome.status == "finished":
                if results.get("kernel_died_in_cell") is not None:
                    outcome.status = "kernel died"
                elif self.proc.returncode != 0 or not results.get("finished"):
                    outcome.status = "grader error"
        outcome.scores = self._score(results)
        name = f"{_safe(outcome.student)}/{_safe(outcome.lab)}"
        executed = self.private / "executed.ipynb"
        if executed.exists():
            (self.out_dir / "executed" / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(executed, self.out_dir / "executed" / f"{name}.ipynb")
        (self.out_dir / "logs").mkdir(parents=True, exist_ok=True)
        dropped = self.log_total - len(self.log)
        tail = f"\n[grader: {dropped} more bytes of worker output dropped]\n" if dropped > 0 else ""
        (self.out_dir / "logs" / f"{_safe(outcome.student)}__{_safe(outcome.lab)}.log").write_bytes(
            bytes(self.log) + tail.encode())
        shutil.rmtree(self.tmp, ignore_errors=True)
        return outcome

    def _cell_name(self, index) -> str:
        cell = self.prepared.cells[index]
        grade_id = nbgrader_meta(cell).get("grade_id")
        return f"cell {index + 1} of the notebook" + (f" ('{grade_id}')" if grade_id else "")

    def _score(self, results) -> list:
        cells = results.get("cells", {})
        died = results.get("kernel_died_in_cell")
        reasons = {
            "timeout": f"not run: the submission reached its time limit ({self.timeout:g} s)",
            "kernel died": f"not run: the kernel died in {self._cell_name(died)}" if died is not None else "not run",
            "unreadable": "not run: the notebook could not be read",
            "grader error": "not run: the grader's worker failed (see logs/)",
            "finished": "not run",
        }
        scores = []
        index_of = {}
        if self.outcome.status != "unreadable":
            index_of = {nbgrader_meta(c).get("grade_id"): i for i, c in enumerate(self.prepared.cells)}
        for grade_id, points in self.lab.parts:
            cell = cells.get(str(index_of.get(grade_id)))
            if cell is None:
                scores.append((grade_id, 0, points, reasons[self.outcome.status]))
            elif cell["status"] == "ok":
                scores.append((grade_id, points, points, ""))
            else:
                scores.append((grade_id, 0, points, cell["message"]))
        return scores


def _safe(name: str) -> str:
    return re.sub(r"[^\w.@+-]", "_", name) or "_"


# ------------------------------------------------------------------ grading many, and the reports

def grade(submissions: list, labs: dict, out_dir, timeout=DEFAULT_TIMEOUT, cell_timeout=DEFAULT_CELL_TIMEOUT,
          max_output=DEFAULT_MAX_OUTPUT, jobs=1, log=print) -> list:
    """Grade each submission (at most `jobs` at a time); return their Outcomes in the given order."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    pending = list(enumerate(submissions))
    running, outcomes = [], [None] * len(submissions)
    try:
        while pending or running:
            while pending and len(running) < jobs:
                index, sub = pending.pop(0)
                running.append((index, _Running(sub, labs[sub.lab], out_dir, timeout, cell_timeout, max_output)))
            for item in list(running):
                index, job = item
                if job.poll():
                    running.remove(item)
                    outcome = outcomes[index] = job.finish()
                    log(f"{outcome.student:>16}  {outcome.lab:<24} {_num(outcome.points):>5}/{_num(outcome.max_points):<5}"
                        f" {outcome.status:<12} {outcome.seconds:6.1f} s")
            time.sleep(0.05)
    finally:  # interrupted (Ctrl-C): leave no submission running
        for _, job in running:
            if job.proc is not None and job.proc.poll() is None:
                kill_tree(job.proc.pid, True, job._kernel_session(), job.started_at)
            shutil.rmtree(job.tmp, ignore_errors=True)
    return outcomes


def _num(x) -> str:
    return f"{x:g}"


def write_reports(outcomes: list, out_dir, problems=()) -> None:
    """grades.csv, summary.csv and feedback/<student>.txt (previous ones replaced)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "grades.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["student", "lab", "part", "points", "max"])
        for o in sorted(outcomes, key=lambda o: (o.student, o.lab)):
            for grade_id, points, most, _ in o.scores:
                writer.writerow([o.student, o.lab, grade_id, _num(points), _num(most)])
    with open(out_dir / "summary.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["student", "lab", "points", "max", "status", "seconds", "file"])
        for o in sorted(outcomes, key=lambda o: (o.student, o.lab)):
            writer.writerow([o.student, o.lab, _num(o.points), _num(o.max_points), o.status,
                             f"{o.seconds:.1f}", str(o.path)])
    feedback = out_dir / "feedback"
    shutil.rmtree(feedback, ignore_errors=True)
    feedback.mkdir()
    by_student = {}
    for o in outcomes:
        by_student.setdefault(o.student, []).append(o)
    for student, mine in by_student.items():
        (feedback / f"{_safe(student)}.txt").write_text(feedback_text(student, mine))
    if problems:
        (out_dir / "problems.txt").write_text("\n".join(problems) + "\n")
    elif (out_dir / "problems.txt").exists():
        (out_dir / "problems.txt").unlink()


def feedback_text(student: str, outcomes: list) -> str:
    """The text a student gets: per lab, each part's points and, for a lost part, why."""
    lines = [f"Feedback for {student}", ""]
    for o in sorted(outcomes, key=lambda o: o.lab):
        state = {"finished": "ran to the end", "timeout": "stopped at the time limit",
                 "kernel died": "the kernel died", "unreadable": "could not be read",
                 "grader error": "the grader failed"}[o.status]
        lines.append(f"{o.lab}: {_num(o.points)} / {_num(o.max_points)} points  ({o.path.name}; {state}; "
                     f"{o.seconds:.0f} s)")
        for note in o.notes:
            lines.append(f"  note: {note}")
        for grade_id, points, most, message in o.scores:
            mark = "✓" if points == most else "✗"
            lines.append(f"  {mark} {grade_id}: {_num(points)} / {_num(most)}")
            for line in message.splitlines()[:25]:
                lines.append(f"      {line}")
        lines.append("")
    return "\n".join(lines)


# ------------------------------------------------------------------ the worker (--run-one)

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def _become_subreaper():
    """Linux: orphans of the kernel's children stay our descendants, so the grader can find them."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except Exception:
        pass


def run_one(notebook, result_path, executed_path, cell_timeout, max_output) -> int:
    """Run every code cell of one prepared notebook; after each cell, record how it went.

    result.json: {"cells": {"<index>": {"status": ok|error|timeout|output-limit|crashed, "message"}},
    "kernel_pid", "kernel_died_in_cell", "finished"}, rewritten after every cell so a killed run
    still reports the cells it finished.
    """
    import asyncio

    import ipykernel.kernelspec
    from jupyter_client.kernelspec import KernelSpec, KernelSpecManager
    from jupyter_client.manager import AsyncKernelManager
    from jupyter_core.utils import ensure_async
    from nbclient import NotebookClient
    from nbclient.exceptions import DeadKernelError

    _become_subreaper()
    notebook = Path(notebook)
    nb = read_notebook(notebook)
    results = {"cells": {}, "kernel_pid": None, "kernel_died_in_cell": None, "finished": False}

    def save():
        partial = Path(result_path).with_suffix(".tmp")
        partial.write_text(json.dumps(results))
        os.replace(partial, result_path)
        write_notebook(nb, executed_path)

    class ThisPython(KernelSpecManager):
        """Always this interpreter's ipykernel, whatever kernelspecs the machine has."""
        def get_kernel_spec(self, kernel_name):
            return KernelSpec(resource_dir=ipykernel.kernelspec.RESOURCES, **ipykernel.kernelspec.get_kernel_dict())

    class Client(NotebookClient):
        """nbclient with a cap on what one cell may print."""
        printed, over, last_reply = 0, False, None

        def create_kernel_manager(self):
            self.km = AsyncKernelManager(kernel_name="python3", kernel_spec_manager=ThisPython())
            return self.km

        def output(self, outs, msg, display_id, cell_index):
            if msg["msg_type"] != "error":
                content = msg["content"]
                data = content.get("data") or {}
                self.printed += len(content.get("text", "")) + sum(len(str(v)) for v in data.values())
            if self.printed > max_output:
                if not self.over:
                    self.over = True
                    outs.append(nbformat.v4.new_output(
                        "stream", name="stderr", text=f"\n[grader: output stopped; this cell printed more "
                                                      f"than {max_output} bytes]\n"))
                    self.stopper = asyncio.ensure_future(ensure_async(self.km.interrupt_kernel()))
                return None
            return super().output(outs, msg, display_id, cell_index)

    def remember(cell, cell_index, execute_reply):
        client.last_reply = execute_reply

    client = Client(nb, timeout=int(cell_timeout), allow_errors=True, interrupt_on_timeout=True,
                    error_on_timeout={"ename": TIMEOUT_ENAME, "evalue": f"the cell ran longer than {cell_timeout:g} s",
                                      "traceback": []},
                    iopub_timeout=4, record_timing=False, on_cell_executed=remember,
                    resources={"metadata": {"path": str(notebook.parent)}})
    try:
        with client.setup_kernel():
            results["kernel_pid"] = getattr(client.km.provisioner, "pid", None)
            save()
            for index, cell in enumerate(nb.cells):
                if cell.cell_type != "code":
                    continue
                client.printed, client.over, client.last_reply = 0, False, None
                try:
                    client.execute_cell(cell, index, execution_count=index + 1)
                except DeadKernelError:
                    results["kernel_died_in_cell"] = index
                    results["cells"][str(index)] = {"status": "crashed", "message": "the kernel died while running this cell "
                                                    "(os._exit, a segfault, or out of memory)"}
                    save()
                    break
                results["cells"][str(index)] = _cell_result(cell, client.last_reply, client.over, max_output)
                save()
        results["finished"] = results["kernel_died_in_cell"] is None
    finally:
        save()
        _kill_descendants()
    return 0


def _cell_result(cell, reply, over, max_output) -> dict:
    content = (reply or {}).get("content", {})
    text = "".join(o.get("text", "") for o in cell.outputs if o.get("output_type") == "stream")
    tail = "\n".join(_ANSI.sub("", text).strip().splitlines()[-15:])[-2000:]
    if over:
        return {"status": "output-limit", "message": f"the cell printed more than {max_output} bytes and was stopped"}
    if content.get("status") == "error":
        ename, evalue = content.get("ename", "Error"), _ANSI.sub("", str(content.get("evalue", "")))
        status = "timeout" if ename == TIMEOUT_ENAME else "error"
        message = f"{ename}: {evalue}"[:1500]
        if tail and status == "error":
            message = f"{message}\noutput before the error:\n{tail}"
        return {"status": status, "message": message}
    return {"status": "ok", "message": ""}


def _kill_descendants():
    """The worker's last act: nothing it started (kernel, ranks, their children) outlives it."""
    try:
        import psutil
        children = psutil.Process().children(recursive=True)
        for child in children:
            child.kill()
        psutil.wait_procs(children, timeout=5)
    except Exception:
        pass


# ------------------------------------------------------------------ command line

def print_parts(labs: dict) -> None:
    for lab in labs.values():
        print(f"{lab.name}: {len(lab.parts)} parts, {_num(lab.max_points)} points")
        for grade_id, points in lab.parts:
            print(f"    {grade_id:<28} {_num(points):>4}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m utils.tools.grade", description=__doc__.split("\n")[0])
    parser.add_argument("submissions", nargs="*", help="folders or .ipynb files to grade")
    parser.add_argument("--out", default="build/grades", help="report folder (default: build/grades)")
    parser.add_argument("--labs", default=None, help="folder of reference labs (default: ./labs, else the course's labs/)")
    parser.add_argument("--student", default=None, help="owner of files not named <student>__<lab>.ipynb")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, help="seconds per submission (default 600)")
    parser.add_argument("--cell-timeout", type=float, default=DEFAULT_CELL_TIMEOUT, help="seconds per cell (default 300)")
    parser.add_argument("--max-output", type=int, default=DEFAULT_MAX_OUTPUT, help="bytes a cell may print (default 1 MiB)")
    parser.add_argument("--jobs", type=int, default=1, help="submissions graded at once (default 1)")
    parser.add_argument("--parts", action="store_true", help="list the labs' parts and points, grade nothing")
    parser.add_argument("--run-one", metavar="NOTEBOOK", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--executed", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.run_one:
        return run_one(args.run_one, args.result, args.executed, args.cell_timeout, args.max_output)

    labs_dir = Path(args.labs) if args.labs else (Path("labs") if Path("labs").is_dir() else REPO_ROOT / "labs")
    try:
        labs = load_labs(labs_dir)
    except LabFormatError as error:
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
    submissions, problems = find_submissions(args.submissions, labs, args.student)
    for problem in problems:
        print(f"warning: {problem}", file=sys.stderr)
    if not submissions:
        print("no submissions to grade", file=sys.stderr)
        return 1
    print(f"grading {len(submissions)} submissions against {labs_dir} "
          f"(limits: {args.timeout:g} s per submission, {args.cell_timeout:g} s per cell)")
    outcomes = grade(submissions, labs, args.out, args.timeout, args.cell_timeout, args.max_output, args.jobs)
    write_reports(outcomes, args.out, problems)
    print(f"wrote {Path(args.out) / 'grades.csv'}, summary.csv, feedback/ ({len(outcomes)} submissions)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
