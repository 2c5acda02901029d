"""utils.tools.cluster: two "nodes" (network namespaces) on this machine, the README's multi-node torchrun command
run on them for real, and nothing left behind afterwards, also when the run is interrupted or killed.

Where the cluster cannot be made (not root, not Linux, no `ip`) the tests skip with the tool's one-line reason;
with COURSE_REQUIRE_CLUSTER=1 (CI) they fail instead.
"""
import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from utils.tools import cluster as cl

ROOT = Path(__file__).resolve().parents[1]
TRAIN_DDP = ROOT / "lessons" / "scripts" / "train_ddp.py"
TRAIN_CKPT = ROOT / "lessons" / "scripts" / "train_ckpt.py"
DIGEST = re.compile(r"rank (\d+): final loss [\d.]+  checksum -?[\d.]+  digest ([0-9a-f]+)")


@pytest.fixture(scope="module")
def can_run():
    why = cl.unavailable()
    if why:
        if os.environ.get(cl.REQUIRE_VARIABLE) == "1":
            pytest.fail(f"cluster test required ({cl.REQUIRE_VARIABLE}=1) but {why}")
        pytest.skip(f"cluster test skipped: {why}")


def env(**extra):
    return dict(os.environ, OMP_NUM_THREADS="1", COURSE_OUTPUT="grouped", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
                **extra)


def wait_all(agents, timeout):
    """Wait for every agent; a timeout stops them all (teardown would too) and fails with what they wrote."""
    deadline = time.monotonic() + timeout
    for agent in agents:
        try:
            agent.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for a in agents:
                cl._stop(a)
            pytest.fail(f"a torchrun agent ran past {timeout} s")
    return [agent.returncode for agent in agents]


