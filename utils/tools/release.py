"""Write student copies of the labs: solutions replaced by a stub, hidden tests removed, outputs cleared.

A lab notebook marks what students must not see with nbgrader's markers, so the same files also work
with nbgrader:

    def average(values):
        # BEGIN SOLUTION
        return sum(values) / len(values)
        # END SOLUTION

becomes, in the student copy,

    def average(values):
        # YOUR CODE HERE
        raise NotImplementedError()

and every `# BEGIN HIDDEN TESTS` ... `# END HIDDEN TESTS` region of a test cell disappears, markers included.

Cell metadata (nbgrader's) says which cells are what:
    solution cell    {"nbgrader": {"solution": true,  "grade": false, "grade_id": "...", "locked": false}}
    graded test cell {"nbgrader": {"solution": false, "grade": true,  "grade_id": "<part>", "points": 3,
                                   "locked": true}}
The graded test cells are the lab's parts; `utils.tools.grade` judges them.

Links in the copy lead to the student copy, not to the reference: the "Open in Colab" badge of a lab points
to `labs/<lab>.ipynb` in the *student repository*, and the setup cell's `COURSE_REPO = "..."` (what Colab
clones) to that repository. The student repository is the course with labs/ holding these copies (the
reference, with its solutions, stays private: INSTRUCTORS.md). Its URL is --student-repo; the default is the
lab's own repository with "-student" appended (github.com/dp-from-scratch/dp-from-scratch-student).

Command line (what `make release` runs):
    python -m utils.tools.release labs --out release [--student-repo https://github.com/you/course-student]
"""

from __future__ import annotations

import argparse
import copy
import re
import sys
import warnings
from pathlib import Path

import nbformat

SOLUTION = "SOLUTION"
HIDDEN_TESTS = "HIDDEN TESTS"
CODE_STUB = "# YOUR CODE HERE\nraise NotImplementedError()"
TEXT_STUB = "YOUR ANSWER HERE"

# A marker line is a comment holding only the marker: "# BEGIN SOLUTION", "### END HIDDEN TESTS", ...
_MARKER_LINE = re.compile(r"^(?P<indent>[ \t]*)#+[ \t]*(?P<which>BEGIN|END)[ \t]+(?P<what>SOLUTION|HIDDEN TESTS)[ \t]*$")
# Any mention of a marker word, used to catch malformed markers (nbgrader would act on those).
_MARKER_WORDS = re.compile(r"(BEGIN|END)[ \t]+(SOLUTION|HIDDEN TESTS)")

# Links the student copy rewrites: a Colab badge's target, and the repository the setup cell clones on Colab.
_COLAB_URL = re.compile(r"https://colab\.research\.google\.com/github/(?P<owner>[\w.-]+)/(?P<repo>[\w.-]+)"
                        r"/blob/[^\s)\"'<>]+")
_COURSE_REPO_LINE = re.compile(r"^(?P<lead>[ \t]*COURSE_REPO[ \t]*=[ \t]*)(?P<quote>[\"'])[^\"'\n]*(?P=quote)", re.M)
# The setup cell's clone command ("git", "clone", ...), with the branch a student copy adds to it, if there is one.
_CLONE_COMMAND = re.compile(r"(?P<clone>(?P<q>[\"'])git(?P=q),[ \t]*(?P=q)clone(?P=q),)"
                            r"(?P<branch>[ \t]*(?P=q)--branch(?P=q),[ \t]*(?P=q)[^\"'\n]*(?P=q),)?")
_GITHUB_REPO = re.compile(r"^https://github\.com/(?P<owner>[\w.-]+)/(?P<repo>[\w.-]+?)(\.git)?/?$")
_BRANCH = re.compile(r"^[\w./-]+$")
DEFAULT_STUDENT_REPO = "https://github.com/dp-from-scratch/dp-from-scratch-student"


class LabFormatError(ValueError):
    """A lab notebook whose markers or nbgrader metadata are inconsistent."""


def nbgrader_meta(cell) -> dict:
    """The cell's nbgrader metadata ({} when it has none)."""
    return cell.get("metadata", {}).get("nbgrader", {}) or {}


