"""The real labs under the grader: the reference earns full marks, the student copy nothing, and cheats
nothing on the parts they attack (tests/fixtures/cheats.py builds them from the reference lab).

Each cheat got 12/12 from the grader before verdicts (when points came from the notebook's own check cells):
rebinding the check module's name, patching one of its functions, patching torch.equal and the byte counter
inside a rank, and a result whose __reduce__ patches the checker in the process that unpickles it. All of them
are graded in one run, as `make grade` grades a class.
"""
import csv
import importlib.util
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from utils.tools import grade, release
from labtesting import run_grader

ROOT = Path(__file__).resolve().parents[1]
REAL_LABS = sorted((ROOT / "labs").glob("lab*.ipynb"))
LIMIT = 300
_spec = importlib.util.spec_from_file_location("cheats", ROOT / "tests" / "fixtures" / "cheats.py")
cheats = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cheats)


def read_reports(out):
    """({(student, lab): {part: (points, max)}}, {(student, lab): summary row})"""
    parts = {}
    with open(out / "grades.csv") as f:
        for r in csv.DictReader(f):
            parts.setdefault((r["student"], r["lab"]), {})[r["part"]] = (float(r["points"]), float(r["max"]))
    with open(out / "summary.csv") as f:
        summary = {(r["student"], r["lab"]): r for r in csv.DictReader(f)}
    return parts, summary


@pytest.fixture(scope="module")
def graded():
    """Release the labs as `make release` does, then grade the references, the student copies and the cheats."""
    with tempfile.TemporaryDirectory(prefix="test-grade-labs-") as folder:
        scratch = Path(folder)
        subprocess.run([sys.executable, "-m", "utils.tools.release", "labs", "--out", scratch / "release"], cwd=ROOT,
                       check=True, capture_output=True)
        submitted = scratch / "submitted"
        submitted.mkdir()
        for lab in REAL_LABS:
            shutil.copy(lab, submitted / f"reference__{lab.name}")
            shutil.copy(scratch / "release" / lab.name, submitted / f"blank__{lab.name}")
        reference = release.read_notebook(ROOT / "labs" / f"{cheats.LAB}.ipynb")
        for name in cheats.ATTACKS:
            release.write_notebook(cheats.cheat(reference, name), submitted / f"{name}__{cheats.LAB}.ipynb")
        count = 2 * len(REAL_LABS) + len(cheats.ATTACKS)
        seconds, log = run_grader([submitted, "--out", scratch / "grades", "--timeout", LIMIT, "--jobs", 2],
                                  timeout=LIMIT * count + 120)
        parts, summary = read_reports(scratch / "grades")
        feedback = {p.stem: p.read_text() for p in (scratch / "grades" / "feedback").iterdir()}
        print(f"graded {count} submissions in {seconds:.0f} s")
        yield {"parts": parts, "summary": summary, "feedback": feedback, "log": log,
               "logs": "".join(p.read_text() for p in (scratch / "grades" / "logs").iterdir())}


@pytest.mark.skipif(not REAL_LABS, reason="labs/ has no lab notebooks yet")
def test_reference_full_marks_and_student_copy_zero(graded):
    labs = grade.load_labs(ROOT / "labs")
    for lab in REAL_LABS:
        reference, blank = graded["parts"][("reference", lab.stem)], graded["parts"][("blank", lab.stem)]
        assert set(reference) == {part for part, _ in labs[lab.stem].parts}
        assert all(got == most for got, most in reference.values()), graded["feedback"]["reference"]
        assert all(got == 0 for got, _ in blank.values()), graded["feedback"]["blank"]
        for who in ("reference", "blank"):
            row = graded["summary"][(who, lab.stem)]
            assert row["status"] == "finished" and row["verdicts"] == "judged", row
        print(f"{lab.name}: reference graded in {graded['summary'][('reference', lab.stem)]['seconds']} s, "
              f"student copy in {graded['summary'][('blank', lab.stem)]['seconds']} s")
    assert "is not implemented yet" in graded["feedback"]["blank"]


@pytest.mark.parametrize("name", sorted(cheats.ATTACKS))
def test_a_cheat_scores_nothing_on_what_it_attacks(graded, name):
    parts = graded["parts"][(name, cheats.LAB)]
    attacked = cheats.ATTACKS[name]
    assert {part: got for part, (got, _) in parts.items() if part in attacked} == dict.fromkeys(attacked, 0), \
        graded["feedback"][name]
    assert all(got == most for part, (got, most) in parts.items() if part not in attacked), \
        "the honest parts keep their points: " + graded["feedback"][name]


def test_feedback_says_what_failed_and_what_is_only_advisory(graded):
    text = graded["feedback"]["patch_equal"]
    assert "✗ reduce_scatter at N=2:" in text
    # zeros where chunk r belongs: named as wrong values, or, where the inputs make the sum's other chunk zero
    # too (fresh random inputs each grading), as the other chunk; 0 points either way
    assert re.search(r"rank \d, length \d+, \w+: (wrong values for chunk \d = elements \d+:\d+ of the sum: \d+ of \d+ "
                     r"elements wrong, first at element \d+: expected -?[\d.]+, got 0|returned chunk \d of the sum, "
                     r"expected chunk \d)", text), text
    assert "your notebook's check cell passed, but the verdict did not" in text
    assert "advisory against deliberate tampering" in text
    assert "returned _Payload, expected a tensor" in graded["feedback"]["reduce_attack"]


def test_no_tcp_kernels(graded):
    assert "[grader: feedback notebook]" in graded["logs"] and "without encryption" not in graded["logs"]
