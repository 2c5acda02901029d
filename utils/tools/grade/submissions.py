"""The reference labs and the submissions to grade: which file is whose, for which lab.

SUBMISSIONS is a folder (or notebook files) laid out in either way, mixed freely:
    SUBMISSIONS/<student>/<lab>.ipynb        e.g. submitted/ada/lab1_collectives.ipynb
    SUBMISSIONS/<student>__<lab>.ipynb       e.g. submitted/ada__lab1_collectives.ipynb
Deeper folders (nbgrader's submitted/<student>/<assignment>/<lab>.ipynb) count the first folder as the
student. A file whose name is not a lab's name (e.g. "lab1_collectives (1).ipynb") is matched to the lab
whose grade_ids it carries. LMS exports are recognised as they come (the student is the LMS's id):
    Canvas   SUBMISSIONS/<lastnamefirstname>[_late]_<user id>_<submission id>_<file>.ipynb   (flat; a re-upload
             of the same name is <file>-1.ipynb; "_late" marks a late file; the user id is not the SIS id)
    Moodle   SUBMISSIONS/<Full Name>_<participant id>_assignsubmission_file_/<file>.ipynb   ("Participant <id>"
             in Moodle's grading worksheet)
A .zip export can be given as it is: it is unpacked, and its entries' order and dates say which file is newer.
When a student has two files for a lab, the newest is graded: by Canvas's submission id, then the archive's
entry date and order, then a re-upload suffix ("-1", " (1)"); never by file times (unzipping does not keep
them). The report says which file was taken.
"""
from __future__ import annotations

import ast
import re
import zipfile
from dataclasses import dataclass, field
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
    limits: dict = field(default_factory=dict)   # the lab's own time limits (lab_limits), in seconds

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



def _defines(node) -> bool:
    """An import, a def or class, or an assignment of a constant: what a verdict may run of a lab cell."""
    if isinstance(node, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return True
    if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
        try:
            ast.literal_eval(node.value)
            return True
        except Exception:  # not a constant
            return False
    return False


def definitions_in(cell) -> str:
    """The definitions (imports, functions, classes, constants) of a lab cell that also does other things
    (prints, launches, plots), taken out by its syntax tree: what a student's solution may call once the
    notebook ran that cell (lab 1's `halving_doubling_ranges`), so verdicts provide it too without running the
    cell. "" for a solution, test or definition cell (those run whole, or not at all) and for a cell without
    any."""
    if cell.get("cell_type") != "code" or is_solution_cell(cell) or is_graded_test_cell(cell) \
            or is_definition_cell(cell):
        return ""
    source = release.student_source(cell)
    try:
        tree = ast.parse(source)
    except SyntaxError:  # e.g. IPython magics
        return ""
    lines = source.splitlines()
    pieces = []
    for node in tree.body:
        if _defines(node):
            first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
            pieces.append("\n".join(lines[first - 1:node.end_lineno]))
    return "\n\n".join(pieces)

LIMIT_NAMES = ("timeout", "cell_timeout", "verdict_timeout")


def lab_limits(nb, module=None) -> dict:
    """A lab's own time limits: the verdict module's LIMITS, overridden by the notebook's metadata
    {"grading": {"timeout": s, "cell_timeout": s, "verdict_timeout": s}}; only positive numbers count.
    The grader's command-line options override both."""
    limits = {}
    for source in (getattr(module, "LIMITS", None) or {}, nb.metadata.get("grading", {}) or {}):
        for name in LIMIT_NAMES:
            value = source.get(name)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
                limits[name] = float(value)
    return limits


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
                              str(getattr(module, "NOTE", "")), lab_limits(nb, module))
    return labs


@dataclass
class Submission:
    student: str
    lab: str | None     # None: no lab matched
    path: Path
    name: str = ""      # the student's name as the LMS wrote it (Canvas: lastnamefirstname; Moodle: Full Name)
    lms: str = ""       # "canvas", "moodle" or "" (the course's own layouts, nbgrader's)
    late: bool = False  # Canvas marked the file late
    order: tuple = field(default_factory=tuple)   # larger is newer (see the module docstring)
    note: str = ""      # which of several files was taken, and why

    @property
    def lms_id(self) -> str:
        """The id the LMS's grade import matches: Moodle's "Participant <id>", Canvas's user id."""
        return f"Participant {self.student}" if self.lms == "moodle" else self.student if self.lms else ""


_CANVAS = re.compile(r"^(?P<name>[a-z0-9-]+?)(?P<late>_late)?_(?P<user>\d+)_(?P<sub>\d+)_(?P<file>.+)$")
_MOODLE = re.compile(r"^(?P<name>.+)_(?P<participant>\d+)_assignsubmission_(?:file|onlinetext)_?$")
_REUPLOAD = re.compile(r"^(?P<stem>.+?)(?:-(?P<dash>\d+)| \((?P<paren>\d+)\))$")


def _reupload(stem: str) -> tuple[str, int]:
    """(the file's name without a re-upload suffix, the suffix's number: 0 for none)."""
    match = _REUPLOAD.match(stem)
    if not match:
        return stem, 0
    return match["stem"], int(match["dash"] or match["paren"])