def is_solution_cell(cell) -> bool:
    """A cell students fill in (its solution regions are replaced in the student copy)."""
    return bool(nbgrader_meta(cell).get("solution", False))


def is_graded_test_cell(cell) -> bool:
    """An autograded part: a locked test cell that scores its points when it runs without raising."""
    meta = nbgrader_meta(cell)
    return bool(meta.get("grade", False)) and not meta.get("solution", False)


def read_notebook(path) -> nbformat.NotebookNode:
    """Read a notebook as nbformat v4, without the format's deprecation chatter."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return nbformat.read(str(path), as_version=4)


def write_notebook(nb, path) -> None:
    """Write a notebook, creating parent folders."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        nbformat.write(nb, str(path))


def _source(cell) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def marker_regions(source: str, what: str, where: str = "cell") -> list[tuple[int, int, str]]:
    """(begin line, end line, indentation) of each `BEGIN what` ... `END what` region in source.

    Raises LabFormatError for an unmatched or nested marker, naming `where`.
    """
    regions, begin, indent = [], None, ""
    for number, line in enumerate(source.split("\n")):
        match = _MARKER_LINE.match(line)
        if not match or match["what"] != what:
            continue
        if match["which"] == "BEGIN":
            if begin is not None:
                raise LabFormatError(f"{where}: 'BEGIN {what}' on line {number + 1} inside another region")
            begin, indent = number, match["indent"]
        else:
            if begin is None:
                raise LabFormatError(f"{where}: 'END {what}' on line {number + 1} without a BEGIN")
            regions.append((begin, number, indent))
            begin = None
    if begin is not None:
        raise LabFormatError(f"{where}: 'BEGIN {what}' on line {begin + 1} is never closed")
    return regions


def replace_regions(source: str, what: str, stub: str | None, where: str = "cell") -> str:
    """source with every `what` region (markers included) replaced by stub, indented like its BEGIN line.

    stub=None removes the regions.
    """
    lines = source.split("\n")
    for begin, end, indent in reversed(marker_regions(source, what, where)):
        new = [] if stub is None else [indent + stub_line for stub_line in stub.split("\n")]
        lines[begin:end + 1] = new
    return "\n".join(lines)


def student_source(cell, where: str = "cell") -> str:
    """The source a student sees for this cell."""
    source = _source(cell)
    stub = CODE_STUB if cell.get("cell_type") == "code" else TEXT_STUB
    if marker_regions(source, SOLUTION, where):
        source = replace_regions(source, SOLUTION, stub, where)
    elif is_solution_cell(cell):
        source = stub  # nbgrader's rule: a solution cell without markers is the solution as a whole
    return replace_regions(source, HIDDEN_TESTS, None, where)


def default_student_repo(nb) -> str:
    """The lab's own GitHub repository (from its Colab badge or COURSE_REPO) with "-student" appended."""
    for cell in nb.cells:
        source = _source(cell)
        match = _COLAB_URL.search(source)
        if match:
            return f"https://github.com/{match['owner']}/{match['repo']}-student"
        match = _COURSE_REPO_LINE.search(source)
        if match:
            url = _GITHUB_REPO.match(match.group(0).split(match["quote"])[1])
            if url:
                return f"https://github.com/{url['owner']}/{url['repo']}-student"
    return DEFAULT_STUDENT_REPO


def check_student_repo(url: str, branch: str = "main") -> None:
    """ValueError unless url is https://github.com/OWNER/NAME (Colab opens notebooks from GitHub) and branch
    is a plain branch name."""
    if not _GITHUB_REPO.match(url or ""):
        raise ValueError(f"--student-repo {url!r}: give the student repository as https://github.com/OWNER/NAME "
                         "(Colab's badge opens notebooks from GitHub)")
    if not _BRANCH.match(branch or ""):
        raise ValueError(f"--branch {branch!r} is not a branch name")


