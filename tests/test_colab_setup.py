"""A lesson's first cell on Colab, as far as a CPU can take it: a fake `google.colab` module, the student
repository `make distribution` writes (cloned for real, from a local copy standing in for GitHub), pip's
resolution of the course's install (--dry-run: nothing is installed here), then `import utils` from the clone."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from utils.tools import distribution

REPO = "https://github.com/acme/dp-student"

# Runs in a fresh interpreter: what Colab's kernel has (google.colab imported), and pip told not to install.
PRELUDE = """
import subprocess, sys, types
sys.modules["google.colab"] = types.ModuleType("google.colab")
_run = subprocess.run
def run(command, *args, **kwargs):
    if command[1:4] == ["-m", "pip", "install"]:
        command = command + ["--dry-run"]          # resolve the course's requirements, install nothing
    print("ran:", " ".join(map(str, command)), flush=True)
    return _run(command, *args, **kwargs)
subprocess.run = run
"""


@pytest.fixture(scope="module")
def student_repo(tmp_path_factory):
    """The student repository as `make distribution` writes it, committed (the GitHub repository's stand-in)."""
    repo = tmp_path_factory.mktemp("colab") / "dp-student"
    distribution.write_distribution(repo, REPO, "main")
    git = ["git", "-C", str(repo), "-c", "user.email=ci@example.org", "-c", "user.name=ci"]
    subprocess.run(git[:3] + ["init", "-q", "-b", "main"], check=True)
    subprocess.run(git + ["add", "-A"], check=True)
    subprocess.run(git + ["commit", "-qm", "distribution"], check=True)
    return repo


def setup_cell(notebook: Path) -> str:
    cells = json.loads(notebook.read_text())["cells"]
    return "".join(next(c for c in cells if c["cell_type"] == "code")["source"])


def test_the_first_cell_clones_installs_and_imports_on_colab(student_repo, tmp_path):
    source = setup_cell(student_repo / "lessons" / "00_launching.ipynb")
    assert f'COURSE_REPO = "{REPO}"' in source and '"google.colab" in sys.modules' in source
    content = tmp_path / "content"                          # Colab's working folder, here in a temporary one
    content.mkdir()
    cell = source.replace('pathlib.Path("/content/', f'pathlib.Path("{content}/')
    assert cell != source, "the cell clones into /content (Colab's folder)"
    env = dict(os.environ, GIT_CONFIG_COUNT="1", GIT_CONFIG_KEY_0=f"url.{student_repo}.insteadOf",
               GIT_CONFIG_VALUE_0=REPO, PYTHONPATH="")     # git fetches REPO from the local copy
    done = subprocess.run([sys.executable, "-c", PRELUDE + cell], cwd=content, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    clone = content / "dp-from-scratch"
    assert (clone / "utils" / "__init__.py").is_file() and (clone / "course.py").is_file()
    ran = [line for line in done.stdout.splitlines() if line.startswith("ran:")]
    assert ran[0] == f"ran: git clone -q --depth 1 {REPO} {clone}", done.stdout
    assert ran[1].endswith(f"pip install -q -e {clone} --dry-run") and len(ran) == 2, done.stdout  # check=True: pip
    assert "4 ranks will use backend 'gloo'" in done.stdout, done.stdout   # utils imported from the clone
    again = subprocess.run([sys.executable, "-c", PRELUDE + cell], cwd=content, env=env, capture_output=True,
                           text=True, timeout=600)
    assert again.returncode == 0 and "ran:" not in again.stdout, "a second run reuses the clone"
