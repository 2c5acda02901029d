"""utils.launch: results, output, failures, hangs, interrupts, cleanup, isolation, arguments."""
import io
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import types
from pathlib import Path

import cloudpickle
import pytest
from pidwatch import wait_gone
import torch
import torch.distributed as dist

import utils

# Ship this module's functions by value, exactly as functions defined in a notebook cell travel.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON = sys.executable


def record_pid(folder):
    """Write this rank's pid where the test can find it even if the rank never returns."""
    with open(os.path.join(folder, f"pid-{dist.get_rank()}"), "w") as f:
        f.write(str(os.getpid()))


def pids_in(folder):
    return [int(open(os.path.join(folder, n)).read()) for n in sorted(os.listdir(folder)) if n.startswith("pid-")]


# ------------------------------------------------------------------ results

def test_results_in_rank_order_and_tensors_on_cpu():
    def work(scale, offset=0):
        t = torch.full((3,), float(dist.get_rank() + 1))
        dist.all_reduce(t)
        return {"rank": dist.get_rank(), "world": dist.get_world_size(), "sum": t * scale + offset}

    results = utils.launch(work, 2, offset=1, world_size=4)
    assert [r["rank"] for r in results] == [0, 1, 2, 3]
    assert all(r["world"] == 4 for r in results)
    for r in results:
        assert r["sum"].device.type == "cpu"
        assert torch.equal(r["sum"], torch.full((3,), 21.0))


def test_lambda_and_class_method_travel_by_value():
    class Counter:
        def __init__(self, start):
            self.start = start

        def value(self):
            return self.start + dist.get_rank()

    assert utils.launch(Counter(10).value, world_size=3) == [10, 11, 12]
    assert utils.launch(lambda: dist.get_world_size() * 2, world_size=2) == [4, 4]


def test_every_launch_starts_fresh_processes_and_group():
    def state():
        import builtins
        seen = getattr(builtins, "_seen_before", False)
        builtins._seen_before = True  # would leak into the next launch if ranks were reused
        return os.getpid(), seen

    first = utils.launch(state, world_size=2)
    second = utils.launch(state, world_size=2)
    assert not any(seen for _, seen in first + second)
    assert {p for p, _ in first}.isdisjoint({p for p, _ in second})


def test_single_rank_and_device():
    assert utils.launch(lambda: (dist.get_world_size(), str(utils.device())), world_size=1) == [(1, "cpu")]


# ------------------------------------------------------------------ threads and environment

