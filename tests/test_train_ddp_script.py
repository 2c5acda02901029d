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


def _script():
    import runpy
    return runpy.run_path(str(SCRIPT), run_name="train_ddp")


def test_machine_busy_seconds_reads_only_the_given_cpus(tmp_path):
    stat = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal: busy = all but idle and iowait
    stat.write_text("cpu  1000 0 1000 9000 0 0 0 0 0 0\n"
                    "cpu0 100 1 10 5000 7 2 3 4 0 0\n"
                    "cpu1 200 0 20 4000 0 0 0 0 0 0\n"
                    "cpu2 700 0 970 0 0 0 0 0\n"
                    "intr 12345 0 0\nctxt 999\n")
    busy = _script()["machine_busy_seconds"]
    tick = 1 / os.sysconf("SC_CLK_TCK")
    assert busy({0}, str(stat)) == pytest.approx(120 * tick)
    assert busy({0, 1}, str(stat)) == pytest.approx(340 * tick)
    assert busy({1, 2}, str(stat)) == pytest.approx(1890 * tick)     # the all-CPU line is never counted
    assert busy(set(), str(stat)) == 0
    assert busy({0}, str(tmp_path / "missing")) is None
    if Path("/proc/stat").exists():                                  # default: this process's affinity set
        assert busy() == pytest.approx(busy(os.sched_getaffinity(0)), abs=1.0)


def _cgroup_tree(tmp_path, cgroup, files):
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/cgroup").write_text(cgroup)
    for name, text in files.items():
        path = tmp_path / "sys/fs/cgroup" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return str(tmp_path)


@pytest.mark.parametrize("cgroup, files, cores", [
    ("0::/\n", {"cpu.max": "max 100000\n"}, None),                                  # v2, no quota
    ("0::/\n", {"cpu.max": "150000 100000\n"}, 1.5),                                # v2, docker --cpus 1.5
    ("0::/a/b\n", {"cpu.max": "max 100000\n", "a/cpu.max": "200000 100000\n",
                   "a/b/cpu.max": "max 100000\n"}, 2.0),                            # v2, an ancestor's quota
    ("0::/\n", {}, None),                                                           # no files
    ("4:memory:/x\n2:cpu,cpuacct:/docker/abc\n",
     {"cpu,cpuacct/cpu.cfs_quota_us": "-1\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"}, None),   # v1, none
    ("2:cpu,cpuacct:/docker/abc\n",
     {"cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "50000\n",
      "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n"}, 0.5),                # v1, quota on its own cgroup
    ("1:cpu:/\n0::/\n", {"cpu/cpu.cfs_quota_us": "300000\n", "cpu/cpu.cfs_period_us": "100000\n",
                         "cpu.max": "100000 100000\n"}, 1.0),                       # hybrid: the smaller counts
])
def test_cpu_quota_cores_reads_cgroup_v1_and_v2(tmp_path, cgroup, files, cores):
    quota = _script()["cpu_quota_cores"]
    assert quota(_cgroup_tree(tmp_path, cgroup, files)) == cores
    assert quota(str(tmp_path / "nowhere")) is None
