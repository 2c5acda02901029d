"""Grading many submissions: each one prepared, judged by its verdicts, run for feedback; then the reports."""
from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

from ..release import LabFormatError
from . import __doc__ as PACKAGE_DOC  # noqa: N812
from . import sandbox
from .job import DEFAULT_MAX_OUTPUT, Job, Limits
from .preparation import prepare
from .processes import REPO_ROOT, exit_on_signals, make_undumpable, short_temporary_folder
from .reports import num, write_reports
from .submissions import find_submissions, load_labs
from .verdicts import InProcess, VerdictError, load_module

# ------------------------------------------------------------------ grading many

def grade(submissions: list, labs: dict, out_dir, limits: Limits = None, jobs=1, log=print, sandbox=None) -> list:
    """Grade each submission (at most `jobs` at a time), each in its own view of `sandbox` (sandbox.Sandbox; None:
    unsandboxed); return their Outcomes in the given order."""
    limits = limits or Limits()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    pending = list(enumerate(submissions))
    running, outcomes = [], [None] * len(submissions)
    try:
        while pending or running:
            while pending and len(running) < jobs:
                index, sub = pending.pop(0)
                running.append((index, Job(sub, labs[sub.lab], out_dir, limits, sandbox)))
            for item in list(running):
                index, job = item
                if job.poll():
                    running.remove(item)
                    outcome = outcomes[index] = job.finish()
                    log(f"{outcome.student:>16}  {outcome.lab:<24} {num(outcome.points):>5}/{num(outcome.max_points):<5}"
                        f" {outcome.status:<12} {outcome.seconds:6.1f} s")
            time.sleep(0.05)
    finally:  # interrupted (Ctrl-C): leave nothing running
        for _, job in running:
            job.abort()
    return outcomes


# ------------------------------------------------------------------ command line

def print_parts(labs: dict) -> None:
    """Each lab's parts and points, how its verdicts run them, and which of its cells they run."""
    for lab in labs.values():
        module = load_module(lab.verdicts)
        try:
            shown = lab.verdicts.relative_to(Path.cwd())
        except ValueError:
            shown = lab.verdicts
        print(f"{lab.name}: {len(lab.parts)} parts, {num(lab.max_points)} points (verdicts: {shown})")
        for grade_id, points in lab.parts:
            spec = module.PARTS[grade_id]
            where = "in one process" if isinstance(spec, InProcess) else \
                f"on {', '.join(map(str, spec.world_sizes))} ranks"
            print(f"    {grade_id:<28} {num(points):>4}   {spec.what}, {where}")
        print(f"  verdicts run, from the lab's cells by cell id (each cell's \"id\" in the notebook file): "
              f"{', '.join(verdict_cells(lab)) or '(none)'}, then the solution cells")


