"""What runs for one submission: its feedback notebook, and the cells its verdicts execute.

Every cell that is not a solution cell comes from the reference lab, as the student copy has it (test cells
with their visible checks; the hidden cases are the verdicts' job, with fresh inputs). The submission
contributes only

  - its solution cells (matched by grade_id), which the verdicts run too, and
  - cells the student added (or lab cells they changed, which no longer match the lab's): these run in the
    feedback notebook after the lab cell they followed, but verdicts never see them.

A missing solution cell becomes the released stub; a missing or edited test or locked cell is put back and
the feedback says so.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

import nbformat

from ..release import clear_notebook_run, clear_run, is_solution_cell, nbgrader_meta, student_source, without_links
from .submissions import Lab, definitions_in, is_definition_cell


@dataclass
class Prepared:
    notebook: nbformat.NotebookNode          # the feedback notebook to run
    cells: list                              # [(label, source)] the verdicts run: lab definitions + solutions
    notes: list = field(default_factory=list)


def solution_label(grade_id) -> str:
    return f"<solution cell '{grade_id}'>"


def _fresh(cell, source=None):
    cell = copy.deepcopy(cell)
    clear_run(cell)
    if source is not None:
        cell.source = source
    return cell


def _choose(submitted, reference_by_id) -> dict:
    """{grade_id: position} of the submission's cell that counts for each of the lab's grade_ids: the copy that
    kept the lab's cell id (Jupyter gives a pasted copy a new id), else the first."""
    chosen = {}
    for position, cell in enumerate(submitted.cells):
        grade_id = nbgrader_meta(cell).get("grade_id")
        if grade_id not in reference_by_id:
            continue
        lab_id = reference_by_id[grade_id].get("id")
        keeps_id = lab_id is not None and cell.get("id") == lab_id
        if grade_id not in chosen or (keeps_id and submitted.cells[chosen[grade_id]].get("id") != lab_id):
            chosen[grade_id] = position
    return chosen


def _match_plain(submitted, reference, taken: set) -> dict:
    """{submission position: reference index} for cells without a grade_id: same cell id, else same source
    (links the release rewrites aside)."""
    plain = [i for i, c in enumerate(reference) if not nbgrader_meta(c).get("grade_id")]
    by_id = {reference[i].get("id"): i for i in plain if reference[i].get("id")}
    matched = {}
    for position, cell in enumerate(submitted.cells):
        if nbgrader_meta(cell).get("grade_id") or position in taken:
            continue
        index = by_id.get(cell.get("id"))
        if index is None or index in matched.values():  # e.g. saved by Colab, which drops cell ids
            source = without_links(cell.get("source", "")).strip()
            index = next((i for i in plain if i not in matched.values() and source in (
                without_links(reference[i].source).strip(), without_links(student_source(reference[i])).strip())),
                None)
        if index is not None and index not in matched.values() and cell.get("cell_type") == reference[index].cell_type:
            matched[position] = index
    return matched


def prepare(submitted, lab: Lab) -> Prepared:
    """The feedback notebook and the verdicts' cells for one submission (see the module docstring)."""
    reference = lab.nb.cells
    reference_by_id = {nbgrader_meta(c)["grade_id"]: c for c in reference if nbgrader_meta(c).get("grade_id")}
    index_of = {nbgrader_meta(c)["grade_id"]: i for i, c in enumerate(reference) if nbgrader_meta(c).get("grade_id")}
    chosen = _choose(submitted, reference_by_id)
    matched = {position: index_of[grade_id] for grade_id, position in chosen.items()}
    matched.update(_match_plain(submitted, reference, set(matched)))

    # The student's own cells run after the lab cell they followed.
    after, anchor, own_code = {}, -1, 0
    for position, cell in enumerate(submitted.cells):
        if position in matched:
            anchor = matched[position]
            continue
        cell = _fresh(cell)
        cell.metadata.pop("nbgrader", None)  # a copy of a lab cell runs as ordinary code, unscored
        after.setdefault(anchor, []).append(cell)
        own_code += cell.cell_type == "code"

    submitted_at = {index: submitted.cells[position] for position, index in matched.items()}
    cells, verdict_cells, notes = list(after.get(-1, [])), [], []
    for index, original in enumerate(reference):
        grade_id = nbgrader_meta(original).get("grade_id")
        theirs = submitted_at.get(index)
        if is_solution_cell(original):
            if theirs is None:
                cell = _fresh(original, student_source(original))
                notes.append(f"solution cell '{grade_id}' was missing; the lab's stub was run in its place")
            else:
                cell = _fresh(theirs)
                cell.metadata["nbgrader"] = copy.deepcopy(original.metadata["nbgrader"])
            if cell.cell_type == "code":
                verdict_cells.append((solution_label(grade_id), cell.source))
        else:
            cell = _fresh(original, student_source(original))
            if grade_id and theirs is None:
                notes.append(f"cell '{grade_id}' was missing; the lab's version was put back")
            elif grade_id and without_links(theirs.get("source", "")) not in (without_links(cell.source),
                                                                               without_links(original.source)):
                # (a released copy's links lead to the student repository: not a change)
                notes.append(f"cell '{grade_id}' differed from the lab's; the lab's version was run")
            if is_definition_cell(original):
                verdict_cells.append((f"<lab cell {index + 1}>", cell.source))
            elif definitions_in(original):   # a cell that also prints or launches: its definitions only
                verdict_cells.append((f"<lab cell {index + 1}, its definitions>", definitions_in(original)))
        cells.append(cell)
        cells.extend(after.get(index, []))
    if own_code:
        notes.append(f"{own_code} code cell(s) of your own (or lab cells you changed) ran in the feedback "
                     "notebook; verdicts run only the lab's cells and your solution cells")
    for i, cell in enumerate(cells):
        cell["id"] = f"cell-{i}"  # unique ids whatever the student copied
    notebook = nbformat.v4.new_notebook(metadata=copy.deepcopy(lab.nb.metadata))
    notebook.cells = cells
    clear_notebook_run(notebook)
    return Prepared(notebook, verdict_cells, notes)
