"""Run every lesson and lab headless on a machine with CUDA, in each configuration a student meets, and report.

    python -m utils.tools.gpu_check [--jobs J] [--only NAME ...] [--out build/gpu-check]      (make gpu-check)

The configurations and which notebook runs in which, with what parameters, are data: utils/tools/gpu_configs.json.
- one-gpu: one GPU visible, the notebook's own parameters (Colab): 1-rank launches use NCCL on the GPU, multi-rank
  launches use gloo on the CPU (utils.backend_for).
- one-rank-nccl: one GPU visible, the rank count set to 1 (notebooks that allow it): NCCL on the GPU.
- gpu-per-rank: one GPU per rank, NCCL: where the machine has as many GPUs as the notebook's largest rank count.
Each notebook runs on a fresh kernel (papermill, as `make run`), several at a time (--jobs; default: one per 4
cores, at most 4). The report has one line per notebook and configuration — ok, FAILED with the first error, or
skipped with why — then the GPU-specific lines the notebooks printed (the 'figures' patterns of the data file:
lesson 01's memory from the CUDA allocator, lines naming NCCL or CUDA). It goes to the console and to
<out>/report.txt; executed copies to <out>/<configuration>/. Without CUDA it says so in one line and exits 1;
exit 1 too when a notebook failed, 0 otherwise.
"""
import argparse
import concurrent.futures
import json
import multiprocessing
import os
import pathlib
import re
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
CONFIGS = pathlib.Path(__file__).with_name("gpu_configs.json")


def load_plan(path: pathlib.Path = CONFIGS) -> dict:
    """The data file, with every notebook of lessons/ and labs/ present (a missing one is an error to fix)."""
    plan = json.loads(path.read_text())
    found = {p.relative_to(ROOT).as_posix() for folder in ("lessons", "labs") for p in (ROOT / folder).glob("*.ipynb")}
    missing = sorted(found - set(plan["notebooks"]))
    if missing:
        raise SystemExit(f"gpu-check: {', '.join(missing)} not in {path.name}: add each with its rank parameters")
    return plan


def rank_need(ranks: dict) -> int:
    """The largest rank count a notebook's parameters ask for (lists count by their largest entry)."""
    return max([max(v) if isinstance(v, list) else v for v in ranks.values()], default=0)


def jobs_for(gpus: int, plan: dict, only=None) -> list:
    """(configuration, notebook, parameters, visible GPUs, why skipped or None) for every notebook and configuration."""
    jobs = []
    for notebook, entry in plan["notebooks"].items():
        if only and not any(name in notebook for name in only):
            continue
        jobs.append(("one-gpu", notebook, {}, "0", None))
        if "one-rank-nccl" in entry:
            jobs.append(("one-rank-nccl", notebook, entry["one-rank-nccl"], "0", None))
        need = rank_need(entry["ranks"])
        if need < 2:
            why = "no rank-count parameter: its launches choose their own rank counts"
        elif gpus < need:
            why = f"needs {need} GPUs (one per rank), this machine has {gpus}"
        else:
            why = None
        jobs.append(("gpu-per-rank", notebook, {}, ",".join(map(str, range(gpus))), why))
    return jobs


