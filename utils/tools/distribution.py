"""Write the student distribution: a self-contained folder to push as the students' repository.

    python -m utils.tools.distribution DIR --student-repo https://github.com/OWNER/NAME [--branch main]

DIR receives exactly
    README.md            for students (what to install, how to open the notebooks, how to hand in a lab)
    course.py            their set-up and two commands (utils/tools/student_start.py): open the lessons, check a lab
    .gitignore           the environment, egg-info, executed copies
    pyproject.toml       the course's, so `pip install -e .` works (its readme, README.md, is the one above)
    environment.yml      the conda environment
    lessons/             every lesson notebook (with its outputs; the instructors' note on lab links dropped)
                         and lessons/scripts/
    benchmarks/          the benchmark scripts the lessons point to (they use only utils)
    labs/                the released labs (utils.tools.release: solutions stubbed, hidden tests removed)
    utils/               the course's package, without the grader (utils/tools/grade/: verdicts, hidden
                         cases, the private reference formulas) and without the release tools
and nothing else. Every Colab badge opens the notebook in the student repository (github/OWNER/NAME/blob/
BRANCH/...), and every setup cell clones that repository's BRANCH (COURSE_REPO; `--branch`). Labs sit in labs/ beside utils/, where
their setup cell looks for it (Path.cwd().parent). An existing DIR is replaced, except its .git folder, so the
command can refresh a clone of the student repository in place.
"""
from __future__ import annotations

import argparse
import re
import shutil
import sys
from pathlib import Path

from . import release

ROOT = Path(__file__).resolve().parents[2]
# What the distribution leaves out of utils/: the grader (verdicts and their hidden cases; reference.py, the
# private reference formulas), the tools that write the student copies and the website.
PRIVATE = ("tools/grade", "tools/release.py", "tools/distribution.py", "tools/student_start.py", "tools/book.py",
           "tools/portable.py", "tools/gpu_check.py")   # the course's own checks: make test-portable, make gpu-check
PRIVATE_SCRIPTS = ("benchmarks/bench_grade_sandbox.py",)   # times the grader, which students do not get
START = "tools/student_start.py"   # written as course.py at the distribution's root

# A lesson's note for instructors beside its lab link, e.g. "(work in the copy your instructor hands out: in the
# course's reference repository this link opens the solutions)": in the students' repository the link opens
# their own copy. Dropped with the punctuation that joins it to the rest of its parentheses.
INSTRUCTOR_NOTE = re.compile(r"(?P<before>\s*\(|;\s*)?(?:work in the copy your instructor hands out:\s*)?"
                             r"in the course's reference repository this link opens the solutions"
                             r"(?P<after>\)|;\s*)?")

GITIGNORE = """\
.venv/
*.egg-info/
__pycache__/
.ipynb_checkpoints/
build/
"""

STUDENT_README = """\
# Data Parallelism from Scratch — student repository

An executable course on how many GPUs train one model: every lesson is a Jupyter notebook that runs a real
multi-process `torch.distributed` job (gloo on a laptop's CPU, NCCL with one GPU per rank). No GPU is needed.

## Open the notebooks
- **Your machine** (Linux or macOS, Python 3.11: the Python the course is tested with), two commands:
  ```bash
  git clone {repo}.git && cd {name}
  python3 course.py                                    # sets up .venv on first use, then opens the lessons
  python3 course.py check labs/lab1_collectives.ipynb  # runs a lab headless: a ✓ or ✗ line for every part
  ```
  The first run installs torch {torch} (the CPU build from PyTorch's wheel index, a small download, unless
  `nvidia-smi` finds a GPU: then the CUDA build) and the course into `.venv`, in a few minutes;
  `TORCH_SPEC="torch==X"` picks another torch (supported: torch {supported}; every notebook runs on both ends).
  Where PyTorch's index cannot be reached (a proxy, a mirror of PyPI only, no network): `PIP_OPTIONS="--proxy
  http://HOST:PORT"` is added to every pip command; `TORCH_SPEC="torch=={torch}"` takes PyPI's build instead (on
  Linux a CUDA build: several GB, about 6 GB installed, and it runs on a CPU too); `TORCH_SPEC=/path/to/torch.whl`
  installs a wheel file you have. Options after `python3 course.py` go to JupyterLab (in a container as root:
  `python3 course.py --allow-root --no-browser`). `check` runs every part of the lab, also after one fails, and
  prints a line for each; the executed copy goes to `build/labs/`: open it to read each check's ✓ lines or the ✗
  that says what to fix.
  With conda instead: `conda env create -f environment.yml && conda activate dp-from-scratch && pip install -e . --no-deps`.
  Open the notebooks from their folders (`lessons/`, `labs/`): their first cell finds the course's `utils`
  package one folder up.
- **Colab:** the *Open in Colab* badge at the top of each notebook. Its first cell clones this repository
  ({repo}) and installs it with `pip install -e`; Colab's own torch and Python are kept (the course is
  tested on Python 3.11 only).

## Lessons and labs
{table}

`benchmarks/` holds the timing scripts some lessons point to (run one with `.venv/bin/python benchmarks/NAME.py`).

## Labs
Each lab says what to write: replace every `raise NotImplementedError()` with your code and run the check cell
below it; a check prints ✓ lines, or says what to fix (the rank, the chunk, the element, expected vs got).
Do not edit the check cells (the grader runs the lab's own copy of them). Hand in the `.ipynb` file the way
your instructor says; your grade comes from the grader's own checks, on fresh inputs.
"""


