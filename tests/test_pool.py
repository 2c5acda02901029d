"""%dist and utils.pool: ranks that live across cells, and what happens when a cell goes wrong."""
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from pidwatch import alive, wait_gone
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell

import utils
from utils import pool, warmup
from utils.rank_process import _ANCHOR as ANCHOR

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORLD = 4


def open_fds(pid="self"):
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.fixture(scope="module")
def shell():
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "utils")
    shell.run_cell("import os, time, torch, torch.distributed as dist\n")
    yield shell
    if pool.current() is not None:
        shell.run_line_magic("dist", "stop")


@pytest.fixture
def running(shell):
    """A pool of WORLD ranks with a short grace (a fresh one if a previous test stopped it)."""
    if pool.current() is None:
        shell.run_line_magic("dist", f"start -n {WORLD} --grace 0.5")
    current = pool.current()
    current.interrupt_grace = 1.5
    return current


def cell(shell, source, line=""):
    return shell.run_cell_magic("distributed", line, source)


def pids(p):
    return [p.pids[r] for r in range(p.world_size)]


def test_state_persists_across_cells_and_output_is_grouped(shell, running, capfd):
    capfd.readouterr()
    assert cell(shell, "w = torch.full((2,), float(dist.get_rank()))") is None
    assert cell(shell, "dist.all_reduce(w)\nprint('sum', w.tolist())\nw.sum().item()") == [12.0] * WORLD
    assert capfd.readouterr().out.splitlines() == [f"[rank {r}] sum [6.0, 6.0]" for r in range(WORLD)]
    got = shell.run_line_magic("dist", "get w")
    assert [t.tolist() for t in got] == [[6.0, 6.0]] * WORLD and shell.user_ns["distributed_results"] == [12.0] * WORLD


def test_rank_namespace_wins_and_shipped_functions_see_it(shell, running):
    shell.run_cell("offset = 1000\ndef shifted(x):\n    return x + offset\n")
    # the cell assigns `offset`; the notebook's function reads the rank's value, not the notebook's
    assert cell(shell, "offset = dist.get_rank()\nshifted(10)") == [10, 11, 12, 13]
    shell.run_cell("offset = -1")
    assert cell(shell, "shifted(0)") == [0, 1, 2, 3]   # the rank has `offset`: the notebook's is not sent


def test_exception_on_one_rank_keeps_the_pool_and_every_state(shell, running):
    before = pids(running)
    cell(shell, "keep = 10 * dist.get_rank()")
    with pytest.raises(utils.LaunchError) as err:
        cell(shell, "if dist.get_rank() == 1:\n    raise KeyError('lost')\nkeep += 1\n")
    message = str(err.value)
    assert message.startswith("rank 1 failed with KeyError: 'lost'")
    assert "raise KeyError('lost')" in message and "ranks that finished the cell: 0, 2, 3" in message
    assert "The pool is kept" in message
    assert pool.current() is running and pids(running) == before
    assert cell(shell, "keep") == [1, 10, 21, 31]


def test_ranks_option_runs_some_ranks_and_refuses_a_default_group_collective(shell, running, capfd):
    capfd.readouterr()
    assert cell(shell, "part = dist.get_rank()\npart", "--ranks 0,2") == [0, None, 2, None]
    assert "distributed_results: None for ranks 1, 3, which did not run this cell" in capfd.readouterr().out
    start = time.monotonic()
    with pytest.raises(utils.LaunchError) as err:
        cell(shell, "dist.all_reduce(torch.ones(1))", "--ranks 0,2")
    assert time.monotonic() - start < 5
    assert "dist.all_reduce on the default group needs all 4 ranks" in str(err.value)
    assert "The pool is kept" in str(err.value)
    assert cell(shell, "t = torch.ones(1)\ndist.all_reduce(t)\nt.item()") == [4.0] * WORLD


