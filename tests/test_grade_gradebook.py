"""The gradebook side of the grader, without grading real notebooks: LMS file names, which of two files counts,
the gradebook's statuses, a merged regrade, the roster, feedback worded without library internals, per-lab
limits. One small real run (the fixture lab) checks the command end to end."""
import csv
import os
import shutil
import tempfile
import zipfile
from pathlib import Path

import nbformat
import pytest

from utils.tools import release
from utils.tools.grade import find_submissions, job, load_labs
from utils.tools.grade.preparation import prepare
from utils.tools.grade.reports import Outcome, read_roster, write_reports
from utils.tools.grade.wording import GLOO_RECEIVE, plain
from labtesting import run_grader

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
LAB = FIXTURES / "labs" / "lab0_fixture.ipynb"
GOOD = FIXTURES / "submissions" / "alice" / "lab0_fixture.ipynb"
WRONG = FIXTURES / "submissions" / "bob__lab0_fixture.ipynb"


@pytest.fixture
def scratch():
    with tempfile.TemporaryDirectory(prefix="test-gradebook-") as folder:
        yield Path(folder)


@pytest.fixture(scope="module")
def labs():
    return load_labs(FIXTURES / "labs", FIXTURES / "verdicts")


def test_canvas_and_moodle_names_map_to_one_student_each_newest_file_graded(scratch, labs):
    shutil.copy(WRONG, scratch / "lovelaceada_101_5001_lab0_fixture.ipynb")
    shutil.copy(GOOD, scratch / "lovelaceada_101_5001_lab0_fixture-1.ipynb")       # re-upload: newer
    shutil.copy(GOOD, scratch / "hoppergrace_late_102_5003_lab0_fixture.ipynb")
    shutil.copy(WRONG, scratch / "hoppergrace_102_5010_homework.ipynb")             # later id, renamed: newer
    moodle = scratch / "Alan Turing_77_assignsubmission_file_"
    moodle.mkdir()
    shutil.copy(GOOD, moodle / "lab0_fixture.ipynb")
    found, problems = find_submissions([scratch], labs)
    who = {s.student: s for s in found}
    assert set(who) == {"101", "102", "77"} and all(s.lab == "lab0_fixture" for s in found)
    assert who["101"].path.name == "lovelaceada_101_5001_lab0_fixture-1.ipynb" and who["101"].lms == "canvas"
    assert who["101"].name == "lovelaceada" and who["101"].lms_id == "101"
    assert who["102"].path.name == "hoppergrace_102_5010_homework.ipynb" and not who["102"].late
    assert who["77"].lms_id == "Participant 77" and who["77"].name == "Alan Turing"
    assert "graded lovelaceada_101_5001_lab0_fixture-1.ipynb, the newest, of 2 files" in who["101"].note
    assert any("not graded: lovelaceada_101_5001_lab0_fixture.ipynb" in p for p in problems)


def test_archive_entry_dates_not_file_times_choose_the_newest(scratch, labs):
    archive = scratch / "export.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        folder = "Alan Turing_77_assignsubmission_file_"
        newer = zipfile.ZipInfo(f"{folder}/a_lab0_fixture.ipynb", date_time=(2026, 11, 3, 12, 0, 0))
        older = zipfile.ZipInfo(f"{folder}/b_lab0_fixture.ipynb", date_time=(2026, 11, 1, 12, 0, 0))
        zf.writestr(newer, GOOD.read_bytes())
        zf.writestr(older, WRONG.read_bytes())   # last by name and entry order, but older
    unpacked = scratch / "unpacked"
    unpacked.mkdir()
    found, problems = find_submissions([archive], labs, unpack_into=unpacked)
    assert [(s.student, s.path.name) for s in found] == [("77", "a_lab0_fixture.ipynb")]
    for path in unpacked.rglob("*.ipynb"):   # unzipping gave both files new times: they do not count
        os.utime(path, (0, 0) if path.name.startswith("a_") else None)
    found, _ = find_submissions([archive], labs, unpack_into=unpacked)
    assert found[0].path.name == "a_lab0_fixture.ipynb"


