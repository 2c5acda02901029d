"""Release (student copies) and autograding, on a tiny fixture lab.

tests/fixtures/labs/lab0_fixture.ipynb is a pure-Python lab with three parts (average 2, ring 3, chunks 1
points); its verdicts are tests/fixtures/verdicts/lab0_fixture.py. tests/fixtures/submissions/ holds one
submission per way a student can go wrong:
    alice   correct, but edited the locked setup cell and gutted a test cell (restored)
    bob     sums instead of averaging                      (flat name bob__lab0_fixture.ipynb)
    carol   correct, renamed file, deleted a test cell       (matched by grade_id, cell put back)
    dave    average hangs with SIGINT ignored and an orphaned grandchild process; ring and chunks correct
            (it waits, computing nothing, at its time limit: a call that waits forever scores 0 at once)
    erin    average kills its process (os._exit); ring and chunks correct
    frank   an endless loop in part 2 only (still computing at its limit, as a busy machine would be: judged
            again with 2.5 × the limit, then "not graded: ran out of time", no points recorded, never 0)
    grace   prints ~3 MB in part 3 (right, but chatty)
    heidi   average calls a helper from a cell of her own (the notebook sees it, the verdict does not);
            another cell of her own prints where temporary files go
    ivan    not JSON;   judy  a notebook of no lab
Points come from the verdicts only; the notebook runs for feedback. The grading runs as `make grade` runs it:
`python -m utils.tools.grade ... --out DIR`, read back from its CSVs, in the sandbox where one can start (as
`make grade` does). The real labs, and cheats against them, are in tests/test_grade_labs.py; attacks on the
sandbox in tests/test_grade_sandbox.py.
"""

import copy
import csv
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nbformat
import psutil
import pytest

from utils.tools import grade, release
from utils.tools.grade.reports import NOT_GRADED
from labtesting import run_grader, sandbox_arguments

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).resolve().parent / "fixtures"
FIXTURE_LABS = FIXTURES / "labs"
FIXTURE_VERDICTS = FIXTURES / "verdicts"
SUBMISSIONS = FIXTURES / "submissions"
# Limits for the fixture run: the hang costs TIMEOUT (notebook) + 3.5 × VERDICT_TIMEOUT (its part is judged again with
# 2.5 × the limit), the loop CELL_TIMEOUT + 3.5 × VERDICT_TIMEOUT. TIMEOUT also bounds each submission's verdict run: at 30 s a loaded machine ran out of it on the
# endless loop's three parts (two pool starts and a 5 s wait). The hanging notebook ignores the interrupt, so each
# of its 5 cells from the hang on waits CELL_TIMEOUT: 5 × 10 s > TIMEOUT, and it is stopped at TIMEOUT.
TIMEOUT, CELL_TIMEOUT, VERDICT_TIMEOUT = 45, 10, 5


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
    assert not (scratch / "again").exists(), "every lab is checked before anything is written"


def lab_with_links():
    """The fixture lab with a Colab badge and a setup cell that clones the course, like the real labs."""
    lab = fixture_lab()
    badge = ("[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research"
             ".google.com/github/course-org/course/blob/main/labs/lab0_fixture.ipynb) and lesson 03's: "
             "https://colab.research.google.com/github/course-org/course/blob/main/lessons/03.ipynb")
    lab.cells[0].source += "\n\n" + badge
    lab.cells.insert(1, code_cell('COURSE_REPO = "https://github.com/course-org/course"\nprint(COURSE_REPO)'))
    return lab


def test_links_in_the_student_copy_lead_to_the_student_repository():
    default = release.student_copy(lab_with_links(), "lab0_fixture.ipynb")
    assert ("https://colab.research.google.com/github/course-org/course-student/blob/main/labs/lab0_fixture.ipynb"
            in default.cells[0].source), "default: the lab's repository with -student appended"
    assert "course/blob/main/lessons/03.ipynb" in default.cells[0].source, "other notebooks' links are left alone"
    assert default.cells[1].source.startswith('COURSE_REPO = "https://github.com/course-org/course-student"')
    given = release.student_copy(lab_with_links(), "lab0_fixture.ipynb", "https://github.com/uni/dp-2025", "fall")
    assert "github/uni/dp-2025/blob/fall/labs/lab0_fixture.ipynb" in given.cells[0].source
    assert given.cells[1].source.startswith('COURSE_REPO = "https://github.com/uni/dp-2025"')


