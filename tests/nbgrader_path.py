"""The nbgrader path of INSTRUCTORS.md, run end to end (not part of `make test`: it needs nbgrader 0.9.6, which
`pip install nbgrader==0.9.6` adds to .venv without changing any installed version, and about two minutes).

    .venv/bin/python tests/nbgrader_path.py [LAB]          (LAB default: lab1_collectives)

In a fresh nbgrader course directory: source/<assignment>/<lab>.ipynb is the reference lab; `nbgrader
generate_assignment` writes the student copy; two students submit (the reference: full marks; the untouched student
copy: 0); `nbgrader autograde` and `nbgrader export` give grades.csv. The kernel needs the course's `utils`: the lab's
setup cell looks one folder up, which under autograded/<student>/<assignment>/ is not the course, so PYTHONPATH
names the course. nbgrader's cell timeout (30 s by default) would fire before a lab's own deadlock report (after
check_timeout = 30 s): the config raises it to the lab's cell limit.
"""
import csv
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from utils.tools.grade.submissions import lab_limits  # noqa: E402
from utils.tools.grade.verdicts import load_module, module_path  # noqa: E402
from utils.tools.release import check_lab, read_notebook  # noqa: E402

CONFIG = """c = get_config()
c.CourseDirectory.course_id = "dp-from-scratch"
c.CourseDirectory.root = {root!r}
# A lab's check cell reports a deadlock after check_timeout (30 s): nbgrader's default cell timeout (30 s) would
# fire first. Use the lab's own cell limit.
c.ExecutePreprocessor.timeout = {timeout}
c.ClearSolutions.code_stub = dict(python="# YOUR CODE HERE\\nraise NotImplementedError()")
"""


def nbgrader(course, env, *args):
    done = subprocess.run([sys.executable, "-m", "nbgrader", *args], cwd=course, env=env, capture_output=True,
                          text=True, timeout=900)
    if done.returncode != 0:
        sys.exit(f"nbgrader {' '.join(args)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return done.stdout + done.stderr


def main(lab="lab1_collectives") -> int:
    reference = read_notebook(ROOT / "labs" / f"{lab}.ipynb")
    total = sum(points for _, points in check_lab(reference))
    timeout = int(lab_limits(reference, load_module(module_path(lab))).get("cell_timeout", 300))
    assignment = lab.split("_")[0]
    with tempfile.TemporaryDirectory(prefix="nbgrader-path-") as folder:
        course = Path(folder) / "course"
        (course / "source" / assignment).mkdir(parents=True)
        shutil.copy(ROOT / "labs" / f"{lab}.ipynb", course / "source" / assignment / f"{lab}.ipynb")
        (course / "nbgrader_config.py").write_text(CONFIG.format(root=str(course), assignment=assignment,
                                                                 timeout=timeout))
        # nbgrader runs `alembic` (installed beside it) by name: this interpreter's bin folder goes on PATH
        env = dict(os.environ, PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
                   PYTHONPATH=os.pathsep.join([str(ROOT)] + [os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
        for student in ("ada", "blank"):
            nbgrader(course, env, "db", "student", "add", student)
        nbgrader(course, env, "db", "assignment", "add", assignment)
        nbgrader(course, env, "generate_assignment", assignment, "--force")
        released = course / "release" / assignment / f"{lab}.ipynb"
        assert released.is_file(), "generate_assignment wrote no student copy"
        for student, source in (("ada", course / "source" / assignment / f"{lab}.ipynb"), ("blank", released)):
            target = course / "submitted" / student / assignment
            target.mkdir(parents=True)
            shutil.copy(source, target / f"{lab}.ipynb")
            (target / "timestamp.txt").write_text("2026-11-30 12:00:00.000000 UTC")
        nbgrader(course, env, "autograde", assignment, "--force")
        nbgrader(course, env, "export", "--to", str(Path(folder) / "grades.csv"))
        with open(Path(folder) / "grades.csv") as f:
            scores = {row["student_id"]: (float(row["score"]), float(row["max_score"])) for row in csv.DictReader(f)}
    print(f"nbgrader path, {lab}: {scores} (max {total:g})")
    assert scores["ada"] == (total, total), scores
    assert scores["blank"] == (0, total), scores
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
