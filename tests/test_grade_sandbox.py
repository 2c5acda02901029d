"""The grader's sandbox (utils/tools/grade/sandbox.py) under attack: one grading run of the fixture lab.

Three attacking submissions, graded in the same run (two at a time) as an honest one (alice's, all right), each of
their solution functions answering right only if its attack worked:

  reader  average: the answer key by a path derived from the course's own modules (utils.__file__)
          ring:    the answer key by searching the filesystem (any notebook with a solution, any verdict module)
          chunks:  another student's submission (alice's), found on the filesystem
  writer  average: write into the grades, another student's feedback and another student's submission
          ring:    a network connection: to a server on the grader's own loopback, and to the internet
          chunks:  the hidden tests' source (the verdict module, the private reference formulas)
  hog     average: a 20 GB allocation;  ring: right (still earns its points);  chunks: fork without end

Each attack scores 0 on what it tries to gain, with a line that says why, and the honest submission keeps its
exact points. tests/test_release_grade.py grades the other fixture submissions (hangs, crashes, floods).
Needs bubblewrap: skipped where the sandbox cannot start, failed instead where COURSE_REQUIRE_SANDBOX=1 (CI).
"""
import csv
import shutil
import socket
import tempfile
import threading
from pathlib import Path

import nbformat
import psutil
import pytest

from utils.tools import release
from labtesting import run_grader, sandbox_arguments

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
LAB = FIXTURES / "labs" / "lab0_fixture.ipynb"
HONEST = {"alice": FIXTURES / "submissions" / "alice" / "lab0_fixture.ipynb"}
MARKER = "987.654"   # the fork bomb's children run `sleep 987.654`: none may outlive the grading

# Shared by the attacks: exec the solution cell `grade_id` of the first notebook found that has it.
STEAL = '''
def _steal(paths, grade_id, name, mine=None):
    import json
    for path in paths:
        try:
            if mine and os.path.samefile(path, mine):
                continue
            cells = json.load(open(path))["cells"]
        except Exception:
            continue
        for cell in cells:
            source = "".join(cell["source"])
            if cell.get("metadata", {}).get("nbgrader", {}).get("grade_id") == grade_id and "NotImplemented" not in source:
                namespace = {}
                exec(source.replace("# BEGIN SOLUTION", "").replace("# END SOLUTION", ""), namespace)
                return namespace[name]
    raise RuntimeError(f"attack failed: no {grade_id} found")


def _walk(*suffixes):
    for top in ("/tmp", "/root", "/home", "/work", "/srv", "/opt", "/var", "/mnt", "/run"):
        for folder, dirs, files in os.walk(top):
            dirs[:] = [d for d in dirs if d not in (".venv", "lib", "site-packages", "include", "share", ".git")]
            for name in files:
                if name.endswith(suffixes):
                    yield os.path.join(folder, name)
'''

READER = {
    "average_solution": STEAL + '''
import os, utils
from pathlib import Path
_course = Path(utils.__file__).resolve().parents[1]
average = _steal(sorted(_course.rglob("*.ipynb")), "average_solution", "average")
''',
    "ring_solution": STEAL + '''
import os
_keys = [p for p in _walk(".py") if p.endswith(("lab0_fixture.py", "reference.py"))
         and "def _ring_cases" in open(p, errors="replace").read()]   # the verdict module: its formulas
if _keys:
    def ring_neighbours(rank, world_size):
        return (rank - 1) % world_size, (rank + 1) % world_size
    def ring_schedule(world_size):
        return [[(r - s) % world_size for r in range(world_size)] for s in range(world_size - 1)]
else:
    ring_neighbours = _steal(_walk(".ipynb"), "ring_solution", "ring_neighbours")
    ring_schedule = _steal(_walk(".ipynb"), "ring_solution", "ring_schedule")
''',
    "chunks_solution": STEAL + '''
import os
chunk_bounds = _steal((p for p in _walk(".ipynb") if "alice" in p), "chunks_solution", "chunk_bounds",
                      mine=os.path.join(os.getcwd(), "lab0_fixture.ipynb"))
''',
}