def unpack(archive, folder) -> dict:
    """Unpack a .zip export into folder; return {path: (date, entry number)} of every file, for telling which
    of two files is newer (the files' own times are not kept). Entries that would land outside folder are
    skipped."""
    folder = Path(folder).resolve()
    order = {}
    with zipfile.ZipFile(archive) as zf:
        for number, info in enumerate(zf.infolist()):
            target = (folder / info.filename).resolve()
            if info.is_dir() or folder not in target.parents:
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            with zf.open(info) as source:
                target.write_bytes(source.read(MAX_NOTEBOOK_BYTES + 1))
            order[target] = (info.date_time, number)
    return order


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


def _owner(relative: Path, path: Path, student: str | None, base: Path | None = None):
    """Submission fields (student, stem, name, lms, late, order) from where a file lies, or None. A Moodle
    student's folder given itself (base) counts like that folder inside SUBMISSIONS."""
    if base is not None and len(relative.parts) == 1 and _MOODLE.match(base.name):
        relative = Path(base.name) / relative
    first, stem = relative.parts[0], path.stem
    if len(relative.parts) > 1:
        moodle = _MOODLE.match(first)
        if moodle:
            base, again = _reupload(stem)
            return dict(student=moodle["participant"], stem=base, name=moodle["name"], lms="moodle", order=(again,))
        return dict(student=first, stem=stem, order=(_reupload(stem)[1],))
    canvas = _CANVAS.match(stem)
    if canvas:
        base, again = _reupload(canvas["file"])
        return dict(student=canvas["user"], stem=base, name=canvas["name"], lms="canvas", late=bool(canvas["late"]),
                    order=(int(canvas["sub"]), again))
    if "__" in stem:
        owner, stem = stem.rsplit("__", 1)
        return dict(student=owner, stem=stem, order=(_reupload(stem)[1],))
    if student:
        return dict(student=student, stem=stem, order=(_reupload(stem)[1],))
    return None


def find_submissions(paths, labs: dict, student: str | None = None, unpack_into=None) -> tuple[list, list]:
    """Submissions found under paths (folders, .ipynb files, or .zip exports), and problems to report.

    A file right inside a given folder (or given itself) must be named <student>__<lab>.ipynb or as Canvas
    names it, unless `student` names its owner (e.g. student="reference" to grade the reference labs
    themselves). A .zip is unpacked into a new folder inside `unpack_into` (required for archives).
    """
    found, problems = [], []
    for root in map(Path, paths):
        archive_order = {}
        if root.is_file() and root.suffix == ".zip":
            if unpack_into is None:
                problems.append(f"{root}: archives need a folder to unpack into")
                continue
            folder = Path(unpack_into) / f"{len(list(Path(unpack_into).iterdir()))}-{root.stem}"
            try:
                archive_order = unpack(root, folder)
            except (zipfile.BadZipFile, OSError) as error:
                problems.append(f"{root}: not a readable .zip ({error})")
                continue
            root = folder
        if root.is_file():
            files, base = [root], root.parent
        elif root.is_dir():
            files = sorted(p for p in root.rglob("*.ipynb")
                           if ".ipynb_checkpoints" not in p.parts and not p.name.startswith(".")
                           and "__MACOSX" not in p.parts)
            base = root
        else:
            problems.append(f"{root}: no such file or folder")
            continue
        for path in files:
            owner = _owner(path.relative_to(base), path, student, base)
            if owner is None:
                problems.append(f"{path}: cannot tell the student; name it <student>__<lab>.ipynb, "
                                "put it in a <student>/ folder, or pass --student")
                continue
            stem, order = owner.pop("stem"), owner.pop("order")
            entry = archive_order.get(path.resolve())
            # newest first by the LMS's id, then the archive entry (date, position), then a re-upload suffix
            order = (order[:-1] + ((entry,) if entry else ((),)) + order[-1:])
            found.append(Submission(lab=_match_lab(stem, path, labs), path=path, order=order, **owner))
    graded, seen = [], {}
    for sub in found:
        if sub.lab is None:
            problems.append(f"{sub.path}: does not match any lab ({', '.join(labs)}); not graded")
            continue
        seen.setdefault((sub.student, sub.lab), []).append(sub)
    for key, subs in seen.items():
        # sorted() is stable: files that tie keep their found (name) order, and the last one is taken
        ranked = sorted(subs, key=lambda s: (len(s.order), s.order))
        kept = ranked[-1]
        if len(subs) > 1:
            tie = ranked[-2].order == kept.order
            why = ("could not tell which is newest (no LMS id, archive date or re-upload suffix differs): "
                   "took the last by name" if tie else "the newest")
            others = ", ".join(s.path.name for s in ranked[:-1])
            kept.note = f"graded {kept.path.name}, {why}, of {len(subs)} files for {kept.lab} (not graded: {others})"
            problems.append(f"{kept.student}: {kept.note}")
        graded.append(kept)
    graded.sort(key=lambda s: found.index(s))
    return graded, problems