@pytest.mark.parametrize("args, complaint", [
    (["--student-repo", "gitlab.com/uni/course"], "https://github.com/OWNER/NAME"),
    (["--branch", "main; rm -rf"], "not a branch name"),
])
def test_release_refuses_bad_options_before_writing(scratch, capsys, args, complaint):
    with pytest.raises(SystemExit) as stopped:
        release.main([str(FIXTURE_LABS), "--out", str(scratch / "release"), *args])
    assert stopped.value.code == 2 and complaint in capsys.readouterr().err
    assert not (scratch / "release").exists()


# ------------------------------------------------------------------ finding and preparing submissions

def fixture_labs():
    return grade.load_labs(FIXTURE_LABS, FIXTURE_VERDICTS)


def test_parts_come_from_the_nbgrader_metadata(capsys):
    labs = fixture_labs()
    assert labs["lab0_fixture"].parts == [("average", 2), ("ring", 3), ("chunks", 1)]
    assert grade.main(["--parts", "--labs", str(FIXTURE_LABS), "--verdicts", str(FIXTURE_VERDICTS)]) == 0
    assert "lab0_fixture: 3 parts, 6 points" in capsys.readouterr().out


def test_a_lab_without_matching_verdicts_stops_grading_before_anything_runs(scratch, capsys):
    verdicts = scratch / "verdicts"
    verdicts.mkdir()
    assert grade.main([str(SUBMISSIONS), "--labs", str(FIXTURE_LABS), "--verdicts", str(verdicts),
                       "--out", str(scratch / "out")]) == 1
    assert "lab0_fixture: no verdicts" in capsys.readouterr().err
    text = (FIXTURE_VERDICTS / "lab0_fixture.py").read_text()
    (verdicts / "lab0_fixture.py").write_text(text.replace('"chunks": InProcess', '"chunk": InProcess'))
    assert grade.main([str(SUBMISSIONS), "--labs", str(FIXTURE_LABS), "--verdicts", str(verdicts),
                       "--out", str(scratch / "out")]) == 1
    err = capsys.readouterr().err
    assert "missing ['chunks']" in err and "not in the lab ['chunk']" in err
    assert not (scratch / "out").exists(), "nothing was started or written"


@pytest.mark.parametrize("args, complaint", [
    (["--timeout", "0"], "--timeout must be positive"),
    (["--jobs", "0"], "--jobs must be positive"),
    (["--labs", "no/such/folder"], "is not a folder of labs"),
    (["--out", __file__], "is not a folder"),
])
def test_bad_options_are_refused_before_anything_runs(capsys, args, complaint):
    with pytest.raises(SystemExit) as stopped:
        grade.main([str(SUBMISSIONS), "--labs", str(FIXTURE_LABS), "--verdicts", str(FIXTURE_VERDICTS), *args])
    assert stopped.value.code == 2 and complaint in capsys.readouterr().err


def test_find_submissions_layouts():
    labs = fixture_labs()
    found, problems = grade.find_submissions([SUBMISSIONS], labs)
    who = {(s.student, s.lab): s.path.name for s in found}
    assert who[("bob", "lab0_fixture")] == "bob__lab0_fixture.ipynb"                # <student>__<lab>.ipynb
    assert who[("alice", "lab0_fixture")] == "lab0_fixture.ipynb"                   # <student>/<lab>.ipynb
    assert who[("carol", "lab0_fixture")] == "lab0_fixture (1).ipynb"               # renamed: by grade_id
    assert len(found) == 9
    assert len(problems) == 1 and "homework.ipynb" in problems[0]                   # judy: no lab
    _, problems = grade.find_submissions([FIXTURE_LABS / "lab0_fixture.ipynb"], labs)
    assert "cannot tell the student" in problems[0]
    found, _ = grade.find_submissions([FIXTURE_LABS], labs, student="reference")
    assert [(s.student, s.lab) for s in found] == [("reference", "lab0_fixture")]