WRITER = {
    "average_solution": '''
import os
def average(values):
    written = 0
    for path in {targets!r}:
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                f.write("student,lab,part,points,max\\nwriter,lab0_fixture,average,2,2\\n")
            written += 1
        except OSError:
            pass
    if not written:
        raise RuntimeError("attack failed: nothing outside the sandbox could be written")
    return sum(values) / len(values)
''',
    "ring_solution": '''
import socket
def _reach():
    for address in [("127.0.0.1", {port}), ("1.1.1.1", 53), ("8.8.8.8", 53)]:
        try:
            with socket.create_connection(address, timeout=1) as s:
                return s.recv(100)
        except OSError:
            pass
    raise RuntimeError("attack failed: no network")
def ring_neighbours(rank, world_size):
    _reach()
    return (rank - 1) % world_size, (rank + 1) % world_size
def ring_schedule(world_size):
    _reach()
    return [[(r - s) % world_size for r in range(world_size)] for s in range(world_size - 1)]
''',
    "chunks_solution": '''
import os
def chunk_bounds(length, world_size):
    for path in {hidden!r}:
        if os.path.exists(path):
            open(path).read()
            base, extra = divmod(length, world_size)
            starts = [r * base + min(r, extra) for r in range(world_size + 1)]
            return list(zip(starts, starts[1:]))
    raise RuntimeError("attack failed: the hidden tests' source is not there")
''',
}

HOG = {
    "average_solution": '''
def average(values):
    hoard = bytearray(20 << 30)   # 20 GB
    return sum(values) / len(values) + hoard[0]
''',
    "ring_solution": '''
def ring_neighbours(rank, world_size):
    return (rank - 1) % world_size, (rank + 1) % world_size
def ring_schedule(world_size):
    return [[(r - s) % world_size for r in range(world_size)] for s in range(world_size - 1)]
''',
    "chunks_solution": '''
import os
def chunk_bounds(length, world_size):
    while True:   # fork without end; each child waits
        if os.fork() == 0:
            os.execvp("sleep", ["sleep", "''' + MARKER + '''"])
''',
}


def submission(path: Path, sources: dict):
    nb = release.student_copy(release.read_notebook(LAB), LAB.name)
    for cell in nb.cells:
        grade_id = release.nbgrader_meta(cell).get("grade_id")
        if grade_id in sources:
            cell.source = sources[grade_id]
    nbformat.write(nb, str(path))


@pytest.fixture(scope="module")
def attacked():
    if sandbox_arguments():   # none here, and none required
        pytest.skip("the grader's sandbox cannot start here (bubblewrap: INSTRUCTORS.md, 'The sandbox')")
    server = socket.create_server(("127.0.0.1", 0))   # the grader's loopback: what a connection would reach
    threading.Thread(target=lambda: [server.accept()[0].sendall(b"key") for _ in iter(int, 1)], daemon=True).start()
    folder = Path(tempfile.mkdtemp(prefix="test-sandbox-"))
    try:
        subs, out = folder / "submitted", folder / "grades"
        subs.mkdir()
        for name, path in HONEST.items():
            shutil.copy(path, subs / f"{name}__lab0_fixture.ipynb")
        targets = [str(out / "grades.csv"), str(out / "feedback" / "alice.txt"), str(subs / "alice__lab0_fixture.ipynb")]
        hidden = [str(FIXTURES / "verdicts" / "lab0_fixture.py"), str(ROOT / "utils" / "tools" / "grade" / "reference.py")]
        for path in hidden:
            assert Path(path).exists(), "the attack aims at a file the course has"
        submission(subs / "aaa-reader__lab0_fixture.ipynb", READER)
        submission(subs / "aab-writer__lab0_fixture.ipynb", {k: v.format(targets=targets, port=server.getsockname()[1],
                                                                            hidden=hidden) for k, v in WRITER.items()})
        submission(subs / "aac-hog__lab0_fixture.ipynb", HOG)
        before = {path: Path(path).read_bytes() for path in targets[2:]}
        seconds, log = run_grader([subs, "--labs", FIXTURES / "labs", "--verdicts", FIXTURES / "verdicts",
                                   "--out", out, "--timeout", 120, "--cell-timeout", 15, "--verdict-timeout", 5,
                                   "--jobs", 2], timeout=600)
        with open(out / "grades.csv") as f:
            points = {}
            for row in csv.DictReader(f):
                points.setdefault(row["student"], {})[row["part"]] = row["points"]
        feedback = {p.stem: p.read_text() for p in (out / "feedback").iterdir()}
        yield {"points": points, "feedback": feedback, "before": before, "log": log, "out": out, "seconds": seconds}
    finally:
        server.close()
        shutil.rmtree(folder, ignore_errors=True)


