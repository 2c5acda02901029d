"""The reference labs and the submissions to grade: which file is whose, for which lab.

SUBMISSIONS is a folder (or notebook files) laid out in either way, mixed freely:
    SUBMISSIONS/<student>/<lab>.ipynb        e.g. submitted/ada/lab1_collectives.ipynb
    SUBMISSIONS/<student>__<lab>.ipynb       e.g. submitted/ada__lab1_collectives.ipynb
Deeper folders (nbgrader's submitted/<student>/<assignment>/<lab>.ipynb) count the first folder as the
student. A file whose name is not a lab's name (e.g. "lab1_collectives (1).ipynb") is matched to the lab
whose grade_ids it carries.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import nbformat

from .. import release
from ..release import check_lab, is_graded_test_cell, is_solution_cell, lab_notebooks, nbgrader_meta, read_notebook
from . import verdicts

MAX_NOTEBOOK_BYTES = 50 << 20  # a submitted file larger than this is not read


@dataclass
class Lab:
    """A reference lab: its notebook, its parts [(grade_id, points)] in notebook order, and its verdicts."""
    name: str
    path: Path
    nb: nbformat.NotebookNode
    parts: list
    verdicts: Path   # the lab's verdict module (utils/tools/grade/verdicts/<name>.py)
    note: str = ""   # the verdict module's NOTE, for every feedback

    @property
    def max_points(self):
        return sum(points for _, points in self.parts)


def is_definition_cell(cell) -> bool:
    """A code cell, neither a solution nor a test cell, made only of imports, function and class definitions
    and assignments of constants (a docstring allowed): the lab's import cell, its parameters, helpers such
    as lab 1's `exchange`. These are the lab's cells a verdict runs, from the reference, before the solution
    cells; a cell that does anything else (prints, launches, plots, installs) is not run by verdicts."""
    if cell.get("cell_type") != "code" or is_solution_cell(cell) or is_graded_test_cell(cell):
        return False
    try:
        tree = ast.parse(release.student_source(cell))
    except SyntaxError:  # e.g. IPython magics
        return False
    if not tree.body:
        return False
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            continue
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            try:
                ast.literal_eval(node.value)
                continue
            except Exception:  # not a constant
                return False
        return False
    return True


def load_labs(labs_dir, verdicts_dir=None) -> dict:
    """Every reference lab in labs_dir by name (the file stem), with its verdicts.

    Raises LabFormatError on a bad lab and VerdictError on a lab whose verdicts are missing or do not match it.
    """
    labs = {}
    for path in lab_notebooks(labs_dir):
        nb = read_notebook(path)
        parts = check_lab(nb, path.name)
        module = verdicts.load(path.stem, [grade_id for grade_id, _ in parts], verdicts_dir)
        labs[path.stem] = Lab(path.stem, path, nb, parts, verdicts.module_path(path.stem, verdicts_dir),
                              str(getattr(module, "NOTE", "")))
    return labs


@dataclass
class Submission:
    student: str
    lab: str | None     # None: no lab matched
    path: Path


def _grade_ids(path) -> set:
    try:
        if path.stat().st_size > MAX_NOTEBOOK_BYTES:
            return set()
        nb = read_notebook(path)
    except Exception:
        return set()
    return {nbgrader_meta(c).get("grade_id") for c in nb.cells} - {None}


def _match_lab(stem: str, path: Path, labs: dict) -> str | None:
    if stem in labs:
        return stem
    ids = _grade_ids(path)  # a renamed copy still carries the lab's grade_ids
    overlap = {name: len(ids & {nbgrader_meta(c).get("grade_id") for c in lab.nb.cells}) for name, lab in labs.items()}
    best = max(overlap.values(), default=0)
    winners = [name for name, n in overlap.items() if n == best]
    return winners[0] if best > 0 and len(winners) == 1 else None


def find_submissions(paths, labs: dict, student: str | None = None) -> tuple[list, list]:
    """Submissions found under paths (folders or .ipynb files), and problems to report.

    A file right inside a given folder (or given itself) must be named <student>__<lab>.ipynb unless
    `student` names its owner (e.g. student="reference" to grade the reference labs themselves).
    """
    found, problems = [], []
    for root in map(Path, paths):
        if root.is_file():
            files, base = [root], root.parent
        elif root.is_dir():
            files = sorted(p for p in root.rglob("*.ipynb")
                           if ".ipynb_checkpoints" not in p.parts and not p.name.startswith("."))
            base = root
        else:
            problems.append(f"{root}: no such file or folder")
            continue
        for path in files:
            relative = path.relative_to(base)
            if len(relative.parts) > 1:
                owner, stem = relative.parts[0], path.stem
            elif "__" in path.stem:
                owner, stem = path.stem.rsplit("__", 1)
            elif student:
                owner, stem = student, path.stem
            else:
                problems.append(f"{path}: cannot tell the student; name it <student>__<lab>.ipynb, "
                                "put it in a <student>/ folder, or pass --student")
                continue
            found.append(Submission(owner, _match_lab(stem, path, labs), path))
    graded, seen = [], {}
    for sub in found:
        if sub.lab is None:
            problems.append(f"{sub.path}: does not match any lab ({', '.join(labs)}); not graded")
            continue
        key = (sub.student, sub.lab)
        if key in seen:  # keep the file named exactly like the lab, else the first in sorted order
            kept = seen[key]
            if sub.path.stem == sub.lab and kept.path.stem != sub.lab:
                graded[graded.index(kept)] = sub
                kept, sub = sub, kept
                seen[key] = kept
            problems.append(f"{sub.path}: a second submission of {sub.lab} by {sub.student}; "
                            f"graded {kept.path.name} instead")
            continue
        seen[key] = sub
        graded.append(sub)
    return graded, problems