def grade_ids(nb):
    return [release.nbgrader_meta(c).get("grade_id") for c in nb.cells]


def test_prepare_takes_every_cell_but_the_solutions_from_the_lab():
    lab = fixture_labs()["lab0_fixture"]
    alice = release.read_notebook(SUBMISSIONS / "alice" / "lab0_fixture.ipynb")
    prepared = grade.prepare(alice, lab)
    by_id = {release.nbgrader_meta(c).get("grade_id"): c.source for c in prepared.notebook.cells}
    assert by_id["setup"].startswith("WORLD_SIZE = 4"), "locked cell restored"
    assert "ring_schedule(3)" in by_id["ring"], "test cell restored, with the checks the student copy shows"
    assert "HIDDEN TESTS" not in by_id["ring"], "hidden cases are the verdicts' job"
    assert "sum(values) / len(values)" in by_id["average_solution"], "the student's answer is kept"
    assert len(prepared.notes) == 2 and all("differed" in n for n in prepared.notes)
    labels = [label for label, _ in prepared.cells]
    assert labels == ["<lab cell 2>", "<solution cell 'average_solution'>", "<solution cell 'ring_solution'>",
                      "<solution cell 'chunks_solution'>"], "verdicts run the lab's definitions and the solutions"
    assert dict(prepared.cells)["<lab cell 2>"].startswith("WORLD_SIZE = 4"), "the lab's version, not alice's"

    carol = release.read_notebook(SUBMISSIONS / "carol" / "lab0_fixture (1).ipynb")
    prepared = grade.prepare(carol, lab)
    order = grade_ids(prepared.notebook)
    assert order.index("chunks") == order.index("chunks_solution") + 1, "deleted test cell put back in place"
    assert prepared.notes == ["cell 'chunks' was missing; the lab's version was put back"]

    copied = copy.deepcopy(carol)
    pasted = copy.deepcopy(copied.cells[4])  # a student's copy of the 'average' test cell, pasted first
    pasted["id"] = "pasted"
    copied.cells.insert(0, pasted)
    order = grade_ids(grade.prepare(copied, lab).notebook)
    assert order.count("average") == 1, "the copy runs as ordinary code, unscored"
    assert order.index("average") == order.index("average_solution") + 1, "the cell with the lab's id is graded"


def test_prepare_keeps_cells_a_student_added_for_the_notebook_only():
    lab = fixture_labs()["lab0_fixture"]
    prepared = grade.prepare(release.read_notebook(SUBMISSIONS / "heidi" / "lab0_fixture.ipynb"), lab)
    sources = [c.source for c in prepared.notebook.cells]
    helper = next(i for i, s in enumerate(sources) if s.startswith("def _mean"))
    assert grade_ids(prepared.notebook)[helper + 1] == "average_solution", "after the lab cell it followed"
    assert not any("_mean(values):" in source for _, source in prepared.cells), "verdicts never see it"
    assert any("of your own" in note for note in prepared.notes)

    missing = copy.deepcopy(lab.nb)
    del missing.cells[3]  # the average solution cell
    prepared = grade.prepare(missing, lab)
    assert "raise NotImplementedError()" in dict(prepared.cells)["<solution cell 'average_solution'>"]
    assert "solution cell 'average_solution' was missing" in prepared.notes[0]


def test_prepare_recognises_lab_cells_without_cell_ids():
    """Colab saves notebooks without cell ids: the lab's cells are still recognised by their source, links
    the release rewrote included, so nothing runs twice."""
    lab = grade.Lab("lab0_fixture", FIXTURE_LABS / "lab0_fixture.ipynb", lab_with_links(), fixture_lab_parts(),
                    FIXTURE_VERDICTS / "lab0_fixture.py")
    released = release.student_copy(lab.nb, "lab0_fixture.ipynb")
    for cell in released.cells:
        cell.pop("id", None)
    prepared = grade.prepare(released, lab)
    assert len(prepared.notebook.cells) == len(lab.nb.cells) and prepared.notes == []


def fixture_lab_parts():
    return release.check_lab(fixture_lab())


