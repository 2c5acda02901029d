"""Autograde submitted lab notebooks: points from trusted verdicts, feedback from the notebook's own run.

    python -m utils.tools.grade SUBMISSIONS --out build/grades        (what `make grade SUBMISSIONS=dir` runs)
    python -m utils.tools.grade --parts                               (list every lab's parts, points, verdicts)

For each submission (layouts: utils/tools/grade/submissions.py) the grader

  1. prepares it (preparation.py): every cell that is not a solution cell is taken from the reference lab; the
     submission contributes its solution cells (and cells the student added, which only the feedback run sees);
  2. judges it (checker.py, pool.py, verdicts/): a process that runs no student code starts fresh processes that
     run the lab's import and helper cells plus the *source text* of the solution cells (rank.py), hands each one its
     own inputs drawn from the OS's cryptographic source, gets raw tensors and numbers back (wire.py, never a
     pickle) and compares them with what it computes itself. Points come only from these verdicts: a part
     scores its points when its verdict passes, else 0;
  3. runs the prepared notebook for feedback (notebook.py): a fresh working folder, its own session, a fresh
     kernel over IPC sockets, every cell even after a failing one, each cell time- and output-limited, so the
     student sees their notebook's own check messages and the instructor gets the executed copy;
  4. kills every process either run started, on every path, and removes its private folder (TMPDIR inside).

Outputs in --out (reports.py): gradebook.csv (one row per student, for an LMS), grades.csv (student, lab, part,
points, max), summary.csv (one line per submission), feedback/<student>.txt, executed/<student>/<lab>.ipynb, logs/.
`--merge` regrades: only the submissions graded now are replaced. Submissions may come as Canvas or Moodle name them,
or as a .zip export (submissions.py); `--roster` names the students.

Defences are against cheating in Python (rebinding or patching the checks, patching torch, forged objects,
searching for fixed seeds). What a verdict process measures about itself (bytes sent, messages, "point-to-point
only") can be faked there and is advisory. Every process that runs student code (the verdict ranks, the feedback
worker and kernel) runs in the submission's sandbox (sandbox.py: bubblewrap; no reference labs, verdict modules,
other submissions or reports in sight, no network, limited memory, CPU and processes); where it cannot start,
grading is refused unless --no-sandbox (INSTRUCTORS.md, "The sandbox").
"""

_EXPORTS = {
    "job": ["DEFAULT_TIMEOUT", "DEFAULT_CELL_TIMEOUT", "DEFAULT_VERDICT_TIMEOUT", "DEFAULT_MAX_OUTPUT", "Limits",
            "Job"],
    "cli": ["grade", "main", "print_parts"],
    "sandbox": ["Sandbox", "SandboxUnavailable"],
    "preparation": ["Prepared", "prepare"],
    "processes": ["kill_tree"],
    "reports": ["Outcome", "feedback_text", "gradebook_rows", "read_roster", "write_reports"],
    "submissions": ["Lab", "Submission", "find_submissions", "is_definition_cell", "load_labs"],
}
__all__ = [name for names in _EXPORTS.values() for name in names]


def __getattr__(name):
    """The public names, imported on first use (the verdict processes import this package, and need none)."""
    import importlib

    for module, names in _EXPORTS.items():
        if name in names:
            return getattr(importlib.import_module(f"{__name__}.{module}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
