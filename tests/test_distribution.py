"""The student distribution (utils/tools/distribution.py): exactly the files students need, links to the
student repository, and no solution text, hidden test or reference formula anywhere in it."""
import copy
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from utils.tools import distribution, release
from utils.tools.grade.preparation import prepare
from utils.tools.grade.submissions import Lab

from leakcheck import find_leaks, texts

ROOT = Path(__file__).resolve().parents[1]
REPO, BRANCH = "https://github.com/acme/dp-student", "fall26"


@pytest.fixture(scope="module")
def dist():
    with tempfile.TemporaryDirectory(prefix="test-distribution-") as folder:
        out = Path(folder) / "student"
        (out / ".git").mkdir(parents=True)           # a clone being refreshed: .git stays, the rest is replaced
        (out / "stale.txt").write_text("from an older distribution")
        distribution.write_distribution(out, REPO, BRANCH)
        yield out


def test_the_distribution_holds_what_students_need_and_nothing_else(dist):
    top = {p.name for p in dist.iterdir()}
    assert top == {".git", "README.md", "pyproject.toml", "environment.yml", "lessons", "labs", "utils", "benchmarks"}
    files = set(texts(dist))
    assert {f"lessons/{p.name}" for p in (ROOT / "lessons").glob("*.ipynb")} <= files
    assert {f"labs/{p.name}" for p in (ROOT / "labs").glob("*.ipynb")} <= files
    assert "utils/labchecks/lab1.py" in files and "utils/__init__.py" in files
    assert {f"benchmarks/{p.name}" for p in (ROOT / "benchmarks").glob("*.py")} <= files   # lessons point to them
    assert not [f for f in files if f.startswith("utils/tools/grade") or f.endswith(("release.py", "reference.py"))]
    readme = re.search(r'^readme\s*=\s*"([^"]+)"', (dist / "pyproject.toml").read_text(), re.M)[1]
    assert (dist / readme).is_file() and REPO in (dist / readme).read_text()


def test_links_lead_to_the_student_repository(dist):
    for name, text in texts(dist).items():
        for owner_repo, branch, target in re.findall(
                r"colab\.research\.google\.com/github/([\w.-]+/[\w.-]+)/blob/([\w.-]+)/([\w./-]+\.ipynb)", text):
            assert (owner_repo, branch) == ("acme/dp-student", BRANCH), name
            assert target == name, f"{name}'s badge opens {target}"
            assert (dist / target).is_file()
        for url in re.findall(r'COURSE_REPO = "([^"]*)"', text):
            assert url == REPO, name
        assert "dp-from-scratch/dp-from-scratch" not in text, name
    badges = [n for n, t in texts(dist).items() if "colab.research.google.com/github/" in t]
    assert len(badges) == len(list((ROOT / "lessons").glob("*.ipynb"))) + len(list((ROOT / "labs").glob("*.ipynb")))


def test_no_solution_text_and_no_hidden_test_anywhere(dist):
    assert find_leaks(texts(dist)) == []


def test_the_released_lab_1_checks_part_4_without_the_private_module(dist):
    """In the distribution, lab1.check_cost_model judges the lab's cases from stored values alone."""
    nb = release.read_notebook(ROOT / "labs" / "lab1_collectives.ipynb")
    solutions = "\n".join(c.source for c in nb.cells if release.is_solution_cell(c) and "def ring_time" in c.source
                          or "def halving_doubling_time" in c.source or "def crossover_bytes" in c.source)
    program = ("import math, sys\nimport utils\nassert utils.__file__.startswith(sys.argv[1]), utils.__file__\n"
               "from utils.labchecks import lab1\n" + solutions +
               "\nlab1.check_cost_model(ring_time, halving_doubling_time, crossover_bytes)\n"
               "try:\n    import utils.tools.grade.reference\nexcept ImportError:\n    print('no reference module')\n")
    done = subprocess.run([sys.executable, "-c", program, str(dist)], cwd=dist, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ring_time matches the α-β model" in done.stdout and "no reference module" in done.stdout


def test_a_rewritten_repository_url_in_a_locked_cell_is_not_a_change():
    nb = release.read_notebook(ROOT / "tests" / "fixtures" / "labs" / "lab0_fixture.ipynb")
    nb.cells[0].source += ("\n\n[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]"
                           "(https://colab.research.google.com/github/course/course/blob/main/labs/lab0_fixture.ipynb)")
    nb.cells[0].metadata["nbgrader"] = {"grade": False, "grade_id": "intro", "locked": True, "solution": False}
    nb.cells[1].source = 'COURSE_REPO = "https://github.com/course/course"\n' + nb.cells[1].source
    lab = Lab("lab0_fixture", Path("lab0_fixture.ipynb"), nb, release.check_lab(nb), Path("unused.py"))
    released = release.student_copy(copy.deepcopy(nb), "lab0_fixture.ipynb", REPO, BRANCH)
    assert REPO in released.cells[1].source and f"acme/dp-student/blob/{BRANCH}" in released.cells[0].source
    assert not [n for n in prepare(released, lab).notes if "differed" in n]
    released.cells[1].source += "\nWORLD_SIZE = 2"  # a real change is still one
    assert [n for n in prepare(released, lab).notes if "'setup' differed" in n]