def test_unavailable_says_in_one_line_what_it_needs(monkeypatch):
    monkeypatch.setattr(cl.os, "geteuid", lambda: 0)
    monkeypatch.setattr(cl, "_capable", lambda bit: bit != 21)
    assert "needs root with CAP_SYS_ADMIN (a container" in cl.unavailable()
    monkeypatch.setattr(cl.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(cl.shutil, "which", lambda name: "/usr/sbin/" + name)
    why = cl.unavailable()
    assert "needs root" in why and "\n" not in why
    with pytest.raises(cl.ClusterUnavailable, match="needs root"):
        cl.Cluster().up()
    monkeypatch.setattr(cl.shutil, "which", lambda name: None)
    assert "needs iproute2's ip and tc" in cl.unavailable()
    monkeypatch.setattr(cl.sys, "platform", "darwin")
    assert "needs Linux" in cl.unavailable()


def test_bad_settings_get_a_clear_error():
    with pytest.raises(ValueError, match="at least 2 nodes"):
        cl.Cluster(nodes=1)
    with pytest.raises(ValueError, match="200mbit"):
        cl.Cluster(rate="fast")
    assert cl.Cluster(rate="200mbit").rate_bytes == 25e6


def test_links_are_shaped_and_teardown_leaves_nothing(can_run, tmp_path):
    """Three nodes on a switch: node 2 sends 4 MiB to node 0 over a 200 Mbit/s link (25 MB/s); a unique subnet."""
    server = tmp_path / "serve.py"
    server.write_text("import socket, sys\ns = socket.create_server((sys.argv[1], 5001))\nc, _ = s.accept()\n"
                      "n = 0\nwhile (b := c.recv(1 << 20)):\n    n += len(b)\nc.sendall(b'k')\nprint(n)\n")
    client = ("import socket, sys, time\ns = socket.create_connection((sys.argv[1], 5001))\n"
              "t = time.perf_counter()\ns.sendall(b'x' * (4 << 20))\ns.shutdown(socket.SHUT_WR)\ns.recv(1)\n"
              "print(time.perf_counter() - t)\n")
    with cl.Cluster(nodes=3, rate="200mbit") as cluster:
        names = cluster.names()
        assert len(set(names)) == 4 and all(n in cl.ours() for n in names)
        proc = cluster.popen(0, [sys.executable, str(server), cluster.address(0)], stdout=subprocess.PIPE, text=True)
        for _ in range(100):   # until the server listens
            if ":1389" in cluster.run(0, ["cat", "/proc/net/tcp"]).stdout:
                break
            time.sleep(0.05)
        sent = cluster.run(2, [sys.executable, "-c", client, cluster.address(0)])
        assert sent.returncode == 0, sent.stderr
        assert proc.communicate(timeout=30)[0].strip() == str(4 << 20)
        seconds = float(sent.stdout)
        rate = (4 << 20) / seconds
        # no faster than the shaper allows (its 64 kB burst aside; unshaped, a veth moves GB/s). No lower bound:
        # on a loaded machine the two processes may wait for a core.
        assert rate < 1.1 * cluster.rate_bytes, f"{rate / 1e6:.1f} MB/s"
        assert cluster.tx_bytes(2) >= 4 << 20
        cluster.popen(1, ["sleep", "600"])   # a process teardown must stop
    assert cluster.leftovers() == [] and not set(names) & set(cl.ours())


@pytest.mark.parametrize("how", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL])
def test_interrupted_run_leaves_nothing(can_run, how):
    """A holder of a cluster interrupted (Ctrl-C, SIGTERM) tears it down; one killed outright is swept up."""
    # the module run as a file: `-m utils.tools.cluster` would import the utils package, and torch with it
    holder = subprocess.Popen([sys.executable, str(ROOT / "utils" / "tools" / "cluster.py"), "hold"], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              # SIGINT at its default: a run started as a background job inherits it ignored
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        names = holder.stdout.readline().split()
        assert len(names) == 2 and set(names) <= set(cl.ours()), holder.stderr.read() if not names else names
        for _ in range(100):   # `ip netns exec` enters the namespace just after it starts
            inside = [int(p) for p in subprocess.run(["ip", "netns", "pids", names[0]], capture_output=True,
                                                     text=True).stdout.split()]
            if inside:
                break
            time.sleep(0.05)
        assert inside, "the holder's sleep runs in node 0"
        holder.send_signal(how)
        holder.wait(30)
    finally:
        if holder.poll() is None:   # a failed assertion above: the holder still cleans up after itself
            holder.terminate()
            holder.wait(30)
    if how == signal.SIGKILL:
        assert set(names) <= set(cl.ours()), "killed outright, the holder could not clean up"
        assert set(names) <= set(cl.sweep())
    assert not set(names) & set(cl.ours())
    assert not running(inside), "the process in node 0 is gone"


def running(pids, within=5.0):
    """Those of `pids` still running after up to `within` seconds (a zombie waiting for init counts as gone)."""
    deadline = time.monotonic() + within
    while True:
        alive = []
        for pid in pids:
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except (FileNotFoundError, ProcessLookupError):
                continue
            if state != "Z":
                alive.append(pid)
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


def test_two_node_torchrun_trains_bitwise_like_one_node(can_run, tmp_path):
    """The README's two-node command (2 nodes x 2 ranks) against the same 4 ranks on one node, run side by side."""
    args = [str(TRAIN_DDP), "--steps", "12", "--log-every", "0"]
    one = subprocess.Popen([sys.executable, *args, "--nproc", "4"], cwd=ROOT, env=env(GLOO_SOCKET_IFNAME="lo"),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        with cl.Cluster(nodes=2, rate="1gbit") as cluster, open(tmp_path / "agents.out", "w") as out, \
                open(tmp_path / "agents.err", "w") as err:   # both agents write here
            agents = cluster.torchrun(args, nproc_per_node=2, env=env(), cwd=ROOT, stdout=out, stderr=err)
            codes = wait_all(agents, 300)
        one_out, one_err = one.communicate(timeout=300)
    finally:
        cl._stop(one)
    assert one.returncode == 0, one_err
    logs = {p.name: p.read_text() for p in tmp_path.iterdir()}
    assert codes == [0, 0], logs
    two = logs["agents.out"]
    assert "world size 4:" in two and "replicas identical: True" in two, logs
    digests = lambda out: [m.groups() for m in DIGEST.finditer(out)]   # noqa: E731
    assert digests(two) == digests(one_out) and len(digests(two)) == 4, (two, one_out)


def test_a_killed_worker_on_one_node_restarts_the_two_node_job(can_run, tmp_path):
    """train_ckpt.py, 1 rank per node, --max-restarts 1: rank 1 (node 1) dies at step 7; node 1's agent restarts
    its worker, node 0's agent sees a node waiting to rejoin and restarts its own; both resume from the step-4
    checkpoint and end with the parameters of an uninterrupted run (run at the same time on a cluster of its own)."""
    runs = {"plain": [], "killed": ["--die-at", "7"]}
    with contextlib.ExitStack() as stack:
        agents = {}
        for name, extra in runs.items():
            folder = tmp_path / name
            folder.mkdir()
            cluster = stack.enter_context(cl.Cluster(nodes=2, rate="1gbit"))
            out, err = (stack.enter_context(open(folder / f"agents.{s}", "w")) for s in ("out", "err"))
            agents[name] = cluster.torchrun([str(TRAIN_CKPT), "--folder", str(folder), "--steps", "12", "--every",
                                             "4", *extra], nproc_per_node=1, env=env(), cwd=ROOT,
                                            torchrun_args=["--max-restarts", "1"], stdout=out, stderr=err)
        codes = {name: wait_all(agents[name], 300) for name in runs}
    logs = {name: {p.name: p.read_text() for p in (tmp_path / name).iterdir() if p.suffix in (".out", ".err", ".log")}
            for name in runs}
    assert codes == {"plain": [0, 0], "killed": [0, 0]}, logs
    events = logs["killed"]["events.log"]
    # rank 0 either finds its peer gone in the all-reduce or is stopped by its agent first (a busy machine's race)
    assert "rank1 killed step=7" in events and ("rank0 lost-peer" in events or "rank0 stopped" in events), events
    assert events.count("resumed step=4") == 2, events
    assert events.count("rank0 launched") == 2 and events.count("rank1 launched") == 2, events
    digests = {name: logs[name]["agents.out"].strip().splitlines()[-1] for name in runs}
    assert digests["plain"].startswith("final parameters sha256 ") and digests["plain"] == digests["killed"], digests


def test_the_lessons_cluster_cells_say_what_they_need_and_ignore_their_output():
    """A cell that needs the cluster starts with `%%requires cluster` (elsewhere it prints one line saying what it
    needs) and ignores its output, so nbval passes with the cluster and without it."""
    import json

    cells = json.loads((ROOT / "lessons" / "03_allreduce_from_scratch.ipynb").read_text())["cells"]
    code = ["".join(c["source"]) for c in cells if c["cell_type"] == "code" and "cluster" in "".join(c["source"])]
    needing = [src for src in code if src.startswith("%%requires cluster")]
    assert needing and all(src.startswith("%%requires cluster\n# NBVAL_IGNORE_OUTPUT\n") for src in needing)


def test_alpha_beta_fit_recovers_a_known_link_and_never_returns_a_negative_latency():
    """fit_alpha_beta (no cluster needed): exact times of a known ring give back its α and bandwidth; times whose free
    line has a negative intercept (CI's shaped link once gave α = −0.026 ms, which the simulator then refused) keep it
    in the free fit and give α = 0 and the through-origin bandwidth with nonnegative=True (the benchmark's); times
    that do not grow with the size are refused with a reason."""
    from utils.tools.linkbench import fit_alpha_beta
    sizes = [64 * 1024, 256 * 1024, 1024 * 1024, 4096 * 1024]
    n, alpha, bandwidth = 4, 0.4e-3, 25e6
    exact = [2 * (n - 1) * alpha + 2 * (n - 1) / n * s / bandwidth for s in sizes]
    got_alpha, got_bandwidth = fit_alpha_beta(sizes, exact, n)
    assert got_alpha == pytest.approx(alpha, rel=1e-9) and got_bandwidth == pytest.approx(bandwidth, rel=1e-9)
    ci_medians = [5.2e-3, 15.1e-3, 68.6e-3, 271.7e-3]                   # the failing CI run's N = 4 medians
    assert fit_alpha_beta(sizes, ci_medians, n)[0] < 0                  # the free line (lesson 03 reads its sign)
    got_alpha, got_bandwidth = fit_alpha_beta(sizes, ci_medians, n, nonnegative=True)
    slope = sum(x * y for x, y in zip(sizes, ci_medians)) / sum(x * x for x in sizes)
    assert got_alpha == 0.0 and got_bandwidth == pytest.approx(2 * (n - 1) / n / slope, rel=1e-12)
    assert 0.9 < got_bandwidth / bandwidth < 1.0
    with pytest.raises(ValueError, match="do not grow"):
        fit_alpha_beta(sizes, [0.01, 0.01, 0.009, 0.009], n)
    with pytest.raises(ValueError, match="two distinct sizes"):
        fit_alpha_beta([sizes[0]], [0.01], n)
