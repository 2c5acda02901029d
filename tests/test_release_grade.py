"""Release (student copies) and autograding, on a tiny fixture lab and on the real labs.

tests/fixtures/labs/lab0_fixture.ipynb is a pure-Python lab with three parts (average 2, ring 3,
chunks 1 points); tests/fixtures/submissions/ holds one submission per way a student can go wrong:
    alice   correct, but edited the locked setup cell and gutted a test cell (restored)
    bob     sums instead of averaging                      (flat name bob__lab0_fixture.ipynb)
    carol   correct, renamed file, deleted a test cell       (matched by grade_id, cell put back)
    dave    hangs with SIGINT ignored and an orphaned grandchild process
    erin    kills its kernel (os._exit)
    frank   an endless loop in part 2 only
    grace   prints ~3 MB in part 3
    ivan    not JSON;   judy  a notebook of no lab
The grading runs as `make grade` runs it: `python -m utils.tools.grade ... --out DIR`, read back from its CSVs.
"""

import copy
import csv
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nbformat
import psutil
import pytest

from utils.tools import grade, release

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).resolve().parent / "fixtures"
FIXTURE_LABS = FIXTURES / "labs"
SUBMISSIONS = FIXTURES / "submissions"
TIMEOUT, CELL_TIMEOUT = 30, 5  # limits for the fixture run: the hang costs TIMEOUT, the loop CELL_TIMEOUT


@pytest.fixture
def scratch():
    """A private temporary folder. (Not tmp_path: several pytest runs of one user share its folder and
    each deletes all but the newest few, even while an older run still uses them.)"""
    with tempfile.TemporaryDirectory(prefix="test-release-grade-") as folder:
        yield Path(folder)


def fixture_lab():
    return release.read_notebook(FIXTURE_LABS / "lab0_fixture.ipynb")


def code_cell(source, **nbgrader):
    cell = nbformat.v4.new_code_cell(source)
    if nbgrader:
        cell.metadata["nbgrader"] = nbgrader
    return cell


def sources(nb):
    return "\n".join(cell.source for cell in nb.cells)


# ------------------------------------------------------------------ release (no execution)

def test_solution_region_becomes_stub_with_its_indentation():
    source = ("def ring_schedule(n):\n"
              "    steps = []\n"
              "    for step in range(n - 1):\n"
              "        # BEGIN SOLUTION\n"
              "        steps.append(step)\n"
              "        # END SOLUTION\n"
              "    return steps")
    cell = code_cell(source, solution=True, grade=False, grade_id="s", locked=False)
    assert release.student_source(cell) == ("def ring_schedule(n):\n"
                                            "    steps = []\n"
                                            "    for step in range(n - 1):\n"
                                            "        # YOUR CODE HERE\n"
                                            "        raise NotImplementedError()\n"
                                            "    return steps")


def test_hidden_tests_removed_and_visible_checks_kept():
    cell = code_cell("assert f(1) == 2\n### BEGIN HIDDEN TESTS\nassert f(2) == 3\n### END HIDDEN TESTS\nprint('ok')",
                     grade=True, solution=False, grade_id="t", points=1, locked=True)
    assert release.student_source(cell) == "assert f(1) == 2\nprint('ok')"


def test_solution_cell_without_markers_is_replaced_whole():
    """nbgrader's rule, so both tools produce the same student copy."""
    cell = code_cell("x = 42", solution=True, grade=False, grade_id="s", locked=False)
    assert release.student_source(cell) == release.CODE_STUB