# ------------------------------------------------------------------ grading the fixture submissions

def read_reports(out):
    with open(out / "grades.csv") as f:
        rows = list(csv.DictReader(f))
    with open(out / "summary.csv") as f:
        summary = {(r["student"], r["lab"]): r for r in csv.DictReader(f)}
    parts = {}
    for r in rows:
        got = None if r["points"] == NOT_GRADED else float(r["points"])
        parts.setdefault((r["student"], r["lab"]), {})[r["part"]] = (got, float(r["max"]))
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
    os.environ["GRADE_TEST_PIDFILE"] = str(pidfile)  # dave's orphaned grandchildren write their pids here
    try:
        seconds, log = run_grader([SUBMISSIONS, extra, "--labs", FIXTURE_LABS, "--verdicts", FIXTURE_VERDICTS,
                                   "--out", tmp / "grades", "--timeout", TIMEOUT, "--cell-timeout", CELL_TIMEOUT,
                                   "--verdict-timeout", VERDICT_TIMEOUT, "--jobs", 2], timeout=500)
    finally:
        del os.environ["GRADE_TEST_PIDFILE"]
    rows, parts, summary = read_reports(tmp / "grades")
    return {"out": tmp / "grades", "rows": rows, "parts": parts, "summary": summary, "log": log,
            "seconds": seconds, "pidfile": pidfile, "sandboxed": summary[("alice", "lab0_fixture")]["sandbox"] == "yes"}


def _namespace(process):
    try:
        return os.readlink(f"/proc/{process.pid}/ns/pid")
    except OSError:
        return None


def command_line(process):
    try:
        return " ".join(process.cmdline())
    except psutil.Error:  # exited meanwhile
        return ""


def points(result, student):
    return {part: got for part, (got, _) in result["parts"][(student, "lab0_fixture")].items()}


def feedback(result, student):
    return (result["out"] / "feedback" / f"{student}.txt").read_text()


def test_reference_lab_scores_full_marks(fixture_grades):
    assert fixture_grades["parts"][("reference", "lab0_fixture")] == {
        "average": (2, 2), "ring": (3, 3), "chunks": (1, 1)}


def test_released_copy_scores_zero_on_every_part_within_its_limit(fixture_grades):
    assert points(fixture_grades, "blank") == {"average": 0, "ring": 0, "chunks": 0}
    row = fixture_grades["summary"][("blank", "lab0_fixture")]
    assert row["status"] == "finished" and row["verdicts"] == "judged", "neither run reached its time limit"
    assert "average is not implemented yet" in feedback(fixture_grades, "blank")


def test_wrong_submission_loses_exactly_the_part_it_breaks(fixture_grades):
    assert points(fixture_grades, "bob") == {"average": 0, "ring": 3, "chunks": 1}
    text = feedback(fixture_grades, "bob")
    assert "✗ average: 0 / 2" in text and "average, case 1: expected 3.0, got 12.0" in text
    assert "✓ ring: 3 / 3" in text