def first_error(exc: BaseException) -> str:
    """The first line that says what went wrong (papermill's error names the cell's exception)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    named = [line for line in lines if re.match(r"^\w+(Error|Exception|Timeout)\b", line)]
    return (named or lines or [type(exc).__name__])[0][:300]


def run_one(job: tuple, out: pathlib.Path, timeout: int) -> tuple:
    """Execute one notebook in its configuration (in this process, which the pool made for it); (status, s, detail)."""
    config, notebook, parameters, visible, _ = job
    os.environ["CUDA_VISIBLE_DEVICES"] = visible          # before torch initialises CUDA in the kernel
    import papermill

    from .kernels import ipc_kernel_manager_class

    source = ROOT / notebook
    target = out / config / source.name
    target.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    log = target.with_suffix(".kernel.log")
    try:
        with open(log, "wb") as output, ipc_kernel_manager_class(output=output) as kernel_manager_class:
            papermill.execute_notebook(str(source), str(target), parameters=parameters, cwd=str(source.parent),
                                       kernel_name="python3", progress_bar=False, execution_timeout=timeout,
                                       kernel_manager_class=kernel_manager_class)
        return "ok", time.perf_counter() - start, ""
    except Exception as exc:  # noqa: BLE001 — one failing notebook must not stop the others
        return "FAILED", time.perf_counter() - start, first_error(exc)


def figures(executed: pathlib.Path, patterns: list, most: int = 12) -> list:
    """The output lines of an executed notebook that match one of `patterns` (at most `most`)."""
    import nbformat

    found = []
    for cell in nbformat.read(str(executed), as_version=4).cells:
        for output in cell.get("outputs", []):
            text = output.get("text", "") or output.get("data", {}).get("text/plain", "")
            found += [line for line in str(text).splitlines() if any(re.search(p, line) for p in patterns)]
    return found[:most]


def report_line(config: str, notebook: str, status: str, seconds=None, detail: str = "") -> str:
    """One line of the report: configuration, notebook, status, seconds, and what failed or why skipped."""
    took = f"{seconds:6.1f} s" if seconds is not None else " " * 8
    return f"{config:14s} {notebook:44s} {status:8s} {took}  {detail}".rstrip()


def describe_machine() -> tuple:
    """(number of CUDA GPUs, a line naming torch, CUDA and the GPUs); 0 GPUs when CUDA is not available."""
    import torch

    if not torch.cuda.is_available():
        return 0, f"torch {torch.__version__} sees no CUDA GPU"
    names = [f"{torch.cuda.get_device_name(i)} ({torch.cuda.get_device_properties(i).total_memory / 2**30:.0f} GiB)"
             for i in range(torch.cuda.device_count())]
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl") else "?"
    return len(names), (f"torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {nccl}, "
                        f"{len(names)} GPU{'s' if len(names) > 1 else ''}: {', '.join(names)}")


def check(gpus: int, machine: str, out: pathlib.Path, jobs: int, timeout: int, only=None, runner=run_one) -> int:
    """Run the plan; print and write the report; exit status (1 when a notebook failed)."""
    plan = load_plan()
    todo = jobs_for(gpus, plan, only)
    out.mkdir(parents=True, exist_ok=True)
    lines = [f"gpu-check: {machine}"]
    print(lines[0], flush=True)
    results = {}
    # a fresh process per notebook: spawned, never forked (this process has initialised CUDA), each setting its
    # own CUDA_VISIBLE_DEVICES; a stand-in runner (the tests') runs in threads
    runnable = [job for job in todo if job[4] is None]
    pool = (concurrent.futures.ProcessPoolExecutor(max_workers=jobs, max_tasks_per_child=1,
                                                   mp_context=multiprocessing.get_context("spawn"))
            if runner is run_one else concurrent.futures.ThreadPoolExecutor(max_workers=jobs))
    with pool:
        futures = {pool.submit(runner, job, out, timeout): job for job in runnable}
        for future in concurrent.futures.as_completed(futures):
            job = futures[future]
            results[job[:2]] = future.result()
            status, seconds, detail = results[job[:2]]
            print(report_line(job[0], job[1], status, seconds, detail), flush=True)
    lines += [report_line(c, n, *results[(c, n)]) if why is None else report_line(c, n, "skipped", None, why)
              for c, n, _, _, why in todo]
    lines.append("figures (GPU-specific lines the notebooks printed):")
    for (config, notebook), (status, _, _) in sorted(results.items()):
        executed = out / config / pathlib.Path(notebook).name
        if executed.exists():
            lines += [f"  {config} {notebook}: {line.strip()}"
                      for line in figures(executed, plan["notebooks"][notebook].get("figures", []))]
    failed = [key for key, (status, _, _) in results.items() if status != "ok"]
    lines.append(f"gpu-check: {len(results)} runs, {len(results) - len(failed)} ok, {len(failed)} failed, "
                 f"{len(todo) - len(results)} skipped")
    (out / "report.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[1:]), flush=True)
    return 1 if failed else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m utils.tools.gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "build" / "gpu-check")
    parser.add_argument("--jobs", type=int, default=max(1, min(4, (os.cpu_count() or 1) // 4)),
                        help="notebooks at a time (default: one per 4 cores, at most 4)")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per cell")
    parser.add_argument("--only", nargs="*", help="only notebooks whose path contains one of these")
    args = parser.parse_args(argv)
    gpus, machine = describe_machine()
    if gpus == 0:
        print(f"gpu-check: no CUDA GPU here ({machine}); run it on a machine with one (README, 'On a GPU')")
        return 1
    return check(gpus, machine, args.out, args.jobs, args.timeout, args.only)


if __name__ == "__main__":
    sys.exit(main())