def test_student_copy_of_fixture_lab():
    lab = fixture_lab()
    lab.cells[4].outputs = [nbformat.v4.new_output("stream", name="stdout", text="✓ average\n")]
    lab.cells[4].execution_count = 7
    before = copy.deepcopy(lab)
    released = release.student_copy(lab, "lab0_fixture")
    assert lab == before, "the reference notebook must not be modified"
    text = sources(released)
    for marker in ("BEGIN SOLUTION", "END SOLUTION", "BEGIN HIDDEN TESTS", "END HIDDEN TESTS"):
        assert marker not in text
    for secret in ("total += value", "divmod(length, world_size)", "average([5.0])", "chunk_bounds(3, 4)"):
        assert secret not in text, f"{secret!r} leaked into the student copy"
    code = "\n".join(c.source for c in released.cells if c.cell_type == "code")
    assert code.count("raise NotImplementedError()") == 4  # 3 solution cells, one with two regions
    assert "assert got == 3.0" in text, "visible checks stay"
    assert all(c.outputs == [] and c.execution_count is None for c in released.cells if c.cell_type == "code")
    ids = lambda nb: [release.nbgrader_meta(c).get("grade_id") for c in nb.cells]
    assert ids(released) == ids(lab), "nbgrader metadata (grade_ids) kept for grading"


@pytest.mark.parametrize("cells, complaint", [
    ([code_cell("# BEGIN SOLUTION\nx = 1", solution=True, grade_id="s")], "never closed"),
    ([code_cell("# BEGIN SOLUTION\n# BEGIN SOLUTION\n# END SOLUTION", solution=True, grade_id="s")], "inside another"),
    ([code_cell("# END HIDDEN TESTS", grade=True, solution=False, grade_id="t", points=1)], "without a BEGIN"),
    ([code_cell("# BEGIN SOLUTION\nx = 1\n# END SOLUTION")], "lacks solution: true"),
    ([code_cell("# BEGIN HIDDEN TESTS\nassert 1\n# END HIDDEN TESTS", solution=True, grade_id="s")], "not a graded test"),
    ([code_cell("x = 1  # BEGIN SOLUTION", solution=True, grade_id="s")], "outside a marker comment"),
    ([code_cell("assert 1", grade=True, solution=False, grade_id="t", points=1),
      code_cell("assert 2", grade=True, solution=False, grade_id="t", points=1)], "used twice"),
    ([code_cell("assert 1", grade=True, solution=False, grade_id="t")], "needs points"),
    ([code_cell("assert 1", grade=True, solution=False, points=1)], "without a grade_id"),
    ([code_cell("x = 1")], "no graded test cells"),
])
def test_check_lab_rejects_inconsistent_labs(cells, complaint):
    with pytest.raises(release.LabFormatError, match=complaint):
        release.check_lab(nbformat.v4.new_notebook(cells=cells), "bad_lab")


def test_release_command_writes_every_lab(scratch, capsys):
    labs = scratch / "labs"
    labs.mkdir()
    shutil.copy(FIXTURE_LABS / "lab0_fixture.ipynb", labs / "lab0_fixture.ipynb")
    shutil.copy(FIXTURE_LABS / "lab0_fixture.ipynb", labs / "lab9_copy.ipynb")
    assert release.main([str(labs), "--out", str(scratch / "release")]) == 0
    written = sorted(p.name for p in (scratch / "release").iterdir())
    assert written == ["lab0_fixture.ipynb", "lab9_copy.ipynb"]
    assert "3 graded parts, 6 points" in capsys.readouterr().out
    bad = release.read_notebook(labs / "lab9_copy.ipynb")
    bad.cells[3].source += "\n    # BEGIN SOLUTION"
    release.write_notebook(bad, labs / "lab9_copy.ipynb")
    assert release.main([str(labs), "--out", str(scratch / "again")]) == 1


# ------------------------------------------------------------------ finding and preparing submissions

def test_parts_come_from_the_nbgrader_metadata(capsys):
    labs = grade.load_labs(FIXTURE_LABS)
    assert labs["lab0_fixture"].parts == [("average", 2), ("ring", 3), ("chunks", 1)]
    assert grade.main(["--parts", "--labs", str(FIXTURE_LABS)]) == 0
    assert "lab0_fixture: 3 parts, 6 points" in capsys.readouterr().out