def outcome(student, status="finished", points=(1, 0), verdicts="judged", **extra):
    o = Outcome(student, "lab0_fixture", Path(f"{student}.ipynb"), status=status, verdicts=verdicts, **extra)
    o.scores = [("average", points[0], 2, "✓"), ("ring", points[1], 3, "✗ wrong")]
    return o


def read(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_gradebook_keeps_exceptions_apart_from_zeros_and_a_regrade_merges(scratch):
    roster = scratch / "roster.csv"
    roster.write_text("Identifier,Full name,Email address\nParticipant 77,Alan Turing,alan@example.org\n")
    outcomes = [outcome("zero", points=(0, 0)), outcome("77", lms_id="Participant 77"),
                outcome("corrupt", status="unreadable", points=(0, 0), verdicts="not run"),
                outcome("loop", status="timeout", points=(2, 0)), outcome("crash", status="kernel died"),
                outcome("slow", verdicts="timeout")]
    write_reports(outcomes, scratch / "grades", roster=read_roster(roster))
    book = {r["student"]: r for r in read(scratch / "grades" / "gradebook.csv")}
    assert list(read(scratch / "grades" / "gradebook.csv")[0])[:7] == ["student", "lms_id", "name", "email", "points",
                                                                       "max", "status"]
    assert {s: r["status"] for s, r in book.items()} == {
        "zero": "graded", "77": "graded", "corrupt": "resubmission needed", "loop": "timeout", "crash": "kernel died",
        "slow": "timeout"}
    assert (book["zero"]["points"], book["zero"]["max"]) == ("0", "5")
    assert (book["77"]["name"], book["77"]["email"], book["77"]["lms_id"]) == ("Alan Turing", "alan@example.org",
                                                                              "Participant 77")
    assert len(read(scratch / "grades" / "grades.csv")) == 2 * len(outcomes)   # per-part rows kept
    # regrade one student: their rows and feedback replaced, everyone else's kept
    write_reports([outcome("corrupt", points=(2, 3))], scratch / "grades", merge=True)
    book = {r["student"]: r for r in read(scratch / "grades" / "gradebook.csv")}
    assert len(book) == len(outcomes) and book["corrupt"]["status"] == "graded" and book["corrupt"]["points"] == "5"
    assert book["loop"]["status"] == "timeout" and book["77"]["lms_id"] == "Participant 77"
    assert {p.stem for p in (scratch / "grades" / "feedback").iterdir()} == {o.student for o in outcomes}
    assert len(read(scratch / "grades" / "grades.csv")) == 2 * len(outcomes)


def test_feedback_names_no_library_internals():
    crash = ("✗ reduce_scatter failed at N=3:\nrank 1 raised RuntimeError: [../third_party/gloo/gloo/transport/tcp/"
             "pair.cc:534] Read error [127.0.0.1]:41234: Connection reset by peer\nrank 2 died with signal SIGABRT\n"
             "Exception raised from recv at /pytorch/torch/csrc/distributed/c10d/ProcessGroupGloo.cpp:2035")
    worded = plain(crash)
    assert worded.startswith("✗ reduce_scatter failed at N=3") and GLOO_RECEIVE in worded
    for internal in ("third_party", "pair.cc", "SIGABRT", "csrc", "ProcessGroupGloo"):
        assert internal not in worded
    message = "✗ ring_time(n=2, nbytes=1000, alpha=5e-06, beta=1e-11) = 3, expected 1.001e-05 s"
    assert plain(message) == message
    o = outcome("x")
    o.scores[1] = ("ring", 0, 3, crash)
    from utils.tools.grade.reports import feedback_text
    assert "third_party" not in feedback_text("x", [o]) and GLOO_RECEIVE in feedback_text("x", [o])


def test_returned_notebooks_carry_no_hidden_tests(labs):
    lab = labs["lab0_fixture"]
    nb = release.read_notebook(GOOD)
    prepared = prepare(nb, lab).notebook
    hidden = [line.strip() for cell in lab.nb.cells
              for begin, end, _ in release.marker_regions(cell.source, release.HIDDEN_TESTS)
              for line in cell.source.split("\n")[begin + 1:end] if line.strip()]
    assert hidden
    text = "\n".join(cell.source for cell in prepared.cells)
    assert not [line for line in hidden if line in text] and "HIDDEN" not in text


def test_lab_limits_come_from_the_lab_unless_the_command_line_sets_them():
    real = load_labs(ROOT / "labs")
    lab1 = real["lab1_collectives"]
    assert job.Limits(None, None, None).for_lab(lab1).cell_timeout == lab1.limits["cell_timeout"] <= 60
    assert job.Limits(None, 5, None).for_lab(lab1).cell_timeout == 5
    for lab in real.values():   # every lab bounds a loop in a student's cell, and in a verdict step, to about a minute
        assert lab.limits["cell_timeout"] <= 60 and lab.limits["verdict_timeout"] <= 60 and lab.limits["timeout"] <= 240
    nb = nbformat.v4.new_notebook(metadata={"grading": {"cell_timeout": 20, "timeout": -1}})
    from utils.tools.grade.submissions import lab_limits
    assert lab_limits(nb, type("M", (), {"LIMITS": {"cell_timeout": 60, "timeout": 100}})) == {
        "cell_timeout": 20.0, "timeout": 100.0}


def test_the_function_a_timed_out_cell_was_running_is_named():
    nb = release.read_notebook(ROOT / "labs" / "lab1_collectives.ipynb")
    source = "lab1.check_cost_model(ring_time, halving_doubling_time, crossover_bytes)"
    assert job.student_functions_called(source, nb) == ["ring_time", "halving_doubling_time", "crossover_bytes"]


def test_one_command_grades_lms_names_and_regrades_one_student(scratch):
    """End to end on the fixture lab: a Canvas file, a corrupt Moodle upload; then the Moodle student resubmits
    and is regraded alone, merged into the gradebook."""
    subs = scratch / "canvas"
    subs.mkdir()
    shutil.copy(GOOD, subs / "lovelaceada_101_5001_lab0_fixture.ipynb")
    shutil.copy(WRONG, subs / "babbagecharles_103_5002_lab0_fixture.ipynb")   # average wrong: its part fails
    moodle = scratch / "moodle" / "Alan Turing_77_assignsubmission_file_"
    moodle.mkdir(parents=True)
    (moodle / "lab0_fixture.ipynb").write_text("{ not json")
    out = scratch / "grades"
    limits = ["--labs", FIXTURES / "labs", "--verdicts", FIXTURES / "verdicts", "--timeout", 60, "--cell-timeout", 10,
              "--verdict-timeout", 10]
    run_grader([subs, scratch / "moodle", "--out", out, "--jobs", 2, *limits], timeout=300)
    book = {r["student"]: r for r in read(out / "gradebook.csv")}
    assert (book["101"]["points"], book["101"]["max"], book["101"]["status"]) == ("6", "6", "graded")
    assert (book["77"]["points"], book["77"]["status"], book["77"]["name"]) == ("0", "resubmission needed",
                                                                                  "Alan Turing")
    assert (book["103"]["points"], book["103"]["status"]) == ("4", "graded")
    executed = release.read_notebook(out / "executed" / "103" / "lab0_fixture.ipynb")
    after = next(c for c in executed.cells if c.cell_type == "code" and "the average gradient" in c.source)
    assert "[grader: not run: it calls average, whose check failed above]" in after.outputs[0]["text"]
    assert "the file is not a notebook — please resubmit" in (out / "feedback" / "77.txt").read_text()
    assert "JSONDecodeError" not in (out / "feedback" / "77.txt").read_text()
    shutil.copy(GOOD, moodle / "lab0_fixture-1.ipynb")   # the resubmission, next to the corrupt file
    seconds, log = run_grader([moodle, "--out", out, "--merge", *limits], timeout=300)
    book = {r["student"]: r for r in read(out / "gradebook.csv")}
    assert (book["77"]["points"], book["77"]["status"]) == ("6", "graded") and book["101"]["points"] == "6"
    assert book["77"]["lms_id"] == "Participant 77" and "lab0_fixture-1.ipynb" in book["77"]["files"]
    assert "graded lab0_fixture-1.ipynb, the newest, of 2 files" in (out / "feedback" / "77.txt").read_text()
    assert (out / "feedback" / "101.txt").exists()
