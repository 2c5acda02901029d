"""Execute every lesson headless, as a student's "Run all" would, and summarise.

    python -m utils.tools.run lessons --out build      every lesson; folders and single notebooks may be named
    python -m utils.tools.run labs/lab1_collectives.ipynb --keep-going   a lab: every part's check runs and is
                                                                         reported, also after one fails

Each notebook runs with papermill (default parameters, the best backend this machine has) in its
own folder as working directory, on a fresh kernel whose channels are IPC sockets in a private folder
(utils/tools/kernels.py); the executed copies go to build/<folder>/ and a summary table (lesson, status,
seconds) to build/summary.csv. The console shows one line per notebook (a failure's whole message on the next)
and the total: what the kernel process itself writes (its log, torch's C++ log lines) goes to
build/<folder>/<notebook>.kernel.log, kept only when not empty and named on the console when the notebook failed. Exit status 1 if any notebook failed; 2, before
anything runs, for a path that is neither a notebook nor a folder holding notebooks.
"""
import argparse
import csv
import pathlib
import sys
import time


def notebooks_in(folder: pathlib.Path) -> list:
    """The notebooks of a folder, sorted (checkpoints and hidden files skipped)."""
    return sorted(p for p in folder.glob("*.ipynb") if not p.name.startswith("."))


def check_results(executed: pathlib.Path) -> list:
    """(part, ✓ or ✗, the ✗'s first line) for each graded check cell (nbgrader's `grade`) of an executed lab."""
    import nbformat

    results = []
    for cell in nbformat.read(str(executed), as_version=4).cells:
        grader = cell.metadata.get("nbgrader", {})
        if cell.cell_type != "code" or not grader.get("grade"):
            continue
        errors = [o for o in cell.get("outputs", []) if o.get("output_type") == "error"]
        if cell.get("execution_count") is None and not errors:
            results.append((grader.get("grade_id", "?"), "·", "not run"))
        elif errors:
            why = f"{errors[0].get('ename', '')}: {errors[0].get('evalue', '')}".strip().splitlines()
            results.append((grader.get("grade_id", "?"), "✗", why[0][:300] if why else ""))
        else:
            results.append((grader.get("grade_id", "?"), "✓", ""))
    return results


def run_notebooks(folder: pathlib.Path, out: pathlib.Path, timeout: int, notebooks=None,
                  keep_going: bool = False) -> list:
    """Execute each notebook of `folder` (or only `notebooks`, paths in it); return (name, status, seconds) rows.

    With keep_going, a failing cell does not stop the notebook: every cell runs, and a lab's graded check cells
    are reported one by one (check_results), so a student sees every part's verdict, not only the first ✗."""
    import papermill

    from .kernels import ipc_kernel_manager_class

    notebooks = notebooks_in(folder) if notebooks is None else notebooks
    (out / folder.name).mkdir(parents=True, exist_ok=True)
    rows = []
    for notebook in notebooks:
        start = time.perf_counter()
        log = out / folder.name / f"{notebook.stem}.kernel.log"
        try:
            with open(log, "wb") as output, ipc_kernel_manager_class(output=output) as kernel_manager_class:
                papermill.execute_notebook(str(notebook), str(out / folder.name / notebook.name),
                                           cwd=str(folder), kernel_name="python3", progress_bar=False,
                                           execution_timeout=timeout, kernel_manager_class=kernel_manager_class,
                                           **({"allow_errors": True} if keep_going else {}))
            status = "ok"
        except Exception as exc:  # noqa: BLE001 — one failing lesson must not stop the others
            status = f"FAILED: {type(exc).__name__}: {str(exc).strip().splitlines()[-1][:200]}"
        seconds = time.perf_counter() - start
        executed = out / folder.name / notebook.name
        checks = check_results(executed) if keep_going and executed.exists() else []
        failing = [part for part, mark, _ in checks if mark != "✓"]
        if checks and status != "ok":
            status = f"FAILED: {len(failing)} of {len(checks)} checks did not pass ({', '.join(failing)})" \
                if failing else status
        rows.append((notebook.name, status, round(seconds, 1)))
        print(f"{notebook.name:40s} {status:10.60s} {seconds:6.1f} s", flush=True)
        for part, mark, why in checks:
            print(f"{'':40s} {mark} {part}" + (f": {why}" if why else ""), flush=True)
        if status != "ok" and not checks:
            print(f"{'':40s} {status}", flush=True)         # a lab check's whole ✗ line: what to fix
        if log.exists() and log.stat().st_size == 0:
            log.unlink()
        elif status != "ok" and log.exists():
            print(f"{'':40s} the kernel's own output: {log}", flush=True)
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m utils.tools.run", description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", type=pathlib.Path, metavar="PATH",
                        help="folders of notebooks (e.g. lessons) or single notebooks (labs/lab1_collectives.ipynb)")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("build"))
    parser.add_argument("--timeout", type=int, default=600, help="seconds per cell")
    parser.add_argument("--keep-going", action="store_true",
                        help="run every cell, also after one fails, and report each graded check (labs)")
    args = parser.parse_args(argv)
    if args.timeout <= 0:
        parser.error("--timeout must be a positive number of seconds")
    runs = []  # (folder, its notebooks to run)
    for path in args.folders:
        if path.is_file() and path.suffix == ".ipynb":
            runs.append((path.parent, [path]))
        elif not path.is_dir():
            parser.error(f"{path} is neither a folder nor a notebook (run from the course's root folder, "
                         "e.g. `lessons`)")
        elif not notebooks_in(path):
            parser.error(f"no notebooks in {path}/")
        else:
            runs.append((path, None))
    rows = []
    for folder, notebooks in runs:
        rows += run_notebooks(folder, args.out, args.timeout, notebooks, keep_going=args.keep_going)
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "summary.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["lesson", "status", "seconds"])
        writer.writerows(rows)
    failed = [name for name, status, _ in rows if status != "ok"]
    print(f"\n{len(rows)} {'notebook' if len(rows) == 1 else 'notebooks'} executed: {len(rows) - len(failed)} "
          f"without an error, {len(failed)} with one; summary in {args.out / 'summary.csv'}")
    if failed:
        print("failed: " + ", ".join(failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