def test_find_submissions_layouts():
    labs = grade.load_labs(FIXTURE_LABS)
    found, problems = grade.find_submissions([SUBMISSIONS], labs)
    who = {(s.student, s.lab): s.path.name for s in found}
    assert who[("bob", "lab0_fixture")] == "bob__lab0_fixture.ipynb"                # <student>__<lab>.ipynb
    assert who[("alice", "lab0_fixture")] == "lab0_fixture.ipynb"                   # <student>/<lab>.ipynb
    assert who[("carol", "lab0_fixture")] == "lab0_fixture (1).ipynb"               # renamed: by grade_id
    assert len(found) == 8
    assert len(problems) == 1 and "homework.ipynb" in problems[0]                   # judy: no lab
    _, problems = grade.find_submissions([FIXTURE_LABS / "lab0_fixture.ipynb"], labs)
    assert "cannot tell the student" in problems[0]
    found, _ = grade.find_submissions([FIXTURE_LABS], labs, student="reference")
    assert [(s.student, s.lab) for s in found] == [("reference", "lab0_fixture")]


def test_prepare_restores_hidden_tests_locked_and_deleted_cells():
    lab = grade.load_labs(FIXTURE_LABS)["lab0_fixture"]
    alice = release.read_notebook(SUBMISSIONS / "alice" / "lab0_fixture.ipynb")
    prepared, notes = grade.prepare(alice, lab)
    by_id = {release.nbgrader_meta(c).get("grade_id"): c.source for c in prepared.cells}
    assert by_id["setup"].startswith("WORLD_SIZE = 4"), "locked cell restored"
    assert "BEGIN HIDDEN TESTS" in by_id["ring"] and "ring_schedule(5)" in by_id["ring"], "hidden checks back"
    assert "sum(values) / len(values)" in by_id["average_solution"], "the student's answer is kept"
    assert len(notes) == 2 and all("differed" in n for n in notes)

    carol = release.read_notebook(SUBMISSIONS / "carol" / "lab0_fixture (1).ipynb")
    prepared, notes = grade.prepare(carol, lab)
    order = [release.nbgrader_meta(c).get("grade_id") for c in prepared.cells]
    assert order.index("chunks") == order.index("chunks_solution") + 1, "deleted test cell put back in place"
    assert notes == ["cell 'chunks' was missing; the lab's version was put back"]

    copied = copy.deepcopy(carol)
    pasted = copy.deepcopy(copied.cells[4])  # a student's copy of the 'average' test cell, pasted first
    pasted["id"] = "pasted"
    copied.cells.insert(0, pasted)
    prepared, _ = grade.prepare(copied, lab)
    order = [release.nbgrader_meta(c).get("grade_id") for c in prepared.cells]
    assert order.count("average") == 1, "the copy runs as ordinary code, unscored"
    assert order.index("average") == order.index("average_solution") + 1, "the cell with the lab's id is graded"


# ------------------------------------------------------------------ grading the fixture submissions

def run_grader(args, timeout):
    """`python -m utils.tools.grade ARGS` as `make grade` runs it; returns (seconds, stdout)."""
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "utils.tools.grade", *map(str, args)], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout + done.stderr
    return time.monotonic() - start, done.stdout + done.stderr


def read_reports(out):
    with open(out / "grades.csv") as f:
        rows = list(csv.DictReader(f))
    with open(out / "summary.csv") as f:
        summary = {(r["student"], r["lab"]): r for r in csv.DictReader(f)}
    parts = {}
    for r in rows:
        parts.setdefault((r["student"], r["lab"]), {})[r["part"]] = (float(r["points"]), float(r["max"]))
    return rows, parts, summary


@pytest.fixture(scope="module")
def fixture_grades():
    """Grade the reference lab, its released copy and every fixture submission in one command."""
    with tempfile.TemporaryDirectory(prefix="test-release-grade-") as folder:
        yield grade_fixtures(Path(folder))