def rewrite_links(source: str, cell_type: str, lab_file: str, student_repo: str, branch: str = "main",
                  folder: str = "labs") -> str:
    """source with this notebook's Colab badge pointing at <folder>/<lab_file> in the student repository and
    (code cells) COURSE_REPO = that repository, cloned at `branch` (the badge's: a clone without --branch would
    take the repository's default branch, which may be another)."""
    repo = _GITHUB_REPO.match(student_repo)
    target = (f"https://colab.research.google.com/github/{repo['owner']}/{repo['repo']}/blob/{branch}/"
              f"{folder}/{lab_file}")
    if cell_type == "markdown":
        return _COLAB_URL.sub(lambda m: target if m.group(0).rsplit("/", 1)[-1] == lab_file else m.group(0), source)
    if cell_type == "code":
        clean = f"https://github.com/{repo['owner']}/{repo['repo']}"
        rewritten, found = _COURSE_REPO_LINE.subn(lambda m: f"{m['lead']}{m['quote']}{clean}{m['quote']}", source)
        if found and "clone" in source:
            rewritten, clones = _CLONE_COMMAND.subn(
                lambda m: f"{m['clone']} {m['q']}--branch{m['q']}, {m['q']}{branch}{m['q']},", rewritten)
            if not clones:
                raise LabFormatError(f"{lab_file}: a setup cell names COURSE_REPO and clones, but not with a "
                                     '["git", "clone", ...] command this release can point at its branch')
        return rewritten
    return source


def without_links(source: str) -> str:
    """source with the links rewrite_links changes blanked: for telling a released cell from the reference's."""
    return _CLONE_COMMAND.sub(lambda m: m["clone"],
                              _COURSE_REPO_LINE.sub("COURSE_REPO = ...", _COLAB_URL.sub("<colab>", source)))


def solution_functions(nb) -> set:
    """The names of the functions and classes the notebook's solution cells define (what students write)."""
    import ast

    names = set()
    for cell in nb.cells:
        if cell.get("cell_type") == "code" and is_solution_cell(cell):
            try:
                tree = ast.parse(_source(cell))
            except SyntaxError:
                continue
            names |= {node.name for node in tree.body
                      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    return names


def names_used(source: str) -> list:
    """The names a cell's code mentions, in order of first use ([] if it does not parse)."""
    import ast

    try:
        return list(dict.fromkeys(node.id for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Name)))
    except SyntaxError:
        return []


def check_lab(nb, name: str = "lab") -> list[tuple[str, int]]:
    """Check a lab's markers and nbgrader metadata; return its parts as [(grade_id, points), ...].

    Rules (nbgrader's, so both tools agree): markers are whole comment lines, balanced and not nested;
    solution regions only in solution cells; hidden tests only in graded test cells; grade_ids unique;
    every graded test cell has non-negative points; at least one part.
    """
    parts, seen = [], set()
    for index, cell in enumerate(nb.cells):
        where = f"{name}, cell {index}"
        source, meta = _source(cell), nbgrader_meta(cell)
        for number, line in enumerate(source.split("\n")):
            if _MARKER_WORDS.search(line) and not _MARKER_LINE.match(line):
                raise LabFormatError(f"{where}, line {number + 1}: marker text outside a marker comment: {line.strip()!r}")
        if marker_regions(source, SOLUTION, where) and not is_solution_cell(cell):
            raise LabFormatError(f"{where}: solution markers in a cell whose nbgrader metadata lacks solution: true")
        if marker_regions(source, HIDDEN_TESTS, where) and not is_graded_test_cell(cell):
            raise LabFormatError(f"{where}: hidden tests in a cell that is not a graded test cell")
        if not meta:
            continue
        grade_id = meta.get("grade_id")
        if (meta.get("grade") or meta.get("solution") or meta.get("locked")) and not grade_id:
            raise LabFormatError(f"{where}: nbgrader cell without a grade_id")
        if grade_id in seen:
            raise LabFormatError(f"{where}: grade_id {grade_id!r} used twice")
        seen.add(grade_id)
        if is_graded_test_cell(cell):
            points = meta.get("points")
            if isinstance(points, bool) or not isinstance(points, (int, float)) or points < 0:
                raise LabFormatError(f"{where}: graded test cell {grade_id!r} needs points >= 0, has {points!r}")
            parts.append((grade_id, points))
    if not parts:
        raise LabFormatError(f"{name}: no graded test cells (nbgrader grade: true, solution: false)")
    return parts


