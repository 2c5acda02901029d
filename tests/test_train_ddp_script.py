"""lessons/scripts/train_ddp.py runs unchanged under torchrun and through utils.launch."""

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "lessons" / "scripts" / "train_ddp.py"
LINE = re.compile(r"rank (\d+): final loss ([\d.]+)  checksum (-?[\d.]+)  digest ([0-9a-f]+)")


def run(cmd, timeout=240, tmp=None):
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", COURSE_OUTPUT="grouped")
    if tmp is not None:   # torchrun leaves its log folder (torchelastic_*) in the temp dir: a per-test one
        env["TMPDIR"] = str(tmp)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc


def check_report(stdout, world_size, steps):
    ranks = [m.groups() for m in LINE.finditer(stdout)]
    assert [int(r[0]) for r in ranks] == list(range(world_size)), stdout
    losses = {float(r[1]) for r in ranks}
    assert len(losses) == 1, "every rank reports the same all-reduced loss"
    loss = losses.pop()
    # learnt something: well below the uniform guess ln 8 = 2.079 after a short run
    assert loss < math.log(8) - 0.2, stdout
    assert len({r[2] for r in ranks}) == 1 and len({r[3] for r in ranks}) == 1, "replicas differ"
    assert f"world size {world_size}:" in stdout and "replicas identical: True" in stdout


def test_runs_unchanged_under_torchrun(tmp_path):
    torchrun = Path(sys.executable).parent / "torchrun"
    if not torchrun.exists():
        pytest.skip("torchrun not installed next to this Python")
    proc = run([str(torchrun), "--standalone", "--nproc_per_node", "2", str(SCRIPT),
                "--steps", "100", "--log-every", "0"], tmp=tmp_path)
    # what torchrun left landed in the test's own temp dir (which pytest removes), not in /tmp
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("torchelastic_")], list(tmp_path.iterdir())
    check_report(proc.stdout, world_size=2, steps=100)
    assert "Warning" not in proc.stderr, proc.stderr


def test_runs_from_python_through_launch():
    proc = run([sys.executable, str(SCRIPT), "--nproc", "2", "--steps", "100", "--log-every", "0"])
    check_report(proc.stdout, world_size=2, steps=100)
    assert proc.stderr == "", proc.stderr


def test_time_allreduce_reports_the_timed_steps_cpu_and_wall_time():
    import runpy

    import utils
    train = runpy.run_path(str(SCRIPT), run_name="train_ddp")["train"]
    runs = utils.launch(train, world_size=2, threads=1, steps=8, warmup_steps=3, batch_size=4, seq_len=16,
                        num_sequences=64, time_allreduce=True)
    for r in runs:
        # 5 timed steps: the window covers them, and one compute thread (plus gloo's) cannot use much more than it
        assert r["timed_wall_s"] >= 3 * r["allreduce_ms"] / 1e3 and r["timed_wall_s"] > 0   # 3 steps at least that long
        assert 0 < r["timed_cpu_s"] <= 1.5 * r["timed_wall_s"] + 0.02
        if Path("/proc/stat").exists():
            assert r["machine_busy_s"] is not None and r["machine_busy_s"] >= 0
