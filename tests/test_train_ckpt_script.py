"""lessons/scripts/train_ckpt.py under torchrun --max-restarts 1: a rank killed once, the job restarted, the same end.

Lesson 08 shows this run; here it is checked on its own: torchrun names the killed rank and its signal, the
surviving rank waits for torchrun's SIGTERM, both workers are launched again and resume from the last complete
checkpoint, the final parameters equal an uninterrupted run's, and no worker is left running.
"""
import os
import re
import subprocess
import sys
from pathlib import Path

from pidwatch import wait_gone

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "lessons" / "scripts" / "train_ckpt.py"


def start(folder, *extra):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")   # pytorch/pytorch#135712, as the lesson does
    folder.mkdir()
    (folder / "tmp").mkdir()
    env["TMPDIR"] = str(folder / "tmp")   # torchrun's log folder (torchelastic_*) goes here, not into /tmp
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "--max-restarts", "1", str(SCRIPT), "--folder", str(folder), "--steps", "12", "--every", "4", *extra]
    with open(folder / "out.txt", "w") as out, open(folder / "err.txt", "w") as err:   # files: a hung worker
        return subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=err)    # keeps no pipe open


def events(folder):
    path = folder / "events.log"
    rows = []
    for line in (path.read_text().splitlines() if path.exists() else []):
        t, rank, event, *fields = line.split(" ")
        rows.append((float(t), int(rank[4:]), event, dict(f.split("=") for f in fields)))
    return sorted(rows)


def test_killed_rank_restarts_and_ends_bitwise_like_an_uninterrupted_run(tmp_path):
    runs = {"plain": start(tmp_path / "plain"), "killed": start(tmp_path / "killed", "--die-at", "7")}
    done = {}
    for name, process in runs.items():
        try:
            code = process.wait(timeout=240)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            code = "timeout"
        done[name] = ((tmp_path / name / "out.txt").read_text(), (tmp_path / name / "err.txt").read_text(), code)
    pids = [int(f["pid"]) for name in runs for _, _, e, f in events(tmp_path / name) if e == "launched"]
    left = wait_gone(pids, 5.0)
    for pid in left:
        os.kill(pid, 9)
    assert not left, f"workers left running: {left}"
    for name, (out, err, code) in done.items():
        assert code == 0, f"{name}: exit {code}\n{err[-3000:]}"

    out, err, _ = done["killed"]
    failure = re.search(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+)", err)
    assert failure and failure.groups() == ("-9", "1"), "torchrun reports local rank 1 killed by SIGKILL first"
    assert re.findall(r"closing signal (SIG[A-Z]+)", err) == ["SIGTERM"], "torchrun stops the survivor once"
    log = events(tmp_path / "killed")
    names = [(r, e) for _, r, e, _ in log]
    assert (1, "killed") in names and (0, "stopped") in names
    # rank 0 logs its failed all-reduce only if it reaches it before torchrun's SIGTERM (on a busy machine it may not)
    if (0, "lost-peer") in names:
        assert names.index((0, "lost-peer")) < names.index((0, "stopped"))
    attempts = {rank: sorted(int(f["attempt"]) for _, r, e, f in log if e == "launched" and r == rank)
                for rank in (0, 1)}
    assert attempts == {0: [0, 1], 1: [0, 1]}
    assert {f["step"] for _, _, e, f in log if e == "resumed"} == {"4"}
    assert {f["step"] for _, _, e, f in log if e == "killed"} == {"7"}
    digests = {name: done[name][0].strip().splitlines()[-1] for name in runs}
    assert digests["plain"].startswith("final parameters sha256 ")
    assert digests["plain"] == digests["killed"]