def clear_run(cell) -> None:
    """Remove what running a cell left in it: outputs, execution count, timings."""
    cell.metadata.pop("execution", None)  # run timings left by papermill / nbclient
    cell.metadata.pop("papermill", None)
    if cell.cell_type == "code":
        cell.outputs, cell.execution_count = [], None


def clear_notebook_run(nb) -> None:
    """Remove the notebook-level metadata a run leaves (papermill's record, widget state)."""
    for key in ("papermill", "widgets"):
        nb.metadata.pop(key, None)


def student_copy(nb, name: str = "lab", student_repo: str | None = None, branch: str = "main") -> nbformat.NotebookNode:
    """The student version of a lab notebook (the input is left unchanged); `name` is its file name, for the
    links (see the module docstring; student_repo None: default_student_repo)."""
    check_lab(nb, name)
    student_repo = student_repo or default_student_repo(nb)
    check_student_repo(student_repo, branch)
    lab_file = name if name.endswith(".ipynb") else f"{name}.ipynb"
    released = copy.deepcopy(nb)
    for index, cell in enumerate(released.cells):
        cell.source = rewrite_links(student_source(cell, f"{name}, cell {index}"), cell.get("cell_type"), lab_file,
                                    student_repo, branch)
        clear_run(cell)
    clear_notebook_run(released)
    leftovers = [i for i, cell in enumerate(released.cells) if _MARKER_WORDS.search(cell.source)]
    assert not leftovers, f"{name}: markers left in cells {leftovers}"
    return released


def lab_notebooks(labs_dir) -> list[Path]:
    """The lab notebooks in a folder (checkpoints skipped), sorted by name."""
    return sorted(p for p in Path(labs_dir).glob("*.ipynb") if not p.name.startswith("."))


def release_labs(labs_dir, out_dir, student_repo: str | None = None, branch: str = "main") -> list[Path]:
    """Write the student copy of every lab in labs_dir to out_dir (same file names); return the paths.

    Every lab is checked before anything is written."""
    labs = [(path, read_notebook(path)) for path in lab_notebooks(labs_dir)]
    checked = [(path, nb, check_lab(nb, path.name)) for path, nb in labs]
    written = []
    for path, nb, parts in checked:
        repo = student_repo or default_student_repo(nb)
        target = Path(out_dir) / path.name
        write_notebook(student_copy(nb, path.name, repo, branch), target)
        total = sum(points for _, points in parts)
        print(f"{path} -> {target}: {len(parts)} graded parts, {total:g} points "
              f"({', '.join(f'{gid} {points:g}' for gid, points in parts)}); links lead to "
              f"{repo} (branch {branch}, labs/{path.name})")
        written.append(target)
    return written


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m utils.tools.release", description=__doc__.split("\n")[0])
    parser.add_argument("labs", help="folder with the reference lab notebooks (e.g. labs)")
    parser.add_argument("--out", default="release", help="folder for the student copies (default: release)")
    parser.add_argument("--student-repo", default=None,
                        help="https://github.com/OWNER/NAME where students find these copies (in labs/): the Colab "
                             "badge and the setup cell's COURSE_REPO point there (default: the lab's repository "
                             "with -student appended)")
    parser.add_argument("--branch", default="main", help="the student repository's branch (default: main)")
    args = parser.parse_args(argv)
    if not Path(args.labs).is_dir():
        parser.error(f"{args.labs} is not a folder")
    if Path(args.out).exists() and not Path(args.out).is_dir():
        parser.error(f"--out {args.out} exists and is not a folder")
    try:
        check_student_repo(args.student_repo or DEFAULT_STUDENT_REPO, args.branch)
    except ValueError as error:
        parser.error(str(error))
    try:
        written = release_labs(args.labs, args.out, args.student_repo, args.branch)
    except LabFormatError as error:
        print(f"release stopped: {error}", file=sys.stderr)
        return 1
    if not written:
        print(f"no lab notebooks in {args.labs}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
