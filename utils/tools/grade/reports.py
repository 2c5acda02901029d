"""What grading one submission produced, and the files the grader writes: the gradebook, grades, summary, feedback.

    gradebook.csv   one row per student: student (the LMS's id where the file came from an LMS), lms_id (what the
                    LMS's grade import matches: Canvas's user id, Moodle's "Participant <id>"), name, email (from
                    --roster, else the LMS's file name), points, max, status, late, files. status keeps exceptions
                    apart from real zeros: "graded" (points are what the verdicts gave, 0 included), "resubmission
                    needed" (the file is not a notebook), "timeout", "kernel died", "grader error".
                    "not graded: ran out of time" (a part's verdict ran out of time twice: regrade it).
    grades.csv      one row per part: student, lab, part, points (or NOT_GRADED), max
    summary.csv     one row per submission: student, lab, points, max, status, verdicts, seconds, file, ...,
                    sandbox (yes, or no when graded with --no-sandbox)
    problems.txt    files not graded, parts not graded (with the command that regrades them), and the warning
                    that the run had no sandbox
    feedback/<student>.txt, executed/<student>/<lab>.ipynb (the notebook as it ran: no hidden tests)

merge=True (a regrade: `--merge`) keeps every other student's rows and feedback, replacing only the
(student, lab) submissions graded in this run.
"""
from __future__ import annotations

import csv
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from .wording import plain

NOTEBOOK_STATES = {"finished": "ran to the end", "timeout": "stopped at the time limit",
                   "kernel died": "the kernel died", "unreadable": "could not be read",
                   "grader error": "the grader failed", "not run": "not run"}


@dataclass
class Outcome:
    """What happened to one submission."""
    student: str
    lab: str
    path: Path
    status: str = "finished"     # the feedback notebook: finished | timeout | kernel died | unreadable | grader error
    verdicts: str = "judged"     # the verdict step: judged | timeout | grader error | not run
    seconds: float = 0.0
    scores: list = field(default_factory=list)    # [(grade_id, points or None: not graded, max, verdict message)]
    checks: dict = field(default_factory=dict)    # {grade_id: (status, message)} of the notebook's check cells
    notes: list = field(default_factory=list)
    lab_note: str = ""
    name: str = ""               # as the LMS wrote it
    lms_id: str = ""             # what the LMS's grade import matches
    late: bool = False

    @property
    def points(self):
        return sum(s[1] for s in self.scores if s[1] is not None)

    @property
    def not_graded(self) -> list:
        """The parts that ran out of time: no points recorded (a regrade gives them)."""
        return [s[0] for s in self.scores if s[1] is None]

    @property
    def max_points(self):
        return sum(s[2] for s in self.scores)


NOT_GRADED = "not graded: ran out of time"


def num(x) -> str:
    return NOT_GRADED if x is None else f"{x:g}"


def safe_name(name: str) -> str:
    return re.sub(r"[^\w.@+-]", "_", name) or "_"


SUMMARY_COLUMNS = ["student", "lab", "points", "max", "status", "verdicts", "seconds", "file", "name", "lms_id",
                   "late", "gradebook_status", "sandbox"]
GRADEBOOK_COLUMNS = ["student", "lms_id", "name", "email", "points", "max", "status", "late", "files"]
# The notebook's state (and the verdicts') as the gradebook words it: exceptions apart from real zeros.
_GRADEBOOK_STATUS = {"unreadable": "resubmission needed", "timeout": "timeout", "kernel died": "kernel died",
                     "grader error": "grader error"}


def gradebook_status(status: str, verdicts: str = "judged", not_graded=()) -> str:
    """"graded", or the exception that needs the instructor: resubmission needed, timeout, kernel died, grader
    error, not graded: ran out of time (parts whose verdicts ran out of time)."""
    if status in _GRADEBOOK_STATUS:
        return _GRADEBOOK_STATUS[status]
    if verdicts in ("timeout", "grader error"):
        return verdicts
    if not_graded:
        return NOT_GRADED
    return "graded"


def _read_rows(path) -> list:
    try:
        with open(path, newline="") as f:
            return list(csv.DictReader(f))
    except OSError:
        return []


def _write_rows(path, columns, rows) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def read_roster(path) -> dict:
    """{id: {"name", "email"}} from a CSV with an id column (id, student, user id, participant, identifier; a
    Moodle "Participant 77" counts as 77) and optional name and email columns (also "full name", "email address")."""
    roster = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            row = {(k or "").strip().lower(): (v or "").strip() for k, v in row.items()}
            key = next((row[k] for k in ("id", "student", "user id", "participant", "identifier", "student id")
                        if row.get(k)), None)
            if key is None:
                continue
            key = key.removeprefix("Participant ").strip()
            roster[key] = {"name": row.get("name") or row.get("full name", ""),
                           "email": row.get("email") or row.get("email address", "")}
    return roster


def gradebook_rows(summary: list, roster: dict | None = None) -> list:
    """One row per student from summary.csv's rows (see the module docstring)."""
    roster, by_student = roster or {}, {}
    for row in summary:
        by_student.setdefault(row["student"], []).append(row)
    rows = []
    for student, mine in sorted(by_student.items()):
        statuses = [(r["lab"], r.get("gradebook_status") or gradebook_status(r["status"], r.get("verdicts", "")))
                    for r in mine]
        problems = [(lab, status) for lab, status in statuses if status != "graded"]
        if not problems:
            status = "graded"
        elif len(mine) == 1:
            status = problems[0][1]
        else:
            status = "; ".join(f"{lab}: {status}" for lab, status in problems)
        known = roster.get(student, {})
        rows.append({"student": student, "lms_id": next((r.get("lms_id") for r in mine if r.get("lms_id")), ""),
                     "name": known.get("name") or next((r.get("name") for r in mine if r.get("name")), ""),
                     "email": known.get("email", ""),
                     "points": num(sum(float(r["points"]) for r in mine)),
                     "max": num(sum(float(r["max"]) for r in mine)), "status": status,
                     "late": "yes" if any(r.get("late") == "yes" for r in mine) else "",
                     "files": "; ".join(Path(r["file"]).name for r in mine)})
    return rows


