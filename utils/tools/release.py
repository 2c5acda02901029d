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
The graded test cells are the lab's parts; `utils.tools.grade` scores them.

Command line (what `make release` runs):
    python -m utils.tools.release labs --out release
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


def student_copy(nb, name: str = "lab") -> nbformat.NotebookNode:
    """The student version of a lab notebook (the input is left unchanged)."""
    check_lab(nb, name)
    released = copy.deepcopy(nb)
    for index, cell in enumerate(released.cells):
        cell.source = student_source(cell, f"{name}, cell {index}")
        clear_run(cell)
    clear_notebook_run(released)
    leftovers = [i for i, cell in enumerate(released.cells) if _MARKER_WORDS.search(cell.source)]
    assert not leftovers, f"{name}: markers left in cells {leftovers}"
    return released


def lab_notebooks(labs_dir) -> list[Path]:
    """The lab notebooks in a folder (checkpoints skipped), sorted by name."""
    return sorted(p for p in Path(labs_dir).glob("*.ipynb") if not p.name.startswith("."))


def release_labs(labs_dir, out_dir) -> list[Path]:
    """Write the student copy of every lab in labs_dir to out_dir (same file names); return the paths."""
    written = []
    for path in lab_notebooks(labs_dir):
        nb = read_notebook(path)
        parts = check_lab(nb, path.name)
        target = Path(out_dir) / path.name
        write_notebook(student_copy(nb, path.name), target)
        total = sum(points for _, points in parts)
        print(f"{path} -> {target}: {len(parts)} graded parts, {total:g} points "
              f"({', '.join(f'{gid} {points:g}' for gid, points in parts)})")
        written.append(target)
    return written


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m utils.tools.release", description=__doc__.split("\n")[0])
    parser.add_argument("labs", help="folder with the reference lab notebooks (e.g. labs)")
    parser.add_argument("--out", default="release", help="folder for the student copies (default: release)")
    args = parser.parse_args(argv)
    if not Path(args.labs).is_dir():
        parser.error(f"{args.labs} is not a folder")
    try:
        written = release_labs(args.labs, args.out)
    except LabFormatError as error:
        print(f"release stopped: {error}", file=sys.stderr)
        return 1
    if not written:
        print(f"no lab notebooks in {args.labs}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