def test_default_threads_split_the_cores_and_can_be_overridden():
    cores = len(os.sched_getaffinity(0))
    got = utils.launch(torch.get_num_threads, world_size=4)
    assert got == [max(1, cores // 4)] * 4
    assert utils.launch(torch.get_num_threads, world_size=2, threads=3) == [3, 3]


def test_notebook_environment_reaches_ranks(monkeypatch):
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")  # set after torch was imported
    monkeypatch.setenv("COURSE_TEST_VARIABLE", "from the notebook")

    def read():
        return os.environ["COURSE_TEST_VARIABLE"], dist.get_debug_level().name

    assert utils.launch(read, world_size=2) == [("from the notebook", "DETAIL")] * 2


def test_debug_detail_names_a_mismatched_collective(monkeypatch):
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")

    def mismatched():
        t = torch.ones(4)
        if dist.get_rank() == 0:
            dist.all_reduce(t)
        else:
            dist.broadcast(t, src=0)

    with pytest.raises(utils.LaunchError) as err:
        utils.launch(mismatched, world_size=2, timeout=30)
    message = str(err.value)
    assert "mismatch" in message.lower() and "ALLREDUCE" in message and "BROADCAST" in message


# ------------------------------------------------------------------ output

def test_output_grouped_in_rank_order_with_c_level_lines(capfd):
    def talk():
        import ctypes
        rank = dist.get_rank()
        time.sleep(0.1 * (3 - rank))  # rank 3 speaks first
        print(f"python line from {rank}")
        libc = ctypes.CDLL(None)
        libc.printf(b"C line from %d\n", rank)
        libc.fflush(None)
        os.write(2, f"stderr line from {rank}\n".encode())

    utils.launch(talk, world_size=4)
    out, err = capfd.readouterr()
    expected = []
    for rank in range(4):
        expected += [f"[rank {rank}] python line from {rank}", f"[rank {rank}] C line from {rank}"]
    assert out.splitlines() == expected
    assert err.splitlines() == [f"[rank {r}] stderr line from {r}" for r in range(4)]


def test_live_output_arrives_as_it_happens(monkeypatch, capfd):
    monkeypatch.setenv("COURSE_OUTPUT", "live")

    def talk():
        time.sleep(0.3 * (1 - dist.get_rank()))  # rank 1 first
        print(f"hello from {dist.get_rank()}")

    utils.launch(talk, world_size=2)
    assert capfd.readouterr().out.splitlines() == ["[rank 1] hello from 1", "[rank 0] hello from 0"]


def test_live_stderr_is_held_and_a_failing_ranks_goes_into_its_report(monkeypatch, capfd):
    # Live or grouped, what a student sees of a failure is the same: the culprit's stderr in the
    # report, the peers' complaints dropped, nothing on the cell's stderr.
    monkeypatch.setenv("COURSE_OUTPUT", "live")

    def fail():
        print(f"out {dist.get_rank()}")
        os.write(2, f"err {dist.get_rank()}\n".encode())
        if dist.get_rank() == 1:
            raise ValueError("rank 1 gives up")
        dist.barrier()

    with pytest.raises(utils.LaunchError) as err:
        utils.launch(fail, world_size=2, timeout=30)
    out, stderr = capfd.readouterr()
    assert sorted(out.splitlines()) == ["[rank 0] out 0", "[rank 1] out 1"]
    assert stderr == ""
    assert "stderr of rank 1 (last 1 lines):\n  err 1" in str(err.value)
    assert "err 0" not in str(err.value)


@pytest.mark.parametrize("argv, name", [
    (["/venv/bin/python", "-m", "jupyterlab", "--ServerApp.root_dir=/tmp/pytest-of-me/pytest-3/lab"], "jupyterlab"),
    (["/venv/bin/jupyter-lab", "--notebook-dir=/home/me/pytest-notes"], "jupyter-lab"),
    (["/usr/bin/python3.11", "-X", "utf8", "-m", "pytest", "tests"], "pytest"),
    (["/venv/bin/python", "/venv/bin/papermill", "a.ipynb", "b.ipynb"], "papermill"),
    (["/venv/bin/python", "-mutils.tools.run", "lessons"], "utils.tools.run"),
    (["/venv/bin/pytest", "--nbval", "lessons"], "pytest"),
    (["python", "-c", "import papermill"], "python"),
    (["/venv/bin/python", "-u", "-c", "import sys;exec(eval(sys.stdin.readline()))"], "execnet"),  # an xdist worker
])
def test_executor_is_the_program_not_a_word_in_its_paths(argv, name):
    assert utils.launching.executor_name(argv + [""]) == name


def test_a_kernel_under_a_pytest_folder_still_gets_live_output(monkeypatch):
    # JupyterLab serving a folder under pytest's tmp_path used to switch output to grouped.
    from utils import launching
    monkeypatch.delenv("COURSE_OUTPUT", raising=False)
    monkeypatch.setattr("IPython.get_ipython", lambda: types.SimpleNamespace(kernel=object()))
    lab = b"/venv/bin/python\0-m\0jupyterlab\0--ServerApp.root_dir=/tmp/pytest-of-root/pytest-7/lab\0"
    real_open = open
    monkeypatch.setattr("builtins.open", lambda path, *a, **k: io.BytesIO(lab) if str(path).startswith(
        f"/proc/{os.getppid()}/cmdline") else real_open(path, *a, **k))
    assert launching._output_is_live()
    lab = b"/venv/bin/python\0-m\0pytest\0--nbval\0/home/me/lessons\0"
    assert not launching._output_is_live()


# ------------------------------------------------------------------ failures

def test_exception_names_rank_type_message_and_traceback(tmp_path):
    def fail():
        record_pid(str(tmp_path))
        if dist.get_rank() == 2:
            raise ValueError("bad value on rank 2")
        dist.barrier()

    start = time.monotonic()
    with pytest.raises(utils.LaunchError) as err:
        utils.launch(fail, world_size=4, timeout=60)
    assert time.monotonic() - start < 10
    message = str(err.value)
    assert message.startswith("rank 2 failed with ValueError: bad value on rank 2")
    assert 'raise ValueError("bad value on rank 2")' in message  # the remote line of code
    assert "in fail" in message
    assert not wait_gone(pids_in(tmp_path))


@pytest.mark.parametrize("how, expected", [
    ("exit", "rank 1 exited with code 3"),
    ("abort", "rank 1 was killed by signal SIGABRT"),
    ("kill", "rank 1 was killed by signal SIGKILL"),
])
def test_crash_is_reported_and_others_stopped(tmp_path, how, expected):
    def crash():
        record_pid(str(tmp_path))
        if dist.get_rank() == 1:
            if how == "exit":
                os._exit(3)
            elif how == "abort":
                os.abort()
            else:
                os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)

    start = time.monotonic()
    with pytest.raises(utils.LaunchError) as err:
        utils.launch(crash, world_size=3, timeout=60)
    assert time.monotonic() - start < 10
    assert str(err.value).startswith(expected)
    assert not wait_gone(pids_in(tmp_path))


def test_hang_times_out_with_every_ranks_stack_and_kills_grandchildren(tmp_path):
    def hang():
        record_pid(str(tmp_path))
        child = subprocess.Popen(["sleep", "300"])  # something the rank started itself
        with open(os.path.join(str(tmp_path), f"pid-child-{dist.get_rank()}"), "w") as f:
            f.write(str(child.pid))
        if dist.get_rank() != 0:  # rank 0 skips the collective: the others wait forever
            dist.barrier()
        time.sleep(300)

    start = time.monotonic()
    with pytest.raises(utils.LaunchTimeout) as err:
        utils.launch(hang, world_size=3, timeout=3)
    assert time.monotonic() - start < 8
    message = str(err.value)
    assert "timed out after 3 s" in message
    for rank in range(3):
        assert f"rank {rank}:" in message
    assert message.count("dist.barrier()") == 2 and "time.sleep(300)" in message
    assert "0x" not in message and REPO not in message
    children = [int(open(tmp_path / f"pid-child-{r}").read()) for r in range(3)]
    left = wait_gone(pids_in(tmp_path) + children)
    assert not left, f"still running (a load-only failure once: say what they are): {describe(set(left))}"


def test_what_a_rank_started_is_killed_when_the_rank_ended_first(tmp_path):
    # A rank that returned, or died, before the launch ended leaves no process it started: the launcher kills
    # its group after the rank is gone (the rank's anchor keeps the group's id from being reused meanwhile).
    def start_child():
        return subprocess.Popen(["sleep", "300"]).pid  # never waited for

    children = utils.launch(start_child, world_size=2)
    left = wait_gone(children, seconds=5)
    assert not left, f"left by ranks that returned: {describe(set(left))}"

    def die():
        child = subprocess.Popen(["sleep", "300"])
        with open(os.path.join(str(tmp_path), f"pid-child-{dist.get_rank()}"), "w") as f:
            f.write(str(child.pid))
        if dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(300)

    with pytest.raises(utils.LaunchError, match="rank 1 was killed by signal SIGKILL"):
        utils.launch(die, world_size=2, timeout=60)
    children = [int(open(tmp_path / f"pid-child-{r}").read()) for r in range(2)]
    left = wait_gone(children, seconds=5)
    assert not left, f"left by a rank that was killed: {describe(set(left))}"


TEMP_SCRIPT = textwrap.dedent("""
    import multiprocessing, time, torch, torch.multiprocessing, utils
    def send_a_tensor():  # through a Pipe: multiprocessing makes its pymp-* folder and a listener in the rank
        a, b = multiprocessing.Pipe()
        a.send(torch.ones(3).share_memory_())
        return b.recv().sum().item()
    def fail():
        send_a_tensor()
        1 / 0
    def hang():
        send_a_tensor()
        time.sleep(300)
    assert utils.launch(send_a_tensor, world_size=2) == [3.0, 3.0]
    for fn, timeout in ((fail, 60), (hang, 3)):
        try:
            utils.launch(fn, world_size=2, timeout=timeout)
        except utils.LaunchError as error:
            print(type(error).__name__, flush=True)
""")


def test_a_launch_leaves_nothing_in_the_temp_dir():
    # Success, failure and timeout: the ranks end with os._exit, so nothing of theirs removes what multiprocessing
    # made in the temp dir (pymp-*/listener-*); it goes inside the launch's own folder, which the launcher removes.
    # A short per-test TMPDIR (an AF_UNIX socket's path must stay under 108 bytes); torchinductor_* is torch's
    # cache, made once per temp dir when torch is imported, not by a launch.
    tmp = tempfile.mkdtemp(prefix="tmpchk-")
    try:
        proc = subprocess.run([sys.executable, "-c", TEMP_SCRIPT], cwd=REPO, capture_output=True, text=True,
                              timeout=120, env=dict(os.environ, TMPDIR=tmp, COURSE_OUTPUT="grouped"))
        assert proc.returncode == 0 and proc.stdout.split() == ["LaunchError", "LaunchTimeout"], proc.stderr
        left = [name for name in os.listdir(tmp) if not name.startswith("torchinductor_")]
        assert not left, f"left in the temp dir: {[str(p) for n in left for p in Path(tmp, n).rglob('*')] or left}"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


KILLED_SCRIPT = textwrap.dedent("""
    import os, sys, time, utils, torch.distributed as dist
    def wait():
        open(os.path.join(sys.argv[1], f"pid-{dist.get_rank()}"), "w").write(str(os.getpid()))
        time.sleep(300)
    utils.launch(wait, world_size=2, timeout=300)
""")


def test_a_killed_launcher_leaves_no_launch_folder(tmp_path):
    # The launching process is killed mid-launch (as nbval and papermill stop a notebook's kernel): its ranks' anchors
    # remove the launch's folder as they end the ranks, and its forkserver, ending with it, removes the killed
    # process's own multiprocessing folder (pymp-*, where the server's socket is: utils/forkserver.py).
    tmp = tempfile.mkdtemp(prefix="tmpchk-")
    try:
        launcher = subprocess.Popen([sys.executable, "-c", KILLED_SCRIPT, str(tmp_path)], cwd=REPO,
                                    env=dict(os.environ, TMPDIR=tmp))
        end = time.monotonic() + 60
        while len(pids_in(tmp_path)) < 2 and time.monotonic() < end:
            time.sleep(0.1)
        assert len(pids_in(tmp_path)) == 2 and [n for n in os.listdir(tmp) if n.startswith("launch-")]
        launcher.kill()
        launcher.wait()
        assert not wait_gone(pids_in(tmp_path))
        end = time.monotonic() + 10
        while [n for n in os.listdir(tmp) if n.startswith(("launch-", "pymp-"))] and time.monotonic() < end:
            time.sleep(0.1)
        assert not [n for n in os.listdir(tmp) if n.startswith(("launch-", "pymp-"))], os.listdir(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def describe(pids) -> list:
    """pid, state, parent, process group and command of each pid: what a failed 'nothing left' check needs."""
    out = []
    for pid in sorted(pids):
        try:
            stat = open(f"/proc/{pid}/stat").read().rsplit(") ", 1)[1].split()
            command = open(f"/proc/{pid}/cmdline").read().replace("\0", " ").strip()
            out.append(f"{pid}: state {stat[0]}, parent {stat[1]}, group {stat[2]}, session {stat[3]}: {command}")
        except OSError:
            out.append(f"{pid}: gone")
    return out


def test_next_launch_works_after_failures():
    with pytest.raises(utils.LaunchError):
        utils.launch(lambda: 1 / 0, world_size=2)
    assert utils.launch(lambda: dist.get_rank(), world_size=2) == [0, 1]


INTERRUPT_SCRIPT = textwrap.dedent("""
    import os, sys, time, utils, torch.distributed as dist
    folder = sys.argv[1]
    def wait():
        open(os.path.join(folder, f"pid-{dist.get_rank()}"), "w").write(str(os.getpid()))
        time.sleep(300)
    try:
        utils.launch(wait, world_size=3, timeout=300)
    except KeyboardInterrupt:
        print("KeyboardInterrupt reached the caller", flush=True)
""")


def _default_sigint():
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_interrupt_stops_every_rank(tmp_path):
    script = tmp_path / "interrupt.py"
    script.write_text(INTERRUPT_SCRIPT)
    # A process started with SIGINT ignored (a child of a background job in a non-interactive shell, some
    # CI runners) keeps ignoring it, and Python then installs no KeyboardInterrupt handler. A Jupyter
    # kernel installs its own; this stand-in for one starts with SIGINT at its default instead.
    proc = subprocess.Popen([PYTHON, str(script), str(tmp_path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO, preexec_fn=_default_sigint)
    end = time.monotonic() + 60
    while len(pids_in(tmp_path)) < 3 and time.monotonic() < end:
        time.sleep(0.1)
    ranks = pids_in(tmp_path)
    assert len(ranks) == 3
    proc.send_signal(signal.SIGINT)  # what Jupyter's stop button sends to the kernel
    out, err = proc.communicate(timeout=30)
    assert "KeyboardInterrupt reached the caller" in out
    assert "Interrupted: stopped all 3 ranks." in err
    assert not wait_gone(ranks)


def test_ranks_die_with_the_launching_process(tmp_path):
    script = tmp_path / "killed.py"
    script.write_text(INTERRUPT_SCRIPT)
    proc = subprocess.Popen([PYTHON, str(script), str(tmp_path)], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    end = time.monotonic() + 60
    while len(pids_in(tmp_path)) < 3 and time.monotonic() < end:
        time.sleep(0.1)
    ranks = pids_in(tmp_path)
    proc.kill()  # e.g. a kernel restart: no chance to clean up
    proc.wait()
    assert not wait_gone(ranks, seconds=10)


# ------------------------------------------------------------------ network

def listening_sockets(pids):
    """(address, port) of every TCP socket in LISTEN state owned by these processes."""
    inodes = set()
    for pid in pids:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = []
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        with open(table) as f:
            for row in f.read().splitlines()[1:]:
                fields = row.split()
                local, state, inode = fields[1], fields[3], fields[9]
                if state == "0A" and inode in inodes:  # 0A = LISTEN
                    address, port = local.split(":")
                    found.append((address, int(port, 16)))
    return found


LOOPBACK = {"0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F"}


def test_every_listening_socket_is_on_loopback():
    launcher = os.getpid()

    def inspect():
        pids = [None] * dist.get_world_size()
        dist.all_gather_object(pids, os.getpid())
        found = listening_sockets(pids + [launcher]) if dist.get_rank() == 0 else None
        dist.barrier()
        return found

    found = utils.launch(inspect, world_size=3)[0]
    assert len(found) >= 2  # the rendezvous store and the output collector at least
    assert all(address in LOOPBACK for address, _ in found), found


TWO_LAUNCHES = textwrap.dedent("""
    import torch, utils, torch.distributed as dist
    def work():
        t = torch.ones(1000)
        dist.all_reduce(t)
        return t[0].item()
    for _ in range(5):
        assert utils.launch(work, world_size=4) == [4.0] * 4
    print("ok")
""")


def test_two_launches_at_once_never_collide(tmp_path):
    script = tmp_path / "two.py"
    script.write_text(TWO_LAUNCHES)
    procs = [subprocess.Popen([PYTHON, str(script)], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0 and out.strip() == "ok", err


# ------------------------------------------------------------------ a stopped rank; a replaced rank

def test_process_state_tells_a_stopped_process():
    from utils import reports
    proc = subprocess.Popen(["sleep", "60"])
    try:
        os.kill(proc.pid, signal.SIGSTOP)
        for _ in range(100):                      # the kernel stops it at once; allow a moment
            if reports.process_state(proc.pid) == "T":
                break
            time.sleep(0.01)
        assert reports.stopped_reason(proc.pid).startswith("stopped")
        os.kill(proc.pid, signal.SIGCONT)
        assert reports.process_state(proc.pid) in ("S", "R") and not reports.stopped_reason(proc.pid)
    finally:
        proc.kill()
        proc.wait()
    assert reports.process_state(proc.pid) == "" and reports.stopped_reason(proc.pid) == ""


def stop_rank_1():
    dist.barrier()
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    dist.all_reduce(torch.ones(4))


def test_group_timeout_ends_the_wait_and_the_report_names_the_stopped_rank():
    start = time.monotonic()
    with pytest.raises(utils.LaunchError) as caught:
        utils.launch(stop_rank_1, world_size=3, group_timeout=1.5, timeout=120)
    report = str(caught.value)
    assert report.startswith("rank 1 is stopped (SIGSTOP"), report
    assert "rank 0 failed while it waited: RuntimeError" in report and "rank 2 failed while it waited" in report
    assert time.monotonic() - start < 100, "the group's timeout, not the launch's, ended the wait"


def replaced_rank_1(steps):
    from utils import replacement
    rank, generation = int(os.environ["RANK"]), replacement.generation()
    group = replacement.group(generation, timeout=30)
    total = torch.zeros(1)
    step = 0
    if generation:
        step_and_total = torch.zeros(2)
        group.broadcast(step_and_total, 0)
        step, total = int(step_and_total[0]), step_and_total[1:]
    while step < steps:
        if rank == 1 and step == 2 and generation == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        contribution = torch.ones(1) * (rank + 1)
        try:
            group.all_reduce(contribution)
        except RuntimeError:
            group.tear_down()
            generation += 1
            group = replacement.group(generation, timeout=30)
            group.broadcast(torch.cat([torch.tensor([float(step)]), total]), 0)
            continue
        total += contribution
        step += 1
    return generation, total.item()


def test_a_dead_rank_is_replaced_and_filled_from_a_survivor(capsys):
    results = utils.launch(replaced_rank_1, 4, world_size=3, replace=1, timeout=120)
    assert results == [(1, 24.0)] * 3, results      # 4 steps of 1 + 2 + 3, every rank, the newcomer too
    assert "rank 1 was killed by signal SIGKILL; the launcher started a replacement process for rank 1" in \
        capsys.readouterr().out


# ------------------------------------------------------------------ arguments

@pytest.mark.parametrize("kwargs, words", [
    (dict(world_size=0), "world_size must be an integer ≥ 1"),
    (dict(world_size=2.5), "world_size must be an integer ≥ 1"),
    (dict(backend="mpi"), "unknown backend 'mpi'"),
    (dict(timeout=-1), "timeout must be a positive number"),
    (dict(threads=0), "threads must be a positive integer"),
    (dict(group_timeout=0), "group_timeout must be a positive number"),
    (dict(replace=-1), "replace must be a whole number"),
])
def test_bad_arguments_raise_before_anything_starts(kwargs, words):
    start = time.monotonic()
    with pytest.raises(ValueError, match=words):
        utils.launch(lambda: None, **kwargs)
    assert time.monotonic() - start < 0.5


def test_not_callable_and_nccl_without_gpus():
    with pytest.raises(ValueError, match=r"fn must be callable .* launch\(work\), not launch\(work\(\)\)"):
        utils.launch(42)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs one CUDA GPU per rank.*backend='gloo'"):
            utils.launch(lambda: None, world_size=2, backend="nccl")


def test_unpicklable_argument_is_a_clear_error():
    import threading
    with pytest.raises(ValueError, match="could not send fn and its arguments"):
        utils.launch(lambda lock: None, threading.Lock(), world_size=2)


# ------------------------------------------------------------------ torchrun

TORCHRUN_SCRIPT = textwrap.dedent("""
    import os, torch, utils, torch.distributed as dist
    def work(x):
        t = torch.ones(1) * (dist.get_rank() + 1)
        dist.all_reduce(t)
        return (dist.get_rank(), t.item() * x, os.getpid())
    if __name__ == "__main__":
        results = utils.launch(work, 10, world_size=99)  # torchrun decides the world size
        line = f"RANK {os.environ['RANK']} sees {results} own pid {os.getpid()}\\n"
        os.write(1, line.encode())  # one write per line: both ranks share torchrun's stdout
""")


def test_under_torchrun_launch_runs_in_process(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TORCHRUN_SCRIPT)
    torchrun = os.path.join(os.path.dirname(PYTHON), "torchrun")
    # torchrun puts its log folder (torchelastic_*) in the temp dir: a short per-test one, removed here, not /tmp
    tmp = tempfile.mkdtemp(prefix="trun-")
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", TMPDIR=tmp)
    try:
        out = subprocess.run([torchrun, "--standalone", "--nproc_per_node", "2", str(script)], cwd=REPO,
                             env=env, capture_output=True, text=True, timeout=120)
        assert any(name.startswith("torchelastic_") for name in os.listdir(tmp)), "torchrun's log folder went elsewhere"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    assert out.returncode == 0, out.stderr
    lines = sorted(line for line in out.stdout.splitlines() if line.startswith("RANK"))
    assert len(lines) == 2
    for line in lines:
        results = eval(line.split(" sees ")[1].split(" own pid ")[0])
        own_pid = int(line.split(" own pid ")[1])
        assert [(r, v) for r, v, _ in results] == [(0, 30.0), (1, 30.0)]
        assert own_pid in [p for _, _, p in results]  # fn ran in this very process


GARBAGE_SCRIPT = textwrap.dedent("""
    import gc, torch, utils, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    def train():
        model = DDP(torch.nn.Linear(4, 4))  # DDP objects sit in reference cycles
        model(torch.ones(2, 4)).sum().backward()
    gc.disable()  # only an explicit collection may free them
    utils.launch(train, world_size=1)
    print("DDP objects alive:", sum(isinstance(o, DDP) for o in gc.get_objects()))
""")


def test_under_torchrun_nothing_outlives_the_group():
    # A DDP module left in a cycle keeps the gloo group alive until interpreter exit, where gloo's
    # threads abort the process now and then (SIGABRT after a successful run).
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT="0", GLOO_SOCKET_IFNAME="lo")  # port 0: the store picks a free one
    out = subprocess.run([PYTHON, "-c", GARBAGE_SCRIPT], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "DDP objects alive: 0" in out.stdout, out.stdout


def test_failure_report_carries_the_culprits_stderr_and_nothing_reaches_stderr(capfd):
    def fail():
        rank = dist.get_rank()
        os.write(2, f"noise from rank {rank}\n".encode())
        if rank == 1:
            raise RuntimeError("the real problem")
        time.sleep(30)

    with pytest.raises(utils.LaunchError) as err:
        utils.launch(fail, world_size=3)
    message = str(err.value)
    assert "stderr of rank 1 (last 1 lines):\n  noise from rank 1" in message
    assert "noise from rank 0" not in message and "noise from rank 2" not in message
    assert "the other ranks were stopped: 0, 2" in message
    assert capfd.readouterr().err == ""


config = {"lr": 0.1}  # a notebook global whose name is also a torch submodule (torch.distributed.config)


def test_global_named_like_a_torch_submodule_still_travels():
    def uses_config():
        return dist.get_rank(), config["lr"]

    assert utils.launch(uses_config, world_size=2) == [(0, 0.1), (1, 0.1)]


def test_optimizer_import_is_preloaded():
    # A rank's first torch.optim constructor imports torch._dynamo (~800 modules, seconds per rank)
    # unless the forkserver already did.
    assert utils.launch(lambda: "torch._dynamo" in sys.modules, world_size=2) == [True, True]


# ------------------------------------------------------------------ pid reuse

class _ReapedRank:
    """A rank the forkserver has already reaped, whose pid number now belongs to another process."""
    def __init__(self, pid):
        self.pid = pid

    def is_alive(self):
        return False

    def kill(self):
        os.kill(self.pid, signal.SIGKILL)

    def join(self, timeout=None):
        pass


def test_stopping_a_launch_spares_a_process_that_reuses_a_finished_ranks_pid():
    # On a busy machine (pid_max 32768 here) a finished rank's pid is soon reused, e.g. by a rank of
    # another launch that leads its own session: killing by the stale pid would kill that stranger.
    stranger = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        launch = utils.launching._Launch(2, "gloo", 5.0, 1)
        launch.procs = [_ReapedRank(stranger.pid)]
        launch._stop_all()
        time.sleep(0.2)
        assert stranger.poll() is None, "the launcher killed a process that merely reused a finished rank's pid"
    finally:
        stranger.kill()
        stranger.wait()


def test_a_rank_that_needs_no_peer_does_not_break_its_peers_init():
    # fn returns at once on every rank: without a barrier after init, rank 0 could exit while rank 1 was
    # still in gloo's connection handshake ("connectFullMesh failed ... Connection closed by peer",
    # 14 of 150 launches under load before the fix).
    for _ in range(20):
        assert utils.launch(lambda: dist.get_rank(), world_size=2) == [0, 1]
