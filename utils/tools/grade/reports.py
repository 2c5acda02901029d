"""What grading one submission produced, and the files the grader writes: grades, summary, feedback."""
from __future__ import annotations

import csv
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

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
    scores: list = field(default_factory=list)    # [(grade_id, points, max, verdict message)]
    checks: dict = field(default_factory=dict)    # {grade_id: (status, message)} of the notebook's check cells
    notes: list = field(default_factory=list)
    lab_note: str = ""

    @property
    def points(self):
        return sum(s[1] for s in self.scores)

    @property
    def max_points(self):
        return sum(s[2] for s in self.scores)


def num(x) -> str:
    return f"{x:g}"


def safe_name(name: str) -> str:
    return re.sub(r"[^\w.@+-]", "_", name) or "_"


def write_reports(outcomes: list, out_dir, problems=()) -> None:
    """grades.csv, summary.csv and feedback/<student>.txt (previous ones replaced)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ordered = sorted(outcomes, key=lambda o: (o.student, o.lab))
    with open(out_dir / "grades.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["student", "lab", "part", "points", "max"])
        for o in ordered:
            for grade_id, points, most, _ in o.scores:
                writer.writerow([o.student, o.lab, grade_id, num(points), num(most)])
    with open(out_dir / "summary.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["student", "lab", "points", "max", "status", "verdicts", "seconds", "file"])
        for o in ordered:
            writer.writerow([o.student, o.lab, num(o.points), num(o.max_points), o.status, o.verdicts,
                             f"{o.seconds:.1f}", str(o.path)])
    feedback = out_dir / "feedback"
    shutil.rmtree(feedback, ignore_errors=True)
    feedback.mkdir()
    by_student = {}
    for o in outcomes:
        by_student.setdefault(o.student, []).append(o)
    for student, mine in by_student.items():
        (feedback / f"{safe_name(student)}.txt").write_text(feedback_text(student, mine))
    if problems:
        (out_dir / "problems.txt").write_text("\n".join(problems) + "\n")
    elif (out_dir / "problems.txt").exists():
        (out_dir / "problems.txt").unlink()


def _check_line(passed: bool, check) -> str:
    """How the notebook's own check cell went, when it disagrees with the verdict (else "")."""
    if check is None:
        return "" if not passed else "your notebook's check cell did not run; the verdict judged the part anyway"
    status, message = check
    first = message.splitlines()[0] if message else ""
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
            lines.append(f"  note: {note}")
        for grade_id, points, most, message in o.scores:
            mark = "✓" if points == most else "✗"
            lines.append(f"  {mark} {grade_id}: {num(points)} / {num(most)}")
            for line in message.splitlines()[:25]:
                lines.append(f"      {line}")
            extra = _check_line(points == most, o.checks.get(grade_id))
            if extra:
                lines.append(f"      note: {extra}")
        if o.lab_note:
            lines.append(f"  {o.lab_note}")
        lines.append("")
    return "\n".join(lines)