def verdict_cells(lab) -> list:
    """The lab's cells the verdicts run, by cell id: 'a0c9d43b' (the whole cell: imports and definitions) or
    'a0c9d43b (definitions)' (a cell that also prints or launches: only its definitions)."""
    out = []
    for label, _ in prepare(lab.nb, lab).cells:
        if label.startswith("<lab cell "):
            number, _, rest = label.strip("<>").removeprefix("lab cell ").partition(",")
            cell = lab.nb.cells[int(number) - 1]
            out.append(f"{cell.get('id') or 'cell ' + number}{' (definitions)' if rest else ''}")
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m utils.tools.grade", description=PACKAGE_DOC.split("\n")[0])
    parser.add_argument("submissions", nargs="*", help="folders or .ipynb files to grade")
    parser.add_argument("--out", default="build/grades", help="report folder (default: build/grades)")
    parser.add_argument("--labs", default=None, help="folder of reference labs (default: ./labs, else the course's labs/)")
    parser.add_argument("--verdicts", default=None,
                        help="folder of the labs' verdict modules (default: utils/tools/grade/verdicts)")
    parser.add_argument("--student", default=None, help="owner of files not named <student>__<lab>.ipynb")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds for each of a submission's two runs, verdicts and notebook (default: the lab's "
                             "own limit, else 600)")
    parser.add_argument("--cell-timeout", type=float, default=None,
                        help="seconds per notebook cell (default: the lab's own limit, else 300)")
    parser.add_argument("--verdict-timeout", type=float, default=None,
                        help="seconds per verdict step, one part at one world size (default: the lab's own limit, "
                             "else 60)")
    parser.add_argument("--max-output", type=int, default=DEFAULT_MAX_OUTPUT,
                        help="bytes a notebook cell may print (default 1 MiB)")
    parser.add_argument("--jobs", type=int, default=1, help="submissions graded at once (default 1)")
    parser.add_argument("--parts", action="store_true", help="list the labs' parts and points, grade nothing")
    parser.add_argument("--merge", action="store_true",
                        help="regrade: replace only these submissions' rows in --out's gradebook, keep everyone else's "
                             "rows and feedback")
    parser.add_argument("--no-sandbox", action="store_true",
                        help="grade without the sandbox (student code then runs with your rights: it can read the "
                             "reference labs and other submissions); every report says so")
    parser.add_argument("--memory-limit", type=float, default=sandbox.Limits.memory / sandbox.GIB,
                        help="GiB of address space per sandboxed process (default %(default)g)")
    parser.add_argument("--roster", default=None,
                        help="CSV of id, name, email (ids as the LMS names them) for the gradebook")
    args = parser.parse_args(argv)
    for name in ("timeout", "cell_timeout", "verdict_timeout", "max_output", "jobs", "memory_limit"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")

    labs_dir = Path(args.labs) if args.labs else (Path("labs") if Path("labs").is_dir() else REPO_ROOT / "labs")
    if not labs_dir.is_dir():
        parser.error(f"{labs_dir} is not a folder of labs")
    if args.verdicts and not Path(args.verdicts).is_dir():
        parser.error(f"--verdicts {args.verdicts} is not a folder")
    try:
        labs = load_labs(labs_dir, args.verdicts)
    except (LabFormatError, VerdictError) as error:
        print(f"grading stopped: {error}", file=sys.stderr)
        return 1
    if not labs:
        print(f"no lab notebooks in {labs_dir}", file=sys.stderr)
        return 1
    if args.parts:
        print_parts(labs)
        return 0
    if not args.submissions:
        parser.error("give a folder of submissions (make grade SUBMISSIONS=dir)")
    if Path(args.out).exists() and not Path(args.out).is_dir():
        parser.error(f"--out {args.out} exists and is not a folder")
    if args.roster and not Path(args.roster).is_file():
        parser.error(f"--roster {args.roster} is not a file")
    unpacked = short_temporary_folder("grade-archives-")  # .zip exports are unpacked here, removed at the end
    try:
        return _grade_found(args, labs, labs_dir, unpacked)
    finally:
        shutil.rmtree(unpacked, ignore_errors=True)


def _grade_found(args, labs, labs_dir, unpacked) -> int:
    from .reports import read_roster

    submissions, problems = find_submissions(args.submissions, labs, args.student, unpack_into=unpacked)
    for problem in problems:
        print(f"warning: {problem}", file=sys.stderr)
    if not submissions:
        print("no submissions to grade", file=sys.stderr)
        return 1
    limits = Limits(args.timeout, args.cell_timeout, args.verdict_timeout, args.max_output)
    for name in sorted({s.lab for s in submissions}):
        own = limits.for_lab(labs[name])
        print(f"grading {sum(s.lab == name for s in submissions)} submissions of {name} against {labs_dir} (limits: "
              f"{own.timeout:g} s per run, {own.cell_timeout:g} s per cell, {own.verdict_timeout:g} s per verdict step)")
    box, warning = None, ""
    if args.no_sandbox:
        warning = sandbox.UNSANDBOXED_WARNING
        print(warning, file=sys.stderr)
    else:
        try:
            box = sandbox.Sandbox(sandbox.Limits(memory=int(args.memory_limit * sandbox.GIB)))
        except sandbox.SandboxUnavailable as error:
            print(f"grading refused: student code must run in a sandbox, and {error}", file=sys.stderr)
            return 1
    make_undumpable()  # the processes running student code are our descendants: keep them out of our memory
    exit_on_signals()  # SIGTERM and SIGHUP clean up like Ctrl-C
    try:
        outcomes = grade(submissions, labs, args.out, limits, args.jobs, sandbox=box)
    except KeyboardInterrupt:
        print("grading interrupted: every process it started is stopped; no reports written", file=sys.stderr)
        return 130
    finally:
        if box is not None:
            box.close()
    write_reports(outcomes, args.out, problems, merge=args.merge,
                  roster=read_roster(args.roster) if args.roster else None, warning=warning)
    print(f"wrote {Path(args.out) / 'gradebook.csv'}, grades.csv, summary.csv, feedback/ ({len(outcomes)} submissions"
          f"{', merged into the previous reports' if args.merge else ''})")
    return 0
