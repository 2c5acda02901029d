"""What does the grader's sandbox cost a submission? The same submission graded with and without it, side by side.

Each round grades one submission twice, `python -m utils.tools.grade … --out DIR` as `make grade` runs it: once in
the sandbox (utils/tools/grade/sandbox.py, bubblewrap) and once with `--no-sandbox`, in an order rotated from
round to round (utils.timing.rotated_rounds), after a warm-up round that is not kept. The time is the whole
grading run's wall clock (start, feedback notebook, verdicts, reports). Prints each variant's median with its
spread, the sandboxed / plain ratio within each round, and utils.timing.compare's verdict on the difference.
Needs bubblewrap (the sandbox's own message says what to install). About 2 minutes per round of lab 1, 30 s
of the fixture lab.

    .venv/bin/python benchmarks/bench_grade_sandbox.py [--lab fixture|lab1] [--rounds 5]
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from utils.timing import Spread, compare, rotated_rounds

ROOT = Path(__file__).resolve().parents[1]
LABS = {  # the submission, and the arguments that point the grader at its lab
    "fixture": (ROOT / "tests" / "fixtures" / "submissions" / "alice",
                ["--labs", str(ROOT / "tests" / "fixtures" / "labs"),
                 "--verdicts", str(ROOT / "tests" / "fixtures" / "verdicts")]),
    "lab1": (ROOT / "labs" / "lab1_collectives.ipynb", []),
}


def grade_once(submission: Path, lab_arguments: list, sandboxed: bool, scratch: Path) -> float:
    """Seconds for one grading run of `submission`; raises if the grader failed."""
    folder = scratch / "submitted"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    if submission.is_dir():
        shutil.copytree(submission, folder / submission.name)
    else:
        shutil.copy(submission, folder / submission.name)
    out = scratch / "out"
    shutil.rmtree(out, ignore_errors=True)
    command = [sys.executable, "-m", "utils.tools.grade", str(folder), "--out", str(out), *lab_arguments,
               *([] if sandboxed else ["--no-sandbox"])]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"the grader failed ({'sandboxed' if sandboxed else 'plain'}):\n{done.stdout}\n{done.stderr}")
    return elapsed


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lab", choices=sorted(LABS), default="fixture")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    submission, lab_arguments = LABS[args.lab]
    variants = ["plain", "sandboxed"]
    times = {v: [] for v in variants}
    with tempfile.TemporaryDirectory(prefix="bench-grade-") as scratch:
        for rep, variant in rotated_rounds(variants, args.rounds):
            elapsed = grade_once(submission, lab_arguments, variant == "sandboxed", Path(scratch))
            if rep >= 0:
                times[variant].append(elapsed)
    load = os.getloadavg()[0]
    print(f"{args.lab}: one submission graded per run, {args.rounds} rounds in rotated order, {os.cpu_count()} cores, "
          f"load average {load:.1f} at the end")
    for variant in variants:
        print(f"  {variant:<10} {Spread.of(times[variant]).format(scale=1, unit='s')}")
    ratio = Spread.of([s / p for p, s in zip(times["plain"], times["sandboxed"])])
    print(f"  sandboxed / plain within a round: {ratio.median:.3f} ("
          + (f"IQR {ratio.q1:.3f}–{ratio.q3:.3f}, " if ratio.count >= 4 else "")
          + f"min–max {ratio.low:.3f}–{ratio.high:.3f})")
    print("  " + compare(times["plain"], times["sandboxed"], "plain", "sandboxed", scale=1, unit="s"))


if __name__ == "__main__":
    main()