def _copy_utils(source: Path, target: Path) -> list[Path]:
    written = []
    for path in sorted(source.rglob("*.py")):
        relative = path.relative_to(source)
        if "__pycache__" in relative.parts or any(
                relative.as_posix() == p or relative.as_posix().startswith(p + "/") for p in PRIVATE):
            continue
        (target / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target / relative)
        written.append(target / relative)
    return written


def without_instructor_note(source: str) -> str:
    """source without the lessons' instructors' note on lab links (INSTRUCTOR_NOTE)."""
    def replace(match):
        before, after = (match["before"] or "").strip(), (match["after"] or "").strip()
        if before == "(" and after == ")":
            return ""                                   # "link (note), then" -> "link, then"
        if before == "(":
            return match["before"]                      # "(note; more)" -> "(more)"
        if before == ";" and after == ";":
            return "; "
        return after                                    # "(text; note)" -> "(text)"
    return INSTRUCTOR_NOTE.sub(replace, source)


def _lesson_copy(path: Path, student_repo: str, branch: str):
    nb = release.read_notebook(path)
    for cell in nb.cells:
        cell.source = release.rewrite_links(cell.source, cell.get("cell_type"), path.name, student_repo, branch,
                                            folder="lessons")
        if cell.get("cell_type") == "markdown":
            cell.source = without_instructor_note(cell.source)
    return nb


def supported_torch(root=ROOT) -> tuple:
    """(pinned version, "oldest to newest") from the course's Makefile: TORCH_SPEC, TORCH_OLDEST, TORCH_NEWEST."""
    makefile = (Path(root) / "Makefile").read_text()
    value = {name: re.search(rf"^{name}\s*[?:]?=\s*(?:torch==)?(\S+)", makefile, re.M)[1]
             for name in ("TORCH_SPEC", "TORCH_OLDEST", "TORCH_NEWEST")}
    return value["TORCH_SPEC"], f"{value['TORCH_OLDEST']} to {value['TORCH_NEWEST']}"


def _table(lessons, labs) -> str:
    rows = ["| notebook | |", "|---|---|"]
    for path in lessons:
        rows.append(f"| [lessons/{path.name}](lessons/{path.name}) | lesson |")
    for path in labs:
        rows.append(f"| [labs/{path.name}](labs/{path.name}) | graded lab |")
    return "\n".join(rows)


def write_distribution(out_dir, student_repo: str, branch: str = "main", root=ROOT) -> list[Path]:
    """Write the student distribution to out_dir (see the module docstring); return the files written."""
    root, out = Path(root), Path(out_dir)
    release.check_student_repo(student_repo, branch)
    if out.resolve() == root.resolve() or root.resolve() in out.resolve().parents and \
            out.resolve().relative_to(root.resolve()).parts[0] in ("utils", "labs", "lessons"):
        raise ValueError(f"{out}: write the distribution outside the course's own folders")
    labs = release.lab_notebooks(root / "labs")
    for path in labs:  # every lab checked before anything is written
        release.check_lab(release.read_notebook(path), path.name)
    if out.exists():
        for entry in out.iterdir():
            if entry.name != ".git":
                shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
    out.mkdir(parents=True, exist_ok=True)
    written = release.release_labs(root / "labs", out / "labs", student_repo, branch)
    lessons = sorted(p for p in (root / "lessons").glob("*.ipynb") if not p.name.startswith("."))
    for path in lessons:
        release.write_notebook(_lesson_copy(path, student_repo, branch), out / "lessons" / path.name)
        written.append(out / "lessons" / path.name)
    for folder in ("lessons/scripts", "benchmarks"):
        for path in sorted((root / folder).glob("*.py")):
            if f"{folder}/{path.name}" in PRIVATE_SCRIPTS:
                continue
            (out / folder).mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, out / folder / path.name)
            written.append(out / folder / path.name)
    written += _copy_utils(root / "utils", out / "utils")
    for name in ("pyproject.toml", "environment.yml"):
        shutil.copyfile(root / name, out / name)
        written.append(out / name)
    shutil.copyfile(root / "utils" / START, out / "course.py")
    (out / ".gitignore").write_text(GITIGNORE)
    name = student_repo.rstrip("/").rsplit("/", 1)[-1].removesuffix(".git")
    pinned, supported = supported_torch(root)
    (out / "README.md").write_text(STUDENT_README.format(repo=student_repo.removesuffix(".git"), name=name,
                                                         table=_table(lessons, labs), torch=pinned,
                                                         supported=supported))
    written += [out / "course.py", out / ".gitignore", out / "README.md"]
    return written


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m utils.tools.distribution", description=__doc__.split("\n")[0])
    parser.add_argument("out", help="folder to write (e.g. a clone of the student repository; its .git is kept)")
    parser.add_argument("--student-repo", required=True,
                        help="https://github.com/OWNER/NAME: where students find the course (badges, clone commands)")
    parser.add_argument("--branch", default="main", help="the student repository's branch (default: main)")
    args = parser.parse_args(argv)
    try:
        written = write_distribution(args.out, args.student_repo, args.branch)
    except (ValueError, release.LabFormatError) as error:
        print(f"distribution stopped: {error}", file=sys.stderr)
        return 1
    print(f"wrote {len(written)} files to {args.out}: push it as {args.student_repo} (branch {args.branch})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