def write_reports(outcomes: list, out_dir, problems=(), merge: bool = False, roster: dict | None = None,
                  warning: str = "") -> None:
    """gradebook.csv, grades.csv, summary.csv and feedback/<student>.txt (module docstring). merge=False replaces
    the previous reports; merge=True replaces only the submissions graded now. `warning` (e.g. graded without the
    sandbox) heads every feedback file and problems.txt."""
    out_dir = Path(out_dir)
    problems = ([warning] if warning else []) + list(problems) + [
        f"{o.student} {o.lab}: part {part} {NOT_GRADED} — regrade it: make regrade SUBMISSIONS='{o.path}'"
        for o in outcomes for part in o.not_graded]
    out_dir.mkdir(parents=True, exist_ok=True)
    graded_now = {(o.student, o.lab) for o in outcomes}
    grades, summary = [], []
    if merge:
        grades = [r for r in _read_rows(out_dir / "grades.csv") if (r["student"], r["lab"]) not in graded_now]
        summary = [r for r in _read_rows(out_dir / "summary.csv") if (r["student"], r["lab"]) not in graded_now]
    for o in outcomes:
        for grade_id, points, most, _ in o.scores:
            grades.append({"student": o.student, "lab": o.lab, "part": grade_id, "points": num(points),
                           "max": num(most)})
        summary.append({"student": o.student, "lab": o.lab, "points": num(o.points), "max": num(o.max_points),
                        "status": o.status, "verdicts": o.verdicts, "seconds": f"{o.seconds:.1f}", "file": str(o.path),
                        "name": o.name, "lms_id": o.lms_id, "late": "yes" if o.late else "",
                        "gradebook_status": gradebook_status(o.status, o.verdicts, o.not_graded),
                        "sandbox": "no" if warning else "yes"})
    order = {}
    for o in outcomes:  # a part's rows stay in the lab's order
        for index, (grade_id, *_) in enumerate(o.scores):
            order[(o.lab, grade_id)] = index
    grades.sort(key=lambda r: (r["student"], r["lab"], order.get((r["lab"], r["part"]), 0)))
    summary.sort(key=lambda r: (r["student"], r["lab"]))
    _write_rows(out_dir / "grades.csv", ["student", "lab", "part", "points", "max"], grades)
    _write_rows(out_dir / "summary.csv", SUMMARY_COLUMNS, summary)
    _write_rows(out_dir / "gradebook.csv", GRADEBOOK_COLUMNS, gradebook_rows(summary, roster))
    feedback = out_dir / "feedback"
    if not merge:
        shutil.rmtree(feedback, ignore_errors=True)
    feedback.mkdir(exist_ok=True)
    by_student = {}
    for o in outcomes:
        by_student.setdefault(o.student, []).append(o)
    for student, mine in by_student.items():
        (feedback / f"{safe_name(student)}.txt").write_text((warning + "\n\n" if warning else "")
                                                            + feedback_text(student, mine))
    if merge:
        if problems:
            with open(out_dir / "problems.txt", "a") as f:
                f.write("\n".join(problems) + "\n")
    elif problems:
        (out_dir / "problems.txt").write_text("\n".join(problems) + "\n")
    elif (out_dir / "problems.txt").exists():
        (out_dir / "problems.txt").unlink()


def _check_line(passed: bool, check) -> str:
    """How the notebook's own check cell went, when it disagrees with the verdict (else "")."""
    if check is None:
        return "" if not passed else "your notebook's check cell did not run; the verdict judged the part anyway"
    status, message = check
    first = plain(message).splitlines()[0] if message else ""
    if status == "timeout":  # say which of the student's functions never returned, whatever the verdict
        return f"your notebook's check cell stopped at its time limit: {first[:300]}"
    if status == "ok" and not passed:
        return ("your notebook's check cell passed, but the verdict did not: it runs only the lab's cells and "
                "your solution cells, on fresh inputs")
    if status != "ok" and passed:
        return f"your notebook's check cell failed ({first[:200]}); the points come from the verdict"
    return ""


def feedback_text(student: str, outcomes: list) -> str:
    """The text a student gets: per lab, each part's points and verdict, and how their notebook ran."""
    lines = [f"Feedback for {student}", ""]
    for o in sorted(outcomes, key=lambda o: o.lab):
        lines.append(f"{o.lab}: {num(o.points)} / {num(o.max_points)} points  ({o.path.name}; notebook "
                     f"{NOTEBOOK_STATES.get(o.status, o.status)}; {o.seconds:.0f} s)")
        lines.append("  Points come from the verdicts: the lab's cells and your solution cells, run by the grader "
                     "on fresh inputs. Your notebook ran for feedback, with every cell but your solution cells "
                     "as the lab has them.")
        for note in o.notes:
            lines.append(f"  note: {plain(note)}")
        for grade_id, points, most, message in o.scores:
            mark = "?" if points is None else "✓" if points == most else "✗"
            lines.append(f"  {mark} {grade_id}: {num(points)} / {num(most)}")
            for line in plain(message).splitlines()[:25]:
                lines.append(f"      {line}")
            extra = "" if points is None else _check_line(points == most, o.checks.get(grade_id))
            if extra:
                lines.append(f"      note: {extra}")
        if o.lab_note:
            lines.append(f"  {o.lab_note}")
        lines.append("")
    return "\n".join(lines)
