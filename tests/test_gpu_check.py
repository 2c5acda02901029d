"""make gpu-check (utils/tools/gpu_check.py) on a CPU: its one-line refusal without CUDA, its plan, its report."""
import os
import pathlib
import subprocess
import sys

import nbformat

from utils.tools import gpu_check

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_without_cuda_it_says_so_in_one_line_and_fails():
    done = subprocess.run([sys.executable, "-m", "utils.tools.gpu_check"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert done.returncode == 1 and done.stderr == "", done.stderr
    assert done.stdout.count("\n") == 1 and done.stdout.startswith("gpu-check: no CUDA GPU here"), done.stdout


def test_every_notebook_has_a_plan_and_one_gpu_skips_the_gpu_per_rank_runs():
    plan = gpu_check.load_plan()            # raises when a lesson or lab is missing from gpu_configs.json
    jobs = gpu_check.jobs_for(1, plan)
    configs = {(c, n): why for c, n, _, _, why in jobs}
    assert all(configs[("one-gpu", n)] is None for n in plan["notebooks"])
    assert configs[("gpu-per-rank", "lessons/03_allreduce_from_scratch.ipynb")] == \
        "needs 4 GPUs (one per rank), this machine has 1"
    assert ("one-rank-nccl", "lessons/00_launching.ipynb") in configs
    on_four = {(c, n): (params, visible, why) for c, n, params, visible, why in gpu_check.jobs_for(4, plan)}
    assert on_four[("gpu-per-rank", "lessons/02_four_replicas.ipynb")] == ({}, "0,1,2,3", None)


def test_the_report_has_a_line_per_notebook_and_configuration(tmp_path, capsys):
    def runner(job, out, timeout):
        config, notebook = job[:2]
        executed = out / config / pathlib.Path(notebook).name
        executed.parent.mkdir(parents=True, exist_ok=True)
        cell = nbformat.v4.new_code_cell("")
        cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text="peak 1.5 GiB from the CUDA allocator\n")]
        nbformat.write(nbformat.v4.new_notebook(cells=[cell]), str(executed))
        failing = notebook.endswith("00_launching.ipynb") and config == "one-rank-nccl"
        return ("FAILED", 1.0, "RuntimeError: NCCL error") if failing else ("ok", 2.0, "")

    status = gpu_check.check(1, "a stand-in GPU", tmp_path, jobs=2, timeout=60, only=["00_", "01_"], runner=runner)
    report = (tmp_path / "report.txt").read_text().splitlines()
    assert status == 1 and report[0] == "gpu-check: a stand-in GPU"
    assert report[1].split()[:3] == ["one-gpu", "lessons/00_launching.ipynb", "ok"]
    assert report[2].split()[:3] == ["one-rank-nccl", "lessons/00_launching.ipynb", "FAILED"]
    assert report[2].endswith("RuntimeError: NCCL error")
    assert report[3].split()[:3] == ["gpu-per-rank", "lessons/00_launching.ipynb", "skipped"]
    assert report[3].endswith("needs 4 GPUs (one per rank), this machine has 1")
    assert report[5].split()[2:] == ["skipped", "no", "rank-count", "parameter:", "its", "launches", "choose",
                                     "their", "own", "rank", "counts"]
    assert "  one-gpu lessons/01_one_gpu_baseline.ipynb: peak 1.5 GiB from the CUDA allocator" in report
    assert report[-1] == "gpu-check: 3 runs, 2 ok, 1 failed, 2 skipped"
