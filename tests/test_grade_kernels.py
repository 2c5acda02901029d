"""Kernels the course's tools start (`make run`, the grader) talk over IPC sockets, not TCP.

Over TCP every headless kernel warns "Kernel is running over TCP without encryption"; over IPC with
jupyter_client's default relative path the sockets land in the notebook's folder. utils/tools/kernels.py puts
them in a short private folder under /tmp and removes it; `make run` (utils/tools/run.py) uses it.
"""
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import nbformat
import pytest

from utils.tools import run
from utils.tools.kernels import ipc_kernel_manager_class

ROOT = Path(__file__).resolve().parents[1]


def tiny_notebook(folder: Path) -> Path:
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        "import os\nfrom ipykernel import get_connection_info\ninfo = get_connection_info(unpack=True)\n"
        "print(info['transport'], info['ip'])\nprint('cwd files:', sorted(os.listdir()))")])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    path = folder / "tiny.ipynb"
    nbformat.write(nb, str(path))
    return path


def test_a_kernel_over_ipc_runs_and_leaves_no_sockets(capfd):
    from nbclient import NotebookClient

    with tempfile.TemporaryDirectory(prefix="test-kernels-") as folder:
        nb = nbformat.read(str(tiny_notebook(Path(folder))), as_version=4)
        with ipc_kernel_manager_class() as manager_class:
            NotebookClient(nb, kernel_manager_class=manager_class, resources={"metadata": {"path": folder}}).execute()
        transport, ip, files = nb.cells[0].outputs[0]["text"].split("\n", 2)[0].split() + [
            nb.cells[0].outputs[0]["text"].split("\n")[1]]
        assert transport == "ipc" and ip.startswith("/tmp/") and len(ip) < 60, ip
        assert not Path(ip).parent.exists(), "the socket folder is removed"
        assert files == "cwd files: ['tiny.ipynb']", "no sockets in the notebook's folder"
    assert "without encryption" not in capfd.readouterr().err


def test_make_run_uses_ipc_kernels():
    with tempfile.TemporaryDirectory(prefix="test-kernels-") as folder:
        lessons = Path(folder) / "lessons"
        lessons.mkdir()
        tiny_notebook(lessons)
        done = subprocess.run([sys.executable, "-m", "utils.tools.run", lessons, "--out", Path(folder) / "build"],
                              cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "1 notebook executed: 1 without an error, 0 with one" in done.stdout
        assert "without encryption" not in done.stderr + done.stdout
        assert sorted(p.name for p in lessons.iterdir()) == ["tiny.ipynb"]


def test_make_run_refuses_a_missing_folder_before_starting_anything(capsys):
    with pytest.raises(SystemExit) as stopped:
        run.main(["no-such-folder"])
    assert stopped.value.code == 2 and "no-such-folder is neither a folder nor a notebook" in capsys.readouterr().err


def noisy_notebook(path: Path, fail=False):
    """A notebook whose kernel process writes to its own stderr, as ipykernel's log (lesson 00's interrupted
    launch: "[IPKernelApp] ERROR | KeyboardInterrupt caught in kernel.") and torch's C++ log lines do."""
    source = ("import os, sys\nprint('[IPKernelApp] ERROR | stand-in log line', file=sys.__stderr__, flush=True)\n"
              "os.write(2, b'[E1201 c10d] stand-in C++ log line\\n')\nprint('printed by the cell')")
    cells = [nbformat.v4.new_code_cell(source)] + ([nbformat.v4.new_code_cell("raise ValueError('on purpose')")]
                                                   if fail else [])
    nb = nbformat.v4.new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, str(path))


