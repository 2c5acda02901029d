"""Kernels the course's tools start (`make run`, the grader) talk over IPC sockets, not TCP.

Over TCP every headless kernel warns "Kernel is running over TCP without encryption"; over IPC with
jupyter_client's default relative path the sockets land in the notebook's folder. utils/tools/kernels.py puts
them in a short private folder under /tmp and removes it; `make run` (utils/tools/run.py) uses it.
"""
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
        assert "1 of 1 notebooks ran" in done.stdout
        assert "without encryption" not in done.stderr + done.stdout
        assert sorted(p.name for p in lessons.iterdir()) == ["tiny.ipynb"]


def test_make_run_refuses_a_missing_folder_before_starting_anything(capsys):
    with pytest.raises(SystemExit) as stopped:
        run.main(["no-such-folder"])
    assert stopped.value.code == 2 and "no-such-folder is not a folder" in capsys.readouterr().err