def grade_fixtures(tmp):
    extra = tmp / "extra"
    release.release_labs(FIXTURE_LABS, tmp / "release")
    extra.mkdir()
    shutil.copy(FIXTURE_LABS / "lab0_fixture.ipynb", extra / "reference__lab0_fixture.ipynb")
    shutil.copy(tmp / "release" / "lab0_fixture.ipynb", extra / "blank__lab0_fixture.ipynb")
    pidfile = tmp / "orphan.pid"
    os.environ["GRADE_TEST_PIDFILE"] = str(pidfile)  # dave's orphaned grandchild writes its pid here
    try:
        seconds, log = run_grader([SUBMISSIONS, extra, "--labs", FIXTURE_LABS, "--out", tmp / "grades",
                                   "--timeout", TIMEOUT, "--cell-timeout", CELL_TIMEOUT, "--jobs", 2], timeout=300)
    finally:
        del os.environ["GRADE_TEST_PIDFILE"]
    rows, parts, summary = read_reports(tmp / "grades")
    return {"out": tmp / "grades", "rows": rows, "parts": parts, "summary": summary, "log": log,
            "seconds": seconds, "pidfile": pidfile}


def command_line(process):
    try:
        return " ".join(process.cmdline())
    except psutil.Error:  # exited meanwhile
        return ""


def points(result, student):
    return {part: got for part, (got, _) in result["parts"][(student, "lab0_fixture")].items()}


def test_reference_lab_scores_full_marks(fixture_grades):
    assert fixture_grades["parts"][("reference", "lab0_fixture")] == {
        "average": (2, 2), "ring": (3, 3), "chunks": (1, 1)}


def test_released_copy_scores_zero_on_every_part_within_its_limit(fixture_grades):
    assert points(fixture_grades, "blank") == {"average": 0, "ring": 0, "chunks": 0}
    row = fixture_grades["summary"][("blank", "lab0_fixture")]
    assert row["status"] == "finished" and float(row["seconds"]) < TIMEOUT


def test_wrong_submission_loses_exactly_the_part_it_breaks(fixture_grades):
    assert points(fixture_grades, "bob") == {"average": 0, "ring": 3, "chunks": 1}
    feedback = (fixture_grades["out"] / "feedback" / "bob.txt").read_text()
    assert "✗ average: 0 / 2" in feedback and "should be 3.0, got 12.0" in feedback


def test_hanging_and_crashing_submissions_score_zero_and_grading_goes_on(fixture_grades):
    summary = fixture_grades["summary"]
    assert points(fixture_grades, "dave") == {"average": 0, "ring": 0, "chunks": 0}
    assert summary[("dave", "lab0_fixture")]["status"] == "timeout"
    assert float(summary[("dave", "lab0_fixture")]["seconds"]) < TIMEOUT + 15, "killed at its time limit"
    assert points(fixture_grades, "erin") == {"average": 0, "ring": 0, "chunks": 0}
    assert summary[("erin", "lab0_fixture")]["status"] == "kernel died"
    finished = {student for (student, _), r in summary.items() if r["status"] == "finished"}
    assert finished == {"alice", "bob", "carol", "frank", "grace", "reference", "blank"}, "the others were graded"
    orphan = int(fixture_grades["pidfile"].read_text())
    assert not psutil.pid_exists(orphan) or psutil.Process(orphan).status() == psutil.STATUS_ZOMBIE, \
        "the hanging submission's orphaned grandchild was killed"
    leftovers = [c for c in map(command_line, psutil.Process().children(recursive=True))
                 if "utils.tools.grade" in c or "ipykernel" in c or "sleep 1000" in c]
    assert leftovers == [], f"processes left behind: {leftovers}"


def test_endless_loop_loses_only_its_part(fixture_grades):
    assert points(fixture_grades, "frank") == {"average": 2, "ring": 0, "chunks": 1}
    assert "CellTimeout" in (fixture_grades["out"] / "feedback" / "frank.txt").read_text()


