"""The student distribution (utils/tools/distribution.py): exactly the files students need, links to the
student repository, and no solution text, hidden test or reference formula anywhere in it."""
import ast
import copy
import importlib.util
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
from IPython.core.inputtransformer2 import TransformerManager

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
    assert top == {".git", ".gitignore", "README.md", "course.py", "pyproject.toml", "environment.yml", "lessons",
                   "labs", "utils", "benchmarks"}
    files = set(texts(dist))
    assert {f"lessons/{p.name}" for p in (ROOT / "lessons").glob("*.ipynb")} <= files
    assert {f"labs/{p.name}" for p in (ROOT / "labs").glob("*.ipynb")} <= files
    assert "utils/labchecks/lab1.py" in files and "utils/__init__.py" in files
    assert {f"benchmarks/{p.name}" for p in (ROOT / "benchmarks").glob("*.py")} - set(distribution.PRIVATE_SCRIPTS) \
        <= files   # lessons point to them
    assert not set(distribution.PRIVATE_SCRIPTS) & files   # the grader's benchmark: the grader does not ship
    assert not [f for f in files if f.startswith("utils/tools/grade") or f.endswith(("release.py", "reference.py",
                                                                                      "distribution.py", "start.py"))]
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


def test_no_student_path_reaches_the_reference_module(dist):
    """No module or notebook of the distribution imports the grader or the release tools, and lab 1's checks
    judge a case beyond their stored ones with a clear failure, importing nothing of the grader."""
    private = re.compile(r"^utils\.tools\.(grade|release|distribution|student_start)\b|^\.+tools\.(grade|release)\b"
                         r"|^\.+(grade|release|reference)\b")
    for name, text in texts(dist).items():
        if not name.endswith((".py", ".ipynb")):
            continue
        source = text if name.endswith(".py") else "\n".join(   # IPython's own translation of magics to Python
            TransformerManager().transform_cell("".join(c["source"]))
            for c in json.loads((dist / name).read_text())["cells"] if c["cell_type"] == "code")
        for node in ast.walk(ast.parse(source)):
            modules = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                       ["." * node.level + (node.module or "")] if isinstance(node, ast.ImportFrom) else [])
            assert not [m for m in modules if private.search(m)], f"{name} imports {modules}"
    lab1_source = (ROOT / "utils" / "labchecks" / "lab1.py").read_text()
    assert "tools.grade" not in lab1_source and "reference import" not in lab1_source
    program = ("import sys\nfrom utils.labchecks import lab1\n"
               "try:\n    lab1.check_cost_model(lambda *a: 0.0, lambda *a: 0.0, lambda *a: 0.0, cases=[(9, 1e3, 1e-6, 1e-9)])\n"
               "except lab1.LabCheckFailure as failure:\n    print(failure)\n"
               "print(sorted(m for m in sys.modules if m.startswith('utils.tools')))\n")
    done = subprocess.run([sys.executable, "-c", program], cwd=dist, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "no stored expected value for ring_time(9, 1000.0, 1e-06, 1e-09)" in done.stdout
    assert done.stdout.strip().endswith("[]"), done.stdout


# What does not ship, by name: the course's Makefile and its targets, its tests, CI, the instructors' guide and tools.
UNSHIPPED = re.compile(r"Makefile|\bmake (install|run|test|lab|release|distribution|grade|regrade|benchmarks|compat"
                       r"|compat-ends|clean)\b|\btests/|test_\w+\.py|utils[./]tools[./](grade|release|distribution"
                       r"|student_start)|INSTRUCTORS\.md|\.ci/|\.github/")


def test_no_file_names_what_does_not_ship(dist):
    named = {name: sorted(set(m.group(0) for m in UNSHIPPED.finditer(text))) for name, text in texts(dist).items()}
    assert not {name: found for name, found in named.items() if found}


def test_the_instructors_note_on_lab_links_is_not_in_the_students_lessons(dist):
    for name, text in texts(dist).items():
        assert "reference repository" not in text and "opens the solutions" not in text, name
    note = "work in the copy your instructor hands out: in the course's reference repository this link opens the solutions"
    link = "[Lab 1](../labs/lab1.ipynb)"
    for before, after in [
            (f"{link} ({note}; the lab has you write a ring", f"{link} (the lab has you write a ring"),
            (f"{link} (your own `DDPBucketed`; {note}),", f"{link} (your own `DDPBucketed`),"),
            (f"{link}, `ShardedOptimizer` ({note}), then", f"{link}, `ShardedOptimizer`, then"),
            (f"{link} (a; {note}; b)", f"{link} (a; b)"),
            (f"{link} (no note here)", f"{link} (no note here)")]:
        assert distribution.without_instructor_note(before) == after


def test_git_add_all_leaves_out_the_environment_and_build_outputs(dist, tmp_path):
    clone = tmp_path / "clone"
    subprocess.run(["cp", "-r", str(dist), str(clone)], check=True)
    subprocess.run(["rm", "-rf", str(clone / ".git")], check=True)
    for junk in (".venv/bin/python", "dp_from_scratch.egg-info/PKG-INFO", "utils/__pycache__/x.pyc",
                 "lessons/.ipynb_checkpoints/x.ipynb", "build/labs/lab1_collectives.ipynb"):
        (clone / junk).parent.mkdir(parents=True, exist_ok=True)
        (clone / junk).write_text("x")
    subprocess.run(["git", "init", "-q", str(clone)], check=True)
    added = subprocess.run(["git", "-C", str(clone), "add", "--dry-run", "-A"], capture_output=True, text=True,
                           check=True).stdout
    assert "course.py" in added and "lessons/00_launching.ipynb" in added
    assert not [line for line in added.splitlines() if any(j in line for j in (".venv", "egg-info", "__pycache__",
                                                                              ".ipynb_checkpoints", "build/"))], added


def load_course_py(dist):
    spec = importlib.util.spec_from_file_location("student_course", dist / "course.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_students_set_up_pins_the_courses_torch(dist, monkeypatch):
    course = load_course_py(dist)
    makefile = (ROOT / "Makefile").read_text()
    assert f"TORCH_SPEC ?= torch=={course.TORCH_VERSION}\n" in makefile
    assert f"torch {course.TORCH_VERSION}" in (dist / "README.md").read_text()
    monkeypatch.delenv("TORCH_SPEC", raising=False)
    monkeypatch.setattr(course.platform, "system", lambda: "Linux")
    monkeypatch.setattr(course, "has_nvidia_gpu", lambda: False)
    assert course.torch_spec() == [f"torch=={course.TORCH_VERSION}", "--index-url", course.CPU_INDEX]
    monkeypatch.setattr(course, "has_nvidia_gpu", lambda: True)
    assert course.torch_spec() == [f"torch=={course.TORCH_VERSION}"]   # PyPI's Linux wheel: the CUDA build
    monkeypatch.setattr(course.platform, "system", lambda: "Darwin")
    monkeypatch.setattr(course, "has_nvidia_gpu", lambda: False)
    assert course.torch_spec() == [f"torch=={course.TORCH_VERSION}"]   # PyPI's macOS wheel is the CPU build
    monkeypatch.setenv("TORCH_SPEC", "torch==2.6.0 --index-url https://example.org/whl")
    assert course.torch_spec() == ["torch==2.6.0", "--index-url", "https://example.org/whl"]


def test_the_students_commands(dist):
    readme = (dist / "README.md").read_text()
    assert "python3 course.py\n" in readme.replace("  #", "\n").replace(" \n", "\n") or "python3 course.py  " in readme
    assert "python3 course.py check labs/lab1_collectives.ipynb" in readme
    assert "3.10" not in readme and "Python 3.11" in readme
    usage = subprocess.run([sys.executable, str(dist / "course.py"), "check"], capture_output=True, text=True,
                           timeout=60)
    assert usage.returncode == 2 and "python3 course.py check" in usage.stderr
    assert not (dist / ".venv").exists(), "a usage error sets nothing up"


def test_a_torch_that_cannot_be_installed_says_where_else_to_get_it(dist, monkeypatch, capsys):
    """pip seeing PyPI only fails on PyTorch's index: the message names the variables that choose another source."""
    course = load_course_py(dist)
    monkeypatch.setattr(course.venv, "create", lambda *a, **k: None)
    monkeypatch.delenv("TORCH_SPEC", raising=False)

    def pip(*args):
        raise subprocess.CalledProcessError(1, ["pip", "install", *args])
    monkeypatch.setattr(course, "pip", pip)
    assert course.main([]) == 1
    err = capsys.readouterr().err
    assert f'TORCH_SPEC="torch=={course.TORCH_VERSION}" python3 course.py' in err and 'PIP_OPTIONS="--proxy' in err
    assert "about 6 GB installed" in err and "fix what pip said above" in err
    assert not (dist / ".venv" / ".course-installed").exists()


def test_jupyterlab_options_pass_through_and_check_runs_every_part(dist, monkeypatch):
    course = load_course_py(dist)
    monkeypatch.setattr(course, "set_up", lambda: None)
    calls = []
    monkeypatch.setattr(course.subprocess, "run",
                        lambda command, **kwargs: calls.append(command) or SimpleNamespace(returncode=0))
    assert course.main(["--allow-root", "--no-browser"]) == 0
    assert calls[-1][-3:] == ["lessons/00_launching.ipynb", "--allow-root", "--no-browser"]
    assert course.main(["check", "labs/lab1_collectives.ipynb"]) == 0 and "--keep-going" in calls[-1]
    assert course.main(["lessons"]) == 2 and len(calls) == 2   # neither `check` nor an option: usage


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