def test_batched_point_to_point_runs_in_a_pool_cell(shell, running):
    # dist.P2POp checks its op against distributed_c10d's isend/irecv by identity: the pool's wrappers must pass it
    ring = ("r, n = dist.get_rank(), dist.get_world_size()\n"
            "out, got = torch.full((1,), float(r)), torch.zeros(1)\n"
            "ops = [dist.P2POp(dist.isend, out, (r + 1) % n), dist.P2POp(dist.irecv, got, (r - 1) % n)]\n"
            "for work in dist.batch_isend_irecv(ops):\n    work.wait()\n"
            "got.item()")
    assert cell(shell, ring) == [float((r - 1) % WORLD) for r in range(WORLD)]


def test_get_returns_what_can_travel_from_a_ddp_module(shell, running, capfd):
    cell(shell, "torch.manual_seed(0)\nmodel = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 1))")
    capfd.readouterr()
    states = shell.run_line_magic("dist", "get model")
    assert [sorted(s) for s in states] == [["bias", "weight"]] * WORLD
    assert "its module's state_dict() came instead" in capfd.readouterr().out
    with pytest.raises(NameError):
        shell.run_line_magic("dist", "get no_such_name")


def test_hang_gives_stacks_and_a_working_fresh_pool(shell, running):
    old = pids(running)
    cell(shell, "lost_soon = 1")
    with pytest.raises(utils.LaunchTimeout) as err:
        cell(shell, "if dist.get_rank() == 0:\n    dist.barrier()\n", "--timeout 1.5")
    message = str(err.value)
    assert "rank 0:" in message and "dist.barrier()" in message and "ranks that finished the cell: 1, 2, 3" in message
    assert "The pool was restarted" in message and "variables were lost" in message
    assert not wait_gone(old)
    assert cell(shell, "t = torch.ones(1)\ndist.all_reduce(t)\n(t.item(), 'lost_soon' in globals())") == [(4.0, False)] * WORLD


def test_a_dead_rank_restarts_the_pool(shell, running):
    old = pids(running)
    with pytest.raises(utils.LaunchError) as err:
        cell(shell, "if dist.get_rank() == 2:\n    os._exit(3)\ndist.barrier()\n")
    assert "rank 2 exited with code 3" in str(err.value) and "The pool was restarted" in str(err.value)
    assert not wait_gone(old)
    assert cell(shell, "dist.get_world_size()") == [WORLD] * WORLD


def interrupt_after(seconds):
    timer = threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    return timer


@pytest.fixture
def sigint_raises():
    """The stop button raises KeyboardInterrupt in a kernel; this process may have started with SIGINT ignored."""
    saved = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, saved)


def test_interrupt_keeps_the_pool_when_every_rank_stops_outside_a_collective(shell, running, sigint_raises, capfd):
    before = pids(running)
    cell(shell, "kept = dist.get_rank()")
    interrupt_after(0.5)
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        cell(shell, "time.sleep(30)")
    assert time.monotonic() - start < 5
    assert "the pool is kept" in capfd.readouterr().err
    assert pids(running) == before and cell(shell, "kept") == [0, 1, 2, 3]


def test_interrupt_of_a_rank_blocked_in_a_collective_restarts(shell, running, sigint_raises, capfd):
    old = pids(running)
    interrupt_after(0.5)
    with pytest.raises(KeyboardInterrupt):
        cell(shell, "if dist.get_rank() == 0:\n    dist.barrier()\nelse:\n    time.sleep(30)\n")
    assert "ranks 0 did not stop" in capfd.readouterr().err
    assert not wait_gone(old)
    assert cell(shell, "dist.get_rank()") == [0, 1, 2, 3]


def test_fifty_cells_leak_no_descriptors_or_processes(shell, running):
    cell(shell, "t = torch.ones(1)")
    ranks = pids(running)
    fds = (open_fds(), [open_fds(p) for p in ranks])
    for i in range(50):
        cell(shell, f"dist.all_reduce(t)\nprint({i})\n{i}")
    assert (open_fds(), [open_fds(p) for p in ranks]) == fds
    assert pids(running) == ranks and all(alive(p) for p in ranks)
    group = subprocess.run(["pgrep", "-g", ",".join(map(str, ranks))], capture_output=True, text=True)
    members = [int(p) for p in group.stdout.split()]
    anchors = [p for p in members if p not in ranks and ANCHOR in open(f"/proc/{p}/cmdline").read()]
    # each rank's group holds just the rank and its anchor (utils/rank_process.py)
    assert sorted(members) == sorted(ranks + anchors) and len(anchors) == len(ranks)