def test_hanging_and_crashing_parts_score_zero_the_others_still_score(fixture_grades):
    summary = fixture_grades["summary"]
    assert points(fixture_grades, "dave") == {"average": 0, "ring": 3, "chunks": 1}
    assert summary[("dave", "lab0_fixture")]["status"] == "timeout", "its notebook hung"
    log = (fixture_grades["out"] / "logs" / "dave__lab0_fixture.log").read_text()
    stopped = re.search(r"\[grader: feedback stopped at the time limit after ([\d.]+) s\]", log)
    assert stopped and float(stopped.group(1)) < TIMEOUT + 15, "its notebook was killed at its time limit"
    assert "no result after 5 s while running average: a call that waits forever (nothing was computing" in \
        feedback(fixture_grades, "dave"), "judged at the first limit: waiting is wrong on any machine"
    assert "dave" not in (fixture_grades["out"] / "problems.txt").read_text(), "nothing left to regrade"
    assert summary[("dave", "lab0_fixture")]["gradebook_status"] == "timeout", "its notebook hung"
    assert points(fixture_grades, "erin") == {"average": 0, "ring": 3, "chunks": 1}
    assert summary[("erin", "lab0_fixture")]["status"] == "kernel died"
    assert "the verdict process exited with code 3 while running average" in feedback(fixture_grades, "erin")
    finished = {student for (student, _), r in summary.items() if r["status"] == "finished"}
    assert finished == {"alice", "bob", "carol", "frank", "grace", "heidi", "reference", "blank"}
    if fixture_grades["sandboxed"]:  # the pid file is outside the sandbox: look for sandboxed sleepers instead
        ours = os.readlink("/proc/self/ns/pid")
        sleepers = [p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] == ["sleep", "1000"]]
        assert [p.pid for p in sleepers if _namespace(p) not in (ours, None)] == [], "orphans left in a sandbox"
    else:
        orphans = [int(line.split()[0]) for line in fixture_grades["pidfile"].read_text().splitlines()]
        assert len(orphans) == 2, "one from the verdict, one from the notebook"
        for orphan in orphans:
            assert not psutil.pid_exists(orphan) or psutil.Process(orphan).status() == psutil.STATUS_ZOMBIE, \
                "the hanging submission's orphaned grandchild was killed"
    leftovers = [c for c in map(command_line, psutil.Process().children(recursive=True))
                 if "utils.tools.grade" in c or "ipykernel" in c or "sleep 1000" in c]
    assert leftovers == [], f"processes left behind: {leftovers}"


def test_endless_loop_loses_only_its_part(fixture_grades):
    assert points(fixture_grades, "frank") == {"average": 2, "ring": None, "chunks": 1}
    text = feedback(fixture_grades, "frank")
    assert "not graded: ran out of time (no result within 5 s, nor within 12.5 s when judged again)" in text
    assert "no result after 12.5 s while running ring_neighbours: still computing" in text
    assert "frank lab0_fixture: part ring not graded: ran out of time — regrade it: make regrade" in (
        fixture_grades["out"] / "problems.txt").read_text()
    executed = release.read_notebook(fixture_grades["out"] / "executed" / "frank" / "lab0_fixture.ipynb")
    assert "KeyboardInterrupt" in str(executed.cells), "the notebook's cell was interrupted at its time limit"


def test_an_output_flood_is_capped_in_the_notebook_and_changes_no_point(fixture_grades):
    assert points(fixture_grades, "grace") == {"average": 2, "ring": 3, "chunks": 1}, "her function is right"
    executed = fixture_grades["out"] / "executed" / "grace" / "lab0_fixture.ipynb"
    assert executed.stat().st_size < 2 * grade.DEFAULT_MAX_OUTPUT, "printed megabytes were not kept"
    assert "your notebook's check cell failed (the cell printed more than" in feedback(fixture_grades, "grace")


def test_edited_renamed_and_incomplete_submissions_are_graded_on_the_lab_cells(fixture_grades):
    assert points(fixture_grades, "alice") == {"average": 2, "ring": 3, "chunks": 1}
    assert points(fixture_grades, "carol") == {"average": 2, "ring": 3, "chunks": 1}
    assert "was missing; the lab's version was put back" in feedback(fixture_grades, "carol")


def test_a_helper_outside_the_solution_cells_works_in_the_notebook_but_not_in_the_verdict(fixture_grades):
    assert points(fixture_grades, "heidi") == {"average": 0, "ring": 3, "chunks": 1}
    text = feedback(fixture_grades, "heidi")
    assert "_mean" in text and "not defined" in text
    assert "your notebook's check cell passed, but the verdict did not" in text


def test_temporary_files_stay_in_a_private_folder_that_is_removed(fixture_grades):
    executed = release.read_notebook(fixture_grades["out"] / "executed" / "heidi" / "lab0_fixture.ipynb")
    printed = next(o["text"] for c in executed.cells if c.cell_type == "code" for o in c.outputs
                   if "temporary folder:" in o.get("text", ""))
    folder = Path(printed.split("temporary folder:")[1].split()[0])
    pymp = Path(printed.split("multiprocessing:")[1].split()[0])
    assert folder.name == "tmp" and folder.parent.name.startswith("grade-"), folder
    assert pymp.parent == folder, "multiprocessing's pymp-* folder is inside it"
    assert not folder.parent.exists(), "removed after grading"


