"""A lesson's first cell on Colab, as far as a CPU can take it: a fake `google.colab` module, the student
repository `make distribution` writes (cloned for real, from a local copy standing in for GitHub; its release is on a
branch that is not the repository's default), pip's resolution of the course's install (--dry-run: nothing is
installed here), then `import utils` from the clone."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from utils.tools import distribution, release

REPO = "https://github.com/acme/dp-student"
BRANCH = "fall26"                                     # make distribution ... BRANCH=fall26
ROOT = Path(__file__).resolve().parents[1]

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
    """The student repository as `make distribution BRANCH=fall26` writes it, committed on that branch (the GitHub
    repository's stand-in), whose default branch (main, checked out) holds no course: a clone of it has no utils."""
    repo = tmp_path_factory.mktemp("colab") / "dp-student"
    repo.mkdir()
    git = ["git", "-C", str(repo), "-c", "user.email=ci@example.org", "-c", "user.name=ci"]
    subprocess.run(git[:3] + ["init", "-q", "-b", "main"], check=True)
    subprocess.run(git + ["commit", "-q", "--allow-empty", "-m", "the default branch"], check=True)
    subprocess.run(git + ["checkout", "-q", "-b", BRANCH], check=True)
    distribution.write_distribution(repo, REPO, BRANCH)
    subprocess.run(git + ["add", "-A"], check=True)
    subprocess.run(git + ["commit", "-qm", "distribution"], check=True)
    subprocess.run(git + ["checkout", "-q", "main"], check=True)
    return repo


def setup_cell(notebook: Path, text: str | None = None) -> str:
    cells = json.loads(notebook.read_text() if text is None else text)["cells"]
    return "".join(next(c for c in cells if c["cell_type"] == "code")["source"])


def test_the_first_cell_clones_installs_and_imports_on_colab(student_repo, tmp_path):
    released = subprocess.run(["git", "-C", str(student_repo), "show", f"{BRANCH}:lessons/00_launching.ipynb"],
                              capture_output=True, text=True, check=True).stdout
    source = setup_cell(student_repo, released)
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
    branch = subprocess.run(["git", "-C", str(clone), "branch", "--show-current"], capture_output=True, text=True)
    assert branch.stdout.strip() == BRANCH, "the cell clones the release's branch, not the default one"
    ran = [line for line in done.stdout.splitlines() if line.startswith("ran:")]
    assert ran[0] == f"ran: git clone --branch {BRANCH} -q --depth 1 {REPO} {clone}", done.stdout
    assert ran[1].endswith(f"pip install -q -e {clone} --dry-run") and len(ran) == 2, done.stdout  # check=True: pip
    assert "4 ranks will use backend 'gloo'" in done.stdout, done.stdout   # utils imported from the clone
    again = subprocess.run([sys.executable, "-c", PRELUDE + cell], cwd=content, env=env, capture_output=True,
                           text=True, timeout=600)
    assert again.returncode == 0 and "ran:" not in again.stdout, "a second run reuses the clone"


NOTEBOOKS = sorted([*(ROOT / "lessons").glob("*.ipynb"), *(ROOT / "labs").glob("*.ipynb")])


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.name)
def test_every_setup_cell_clones_the_releases_branch(notebook):
    source = setup_cell(notebook)
    released = release.rewrite_links(source, "code", notebook.name, REPO, BRANCH)
    assert released.count(f'"git", "clone", "--branch", "{BRANCH}",') == 1, released
    assert release.rewrite_links(released, "code", notebook.name, REPO, "main").count('"--branch", "main",') == 1
    assert release.without_links(released) == release.without_links(source), "grading still tells them apart"


def test_a_clone_the_release_cannot_point_at_a_branch_is_refused():
    cell = 'COURSE_REPO = "https://github.com/a/b"\nos.system(f"git clone {COURSE_REPO}")'
    with pytest.raises(release.LabFormatError, match="branch"):
        release.rewrite_links(cell, "code", "lab.ipynb", REPO, BRANCH)