def test_make_run_keeps_the_console_to_its_summary_lines():
    """What a kernel process writes itself goes to a log beside the executed copy, named only when it failed."""
    with tempfile.TemporaryDirectory(prefix="test-kernels-") as folder:
        lessons, build = Path(folder) / "lessons", Path(folder) / "build"
        lessons.mkdir()
        noisy_notebook(lessons / "a_noisy.ipynb")
        noisy_notebook(lessons / "b_failing.ipynb", fail=True)
        tiny_notebook(lessons)
        done = subprocess.run([sys.executable, "-m", "utils.tools.run", lessons, "--out", build],
                              cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert done.returncode == 1, done.stdout + done.stderr
        lines = done.stdout.splitlines()
        assert [line.split()[0] for line in lines[:5]] == ["a_noisy.ipynb", "b_failing.ipynb", "FAILED:", "the",
                                                          "tiny.ipynb"]
        assert lines[2].split() == ["FAILED:", "PapermillExecutionError:", "ValueError:", "on", "purpose"]
        assert lines[3].split() == ["the", "kernel's", "own", "output:", str(build / "lessons" / "b_failing.kernel.log")]
        assert lines[5:] == ["", f"3 notebooks executed: 2 without an error, 1 with one; summary in {build / 'summary.csv'}"], done.stdout
        assert done.stderr == "failed: b_failing.ipynb\n"
        for name in ("a_noisy", "b_failing"):
            log = (build / "lessons" / f"{name}.kernel.log").read_text()
            assert "stand-in log line" in log and "stand-in C++ log line" in log and "printed by" not in log
        tiny_log = build / "lessons" / "tiny.kernel.log"   # empty unless the kernel itself complained (load)
        assert not tiny_log.exists() or tiny_log.read_text().strip(), "an empty log is not kept"
        executed = nbformat.read(str(build / "lessons" / "a_noisy.ipynb"), as_version=4)
        assert executed.cells[0].outputs[0]["text"] == "printed by the cell\n"


def test_make_run_takes_single_notebooks():
    with tempfile.TemporaryDirectory(prefix="test-kernels-") as folder:
        labs = Path(folder) / "labs"
        labs.mkdir()
        path = tiny_notebook(labs)
        noisy_notebook(labs / "other.ipynb")
        done = subprocess.run([sys.executable, "-m", "utils.tools.run", path, "--out", Path(folder) / "build"],
                              cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0 and "1 notebook executed: 1 without an error" in done.stdout, \
            done.stdout + done.stderr
        written = sorted(p.name for p in (Path(folder) / "build" / "labs").iterdir())
        log = Path(folder) / "build" / "labs" / "tiny.kernel.log"   # kept only when the kernel itself complained
        assert written == ["tiny.ipynb"] or written == ["tiny.ipynb", "tiny.kernel.log"] and log.read_text().strip()


def test_keep_going_reports_every_graded_check_of_a_lab():
    """course.py check runs a lab with --keep-going: a failing part does not hide the verdicts of the parts after it,
    and a notebook that ran and failed is not counted as one that did not run."""
    with tempfile.TemporaryDirectory(prefix="test-kernels-") as folder:
        labs = Path(folder) / "labs"
        labs.mkdir()
        cells = []
        for part, source in [("first", "print('✓ first')"), ("second", "raise AssertionError('✗ second: got 3')"),
                             ("third", "print('✓ third')")]:
            cell = nbformat.v4.new_code_cell(source)
            cell.metadata["nbgrader"] = {"grade": True, "grade_id": part, "points": 1}
            cells.append(cell)
        nb = nbformat.v4.new_notebook(cells=cells)
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
        nbformat.write(nb, str(labs / "lab.ipynb"))
        done = subprocess.run([sys.executable, "-m", "utils.tools.run", labs / "lab.ipynb", "--keep-going",
                               "--out", Path(folder) / "build"], cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert done.returncode == 1, done.stdout + done.stderr
        lines = [line.strip() for line in done.stdout.splitlines()]
        assert "FAILED: 1 of 3 checks did not pass (second)" in lines[0], done.stdout
        assert lines[1:4] == ["✓ first", "✗ second: AssertionError: ✗ second: got 3", "✓ third"], done.stdout
        assert "1 notebook executed: 0 without an error, 1 with one" in done.stdout


# A cell that starts a multiprocessing forkserver (as a lesson's utils.launch does) and writes down the kernel's
# multiprocessing folder (pymp-*, where the server's socket is).
FORKSERVER_CELL = ("import multiprocessing, multiprocessing.util\n"
                   "process = multiprocessing.get_context('forkserver').Process(target=len, args=([],))\n"
                   "process.start()\nprocess.join()\n"
                   "open('pymp.txt', 'w').write(multiprocessing.util.get_temp_dir())")


def forkserver_notebook(folder: Path) -> Path:
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(FORKSERVER_CELL)])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, str(folder / "forkserver.ipynb"))
    return folder / "forkserver.ipynb"


def test_a_stopped_kernel_leaves_nothing_in_the_temp_folder():
    # papermill and the grader stop a kernel by killing its process group, forkserver included: neither runs its exit
    # cleanup, and the pymp-* folder stayed in /tmp, one per notebook run. It is in the private folder now.
    from nbclient import NotebookClient

    with tempfile.TemporaryDirectory(prefix="test-kernels-") as folder:
        nb = nbformat.read(str(forkserver_notebook(Path(folder))), as_version=4)
        with ipc_kernel_manager_class() as manager_class:
            NotebookClient(nb, kernel_manager_class=manager_class, resources={"metadata": {"path": folder}}).execute()
        pymp = Path((Path(folder) / "pymp.txt").read_text())
        assert pymp.name.startswith("pymp-") and not pymp.exists(), f"left: {pymp}"


def test_nbval_kernels_leave_nothing_in_the_temp_folder():
    # nbval kills a kernel's process group too: conftest.py gives its kernels a session folder that it removes. The
    # notebook is outside the repository, so the root conftest.py is named as a plugin (python -m pytest: cwd on path).
    with tempfile.TemporaryDirectory(prefix="test-kernels-") as folder:
        path, temp = forkserver_notebook(Path(folder)), Path(folder) / "t"
        temp.mkdir()
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider",
                               "--nbval-lax", "--nbval-current-env", path], cwd=ROOT, capture_output=True, text=True,
                              timeout=300, env=dict(os.environ, TMPDIR=str(temp)))
        assert done.returncode == 0 and "1 passed" in done.stdout, done.stdout + done.stderr
        assert not list(temp.iterdir()), f"left: {[str(p) for p in temp.rglob('*')]}"
        pymp = Path((Path(folder) / "pymp.txt").read_text())
        assert pymp.parent.parent == temp and pymp.parent.name.startswith("nbk-"), pymp