def test_output_flood_is_capped_and_loses_its_part(fixture_grades):
    assert points(fixture_grades, "grace") == {"average": 2, "ring": 3, "chunks": 0}
    executed = fixture_grades["out"] / "executed" / "grace" / "lab0_fixture.ipynb"
    assert executed.stat().st_size < 2 * grade.DEFAULT_MAX_OUTPUT, "printed megabytes were not kept"
    assert "printed more than" in (fixture_grades["out"] / "feedback" / "grace.txt").read_text()


def test_edited_renamed_and_incomplete_submissions_are_graded_on_the_lab_tests(fixture_grades):
    assert points(fixture_grades, "alice") == {"average": 2, "ring": 3, "chunks": 1}
    assert points(fixture_grades, "carol") == {"average": 2, "ring": 3, "chunks": 1}
    assert "was missing; the lab's version was put back" in (fixture_grades["out"] / "feedback" / "carol.txt").read_text()


def test_unreadable_and_unmatched_files_are_reported(fixture_grades):
    assert points(fixture_grades, "ivan") == {"average": 0, "ring": 0, "chunks": 0}
    assert fixture_grades["summary"][("ivan", "lab0_fixture")]["status"] == "unreadable"
    assert "homework.ipynb: does not match any lab" in (fixture_grades["out"] / "problems.txt").read_text()


def test_reports_have_one_row_per_part_and_feedback_per_student(fixture_grades):
    rows = fixture_grades["rows"]
    assert list(rows[0]) == ["student", "lab", "part", "points", "max"]
    students = {"alice", "bob", "carol", "dave", "erin", "frank", "grace", "ivan", "reference", "blank"}
    assert len(rows) == 3 * len(students)
    assert {p.stem for p in (fixture_grades["out"] / "feedback").iterdir()} == students
    for student in students:
        assert f"Feedback for {student}" in (fixture_grades["out"] / "feedback" / f"{student}.txt").read_text()


# ------------------------------------------------------------------ the real labs

REAL_LABS = sorted((ROOT / "labs").glob("lab*.ipynb"))


@pytest.mark.skipif(not REAL_LABS, reason="labs/ has no lab notebooks yet")
def test_real_labs_reference_full_marks_and_student_copy_zero(scratch):
    """Every lab in labs/: `make release`'s command, then the reference and its released copy graded."""
    subprocess.run([sys.executable, "-m", "utils.tools.release", "labs", "--out", scratch / "release"], cwd=ROOT,
                   check=True, capture_output=True)
    folder = scratch / "submitted"
    folder.mkdir()
    for lab in REAL_LABS:
        shutil.copy(lab, folder / f"reference__{lab.name}")
        shutil.copy(scratch / "release" / lab.name, folder / f"blank__{lab.name}")
    limit = 300
    run_grader([folder, "--out", scratch / "grades", "--timeout", limit], timeout=limit * 2 * len(REAL_LABS) + 60)
    rows, parts, summary = read_reports(scratch / "grades")
    labs = grade.load_labs(ROOT / "labs")
    feedback = {who: (scratch / "grades" / "feedback" / f"{who}.txt").read_text() for who in ("reference", "blank")}
    for lab in REAL_LABS:
        reference, blank = parts[("reference", lab.stem)], parts[("blank", lab.stem)]
        assert set(reference) == {part for part, _ in labs[lab.stem].parts}
        assert all(got == most for got, most in reference.values()), feedback["reference"]
        assert all(got == 0 for got, _ in blank.values()), feedback["blank"]
        assert summary[("blank", lab.stem)]["status"] == "finished"
        assert float(summary[("blank", lab.stem)]["seconds"]) < limit
        print(f"{lab.name}: reference graded in {summary[('reference', lab.stem)]['seconds']} s, "
              f"student copy in {summary[('blank', lab.stem)]['seconds']} s")