def test_the_answer_key_is_out_of_reach(attacked):
    assert attacked["points"]["aaa-reader"] == {"average": "0", "ring": "0", "chunks": "0"}, attacked["feedback"]["aaa-reader"]
    assert attacked["feedback"]["aaa-reader"].count("attack failed") >= 3, attacked["feedback"]["aaa-reader"]


def test_the_module_path_attack_finds_the_key_outside_the_sandbox():
    """The attack is real: run where the grader runs, the same code finds the reference solution."""
    namespace = {}
    exec(READER["average_solution"], namespace)
    assert namespace["average"]([1.0, 2.0, 3.0, 6.0]) == 3.0


def test_writes_network_and_hidden_tests_gain_nothing(attacked):
    text = attacked["feedback"]["aab-writer"]
    assert attacked["points"]["aab-writer"] == {"average": "0", "ring": "0", "chunks": "0"}, text
    assert text.count("attack failed") >= 3, text
    for path, content in attacked["before"].items():
        assert Path(path).read_bytes() == content, f"{path} was changed"
    assert "writer" not in (attacked["out"] / "grades.csv").read_text().split("aab-writer")[0]


def test_memory_and_process_bombs_fail_only_their_own_parts(attacked):
    """The allocation fails at once; the fork bomb either meets the process limit (its fork raises), or at the
    time limit every process of it waits (a call that waits forever: 0), or, on a busy machine, it still forks at
    the limit and runs out of time twice: "not graded" (never points)."""
    text = attacked["feedback"]["aac-hog"]
    got = attacked["points"]["aac-hog"]
    assert got["average"] == "0" and got["ring"] == "3", text
    assert "MemoryError" in text, text
    if got["chunks"] == "0":
        assert "Resource temporarily unavailable" in text or "a call that waits forever" in text, text
    else:
        assert got["chunks"] == "not graded: ran out of time", text
        assert "while running chunk_bounds" in text or "reached their limit" in text, text   # and on a machine
        # quiet enough to near the limit in time, the message adds "its sandbox held N processes … forks without end"
    left = [p.pid for p in psutil.process_iter(["cmdline"]) if MARKER in " ".join(p.info["cmdline"] or [])]
    assert left == [], "the fork bomb's processes were all killed"


def test_an_honest_submission_keeps_its_exact_points(attacked):
    assert attacked["points"]["alice"] == {"average": "2", "ring": "3", "chunks": "1"}
    assert "WARNING" not in attacked["feedback"]["alice"]
    print(attacked["log"])


def test_a_virtualenv_reached_through_a_symlink_starts_the_sandbox(tmp_path):
    """A grader whose Python is a symlinked virtualenv (a worktree sharing one) still starts its sandbox: before, bwrap
    could not find `<link>/bin/python` and the grader refused, blaming a missing bubblewrap."""
    import subprocess
    import sys

    if sandbox_arguments():
        pytest.skip("the grader's sandbox cannot start here (bubblewrap: INSTRUCTORS.md, 'The sandbox')")
    link = tmp_path / "venv"
    link.symlink_to(Path(sys.prefix).resolve(), target_is_directory=True)
    python = link / "bin" / Path(sys.executable).name
    done = subprocess.run([str(python), "-c", "from utils.tools.grade import sandbox; sandbox.Sandbox().close()"],
                          cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-600:]