def test_kernels_talk_over_ipc(fixture_grades):
    logs = "".join(p.read_text() for p in (fixture_grades["out"] / "logs").iterdir())
    assert "[grader: feedback notebook]" in logs
    assert "without encryption" not in logs


def test_an_interrupted_grader_leaves_nothing_running(scratch):
    """Ctrl-C while a submission hangs in its verdict: the grader stops, and every process it started is gone."""
    grader = subprocess.Popen([sys.executable, "-m", "utils.tools.grade", SUBMISSIONS / "dave", "--student", "dave",
                               "--labs", FIXTURE_LABS, "--verdicts", FIXTURE_VERDICTS, "--out", scratch / "out",
                               "--verdict-timeout", "60", *sandbox_arguments()], cwd=ROOT,
                              stdout=subprocess.DEVNULL, stderr=(scratch / "grader.err").open("wb"),
                              preexec_fn=_ctrl_c_interrupts)
    seen, deadline, orphan = set(), time.monotonic() + 120, None
    try:
        while orphan is None and time.monotonic() < deadline:  # dave's average is running in a verdict
            tree = psutil.Process(grader.pid).children(recursive=True)
            seen.update(p.pid for p in tree)
            orphan = next((p for p in tree if command_line(p) == "sleep 1000"), None)
            time.sleep(0.2)
        assert orphan is not None, "the verdict never started"
        folder = Path(orphan.environ()["TMPDIR"])  # the verdict's TMPDIR, in the submission's private folder
        assert folder.parent.name.startswith("grade-"), folder
        seen.update(p.pid for p in psutil.Process(grader.pid).children(recursive=True))
        grader.send_signal(signal.SIGINT)
        # it exits 2-3 s after Ctrl-C here (quiet or at load 3); 60 s leaves 20x that for a busy machine, and a
        # slower exit names what was still running and what the grader said
        try:
            code = grader.wait(timeout=60)
        except subprocess.TimeoutExpired:
            states = [_state(p) for p in map(_process, seen) if p is not None]
            raise AssertionError(f"the grader ran on 60 s after Ctrl-C; its processes: {states}; it said: "
                                 f"{(scratch / 'grader.err').read_text()[-2000:]}") from None
        assert code == 130, (scratch / "grader.err").read_text()[-2000:]
    finally:
        if grader.poll() is None:
            grader.kill()
    alive = [p for p in map(_process, seen) if p is not None and p.status() != psutil.STATUS_ZOMBIE]
    assert alive == [], f"left running: {[command_line(p) for p in alive]}"
    assert not folder.parent.exists(), "the submission's private folder was removed"


def _ctrl_c_interrupts():
    """In the grader's process: SIGINT back to its default, so Python turns it into KeyboardInterrupt. A test run
    started as a background job of a non-interactive shell inherits SIGINT ignored (Python then keeps ignoring it),
    and the grader would never see this test's Ctrl-C: two clean-clone runs started as `(make test &)` failed so."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _state(proc) -> str:
    try:
        return f"{command_line(proc)} ({proc.status()})"
    except psutil.Error:
        return "(gone)"


def _process(pid):
    try:
        return psutil.Process(pid)
    except psutil.Error:
        return None


def test_unreadable_and_unmatched_files_are_reported(fixture_grades):
    assert points(fixture_grades, "ivan") == {"average": 0, "ring": 0, "chunks": 0}
    assert fixture_grades["summary"][("ivan", "lab0_fixture")]["status"] == "unreadable"
    assert "homework.ipynb: does not match any lab" in (fixture_grades["out"] / "problems.txt").read_text()


def test_reports_have_one_row_per_part_and_feedback_per_student(fixture_grades):
    rows = fixture_grades["rows"]
    assert list(rows[0]) == ["student", "lab", "part", "points", "max"]
    students = {"alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi", "ivan", "reference", "blank"}
    assert len(rows) == 3 * len(students)
    assert {p.stem for p in (fixture_grades["out"] / "feedback").iterdir()} == students
    for student in students:
        assert f"Feedback for {student}" in feedback(fixture_grades, student)