def test_status_stop_and_one_shot_again(shell, running, capfd):
    capfd.readouterr()
    shell.run_line_magic("dist", "status")
    rows = capfd.readouterr().out.splitlines()
    assert len(rows) == WORLD + 1 and all(" idle " in row and "MiB" in row for row in rows[1:])
    old = pids(running)
    shell.run_line_magic("dist", "stop")
    assert pool.current() is None and not wait_gone(old)
    assert cell(shell, "dist.get_world_size()", "-n 2") == [2, 2]   # one-shot, as without a pool
    with pytest.raises(UsageError):
        cell(shell, "1", "--ranks 0")


KERNEL = textwrap.dedent("""
    import sys, time
    from IPython.core.interactiveshell import InteractiveShell
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "utils")
    shell.run_line_magic("dist", "start -n 2")
    from utils import pool
    print("pids", *pool.current().pids.values(), flush=True)
    if sys.argv[1] == "wait":
        time.sleep(120)
""")


@pytest.mark.parametrize("end", ["killed", "exits"])
def test_no_rank_outlives_the_kernel(tmp_path, end):
    script = tmp_path / "kernel.py"
    script.write_text(KERNEL)
    proc = subprocess.Popen([sys.executable, str(script), "wait" if end == "killed" else "exit"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = next(line for line in proc.stdout if line.startswith("pids"))
        ranks = [int(p) for p in line.split()[1:]]
        assert len(ranks) == 2
        if end == "killed":
            proc.kill()  # a kernel restart: no chance to clean up
        proc.wait(30)
    finally:
        proc.kill()
        proc.wait()
    assert not wait_gone(ranks)


def test_warm_up_runs_only_in_a_notebook_kernel(monkeypatch):
    assert not warmup.in_notebook_kernel()           # pytest: no kernel
    monkeypatch.setattr(InteractiveShell.instance(), "kernel", object(), raising=False)
    assert warmup.in_notebook_kernel()
    monkeypatch.setenv("RANK", "0")                  # under torchrun, or inside a rank
    assert not warmup.in_notebook_kernel()


def children(pid):
    """(pid, command line) of the processes whose parent is `pid`."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().split(") ")[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError, IndexError):
            continue
        if parent == pid:
            found.append((int(entry), command))
    return found


def test_in_a_real_kernel_the_warm_up_runs_once_and_a_restart_leaves_no_rank():
    from jupyter_client.manager import start_new_kernel
    from utils.tools.kernels import socket_folder
    temp = socket_folder()   # the kernel's TMPDIR: a killed kernel's forkserver leaves its pymp-* folder there, not in /tmp
    manager, client = start_new_kernel(kernel_name="python3", cwd=REPO, env=dict(os.environ, TMPDIR=str(temp)))
    try:
        def run(code):
            out = []
            def hook(msg):
                if msg["msg_type"] in ("stream", "error"):
                    out.append(msg["content"].get("text") or msg["content"]["ename"])
            client.execute_interactive(code, output_hook=hook, timeout=120)
            return "".join(out)

        kernel = int(run("import os, utils\nprint(os.getpid())"))
        assert run("import utils.timing\nprint(utils.warmup._done.is_set())").strip() == "True"
        forkservers = [c for _, c in children(kernel) if "multiprocessing.forkserver" in c]
        assert len(forkservers) == 1   # warmed once: the forkserver's own `import utils` did not warm again
        ranks = [int(p) for p in run("%load_ext utils\n%dist start -n 2\nfrom utils import pool\n"
                                     "print(*pool.current().pids.values())").split()[-2:]]
        assert all(alive(p) for p in ranks)
        manager.restart_kernel(now=False)
        assert not wait_gone(ranks)
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
        shutil.rmtree(temp, ignore_errors=True)
