"""Run a function on N ranks of torch.distributed, from a notebook cell.

`launch(fn, world_size=4)` starts N fresh rank processes, initialises the default process group in
each, runs `fn` there and returns what every rank returned, in rank order.

Why it is built this way:
- Ranks are forked from a *forkserver* that imported torch once. A warm launch therefore costs a
  fork, not a 2-second `import torch` per rank, and no rank is ever forked from the notebook
  process itself (which may have initialised CUDA, after which fork is unsafe).
- `fn` travels by value (cloudpickle), so functions, lambdas and classes defined in a notebook work.
- Rendezvous uses a TCPStore held by the launching process on a socket bound to 127.0.0.1 with a
  port the OS picks, so nothing listens beyond this machine and two launches never collide.
- Every rank's stdout and stderr (Python and C level) come back through a socket, each line marked
  with its rank. A person watching sees stdout live; batch runs (nbval, papermill, pytest) get it
  grouped in rank order, so stored outputs are deterministic. Stderr is held until the launch ends,
  live or not: a failing rank's goes into its report (a C++ abort message, say), and the other
  ranks' complaints about the peer they lost are dropped, so a student sees what a stored notebook shows.
- A failing rank (exception, exit, signal) or a hang (nothing finished by `timeout`) raises
  `LaunchError` / `LaunchTimeout` with the remote traceback or every rank's Python stack (a stopped
  rank is named by its process state), and all processes the launch started are killed: each rank
  leads its own process group, which the launcher kills at the end even after the rank itself is gone
  (an "anchor" process in the group keeps its id ours), and which a watchdog thread in every rank and
  the anchor kill if the launching process disappears (utils/failure_reports.py writes the reports).
- `replace=N` starts a new process in place of a rank that dies, up to N times, while the others go
  on; they and the newcomer form fresh groups with utils/replacement.py.

The rank's side is utils/rank_process.py; what travels between them, utils/shipping.py.
"""
from __future__ import annotations

import os
import selectors
import signal
import socket
import sys
import tempfile
import time
from datetime import timedelta

import cloudpickle

from . import compat, forkserver
from .devices import _gpu_count, backend_for, default_threads, describe, device
from .failure_reports import FailureReports, LaunchError, LaunchTimeout
from .output_mode import RankOutput, executor_name, output_is_live
from .rank_process import RANK_MARKER, _rank_main, run_under_torchrun
from .reports import format_frames, parse_faulthandler, short_path, source_files_of
from .shipping import describe_exception, dumps, to_cpu

# Kept under their old names: the pool, the lab checks and the tests import them from here.
_output_is_live, _describe_exception, _to_cpu, _RANK_MARKER = output_is_live, describe_exception, to_cpu, RANK_MARKER
__all__ = ["launch", "device", "describe", "backend_for", "default_threads", "LaunchError", "LaunchTimeout", "dumps",
           "executor_name", "format_frames", "parse_faulthandler", "short_path", "source_files_of"]

BACKENDS = ("auto", "gloo", "nccl")


# ---------------------------------------------------------------- the public entry point

def launch(fn, *args, world_size: int = 4, backend: str = "auto", timeout: float = 60.0,
           threads: int | None = None, group_timeout: float | None = None, replace: int = 0, **kwargs) -> list:
    """Run `fn(*args, **kwargs)` on `world_size` ranks; return their results in rank order.

    Each rank has the default process group initialised (`dist.get_rank()`, collectives work).
    Tensors in the results come back on the CPU. `threads` sets torch's intra-op threads per rank
    (default: cores // world_size, at least 1). Raises LaunchError if a rank fails and
    LaunchTimeout after `timeout` seconds; either way every rank process is gone afterwards.
    `group_timeout`: seconds a collective waits for its peers before it raises (torch's default: 30 min
    for gloo, 10 min for NCCL). `replace`: how many dead ranks may be replaced by a new process while the
    others go on (see utils/replacement.py; then no default group is formed and `fn` forms its own).
    Under torchrun (RANK and WORLD_SIZE set), runs `fn` once in this process for its rank.
    """
    if os.environ.get(RANK_MARKER):
        raise RuntimeError("launch() was called inside a rank it started; call it from the notebook.")
    _check_arguments(fn, world_size, backend, timeout, threads, group_timeout, replace)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return run_under_torchrun(fn, args, kwargs, backend)
    if backend == "auto":
        backend = backend_for(world_size)
    try:
        payload = dumps((fn, args, kwargs))
    except Exception as exc:
        raise ValueError(f"could not send fn and its arguments to the ranks ({type(exc).__name__}: "
                         f"{exc}); pass plain data, tensors, functions or classes.") from None
    threads = threads or default_threads(world_size)
    try:
        return _Launch(world_size, backend, timeout, threads, group_timeout, replace).run(
            payload, source_files_of(fn))
    except KeyboardInterrupt as stop:  # ■ pressed: every rank is stopped; the launcher's inner frames are noise
        raise stop.with_traceback(None) from None




def _check_arguments(fn, world_size, backend, timeout, threads, group_timeout=None, replace=0):
    if not callable(fn):
        raise ValueError(f"fn must be callable (a function, lambda or class), got {type(fn).__name__}; "
                         "pass the function itself, not its result: launch(work), not launch(work()).")
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be an integer ≥ 1, got {world_size!r}.")
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; use one of {', '.join(BACKENDS)} "
                         "('auto' picks nccl with one GPU per rank, else gloo).")
    if backend == "nccl":
        gpus = _gpu_count()
        if world_size > gpus:
            raise ValueError(f"backend 'nccl' needs one CUDA GPU per rank: {world_size} ranks, {gpus} "
                             "GPU(s) here. Use backend='gloo' (or 'auto'), or fewer ranks.")
    if not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}.")
    if threads is not None and (not isinstance(threads, int) or threads < 1):
        raise ValueError(f"threads must be a positive integer or None, got {threads!r}.")
    if group_timeout is not None and not (isinstance(group_timeout, (int, float)) and group_timeout > 0):
        raise ValueError(f"group_timeout must be a positive number of seconds or None, got {group_timeout!r}.")
    if not isinstance(replace, int) or isinstance(replace, bool) or replace < 0:
        raise ValueError(f"replace must be a whole number of replacements ≥ 0, got {replace!r}.")
    if replace and backend == "nccl":
        raise ValueError("replace works with gloo only here (utils/replacement.py forms gloo groups); "
                         "use backend='gloo'.")


# ---------------------------------------------------------------- the launching side

class _Launch(RankOutput, FailureReports):
    """One launch: its processes, sockets, store and temporary files, and their cleanup."""

    def __init__(self, world_size, backend, timeout, threads, group_timeout=None, replace=0):
        self.world_size, self.backend, self.timeout, self.threads = world_size, backend, timeout, threads
        self.group_timeout, self.replace, self.replaceable = group_timeout, replace, replace > 0
        self.generation_of = {}   # rank -> how many times it was replaced (only ranks that were)
        self.retired = []         # processes of replaced ranks, closed with the rest
        self.stopped = {}         # rank -> why its process cannot run (utils/failure_reports.py)
        self.live = _output_is_live()
        self.lines = {r: {1: [], 2: []} for r in range(world_size)}  # rank -> stream -> lines
        self.partial = {}
        self.results = {}
        self.failures = {}  # rank -> report text
        self.exited = set()
        self.timeout_report = ""

    def run(self, payload, source_files):
        """Start the ranks, wait for them, clean up, and return results or raise."""
        self.source_files = source_files
        self.tmp = tempfile.TemporaryDirectory(prefix="launch-")
        self.selector = selectors.DefaultSelector()
        self.procs, self.result_conns, self.control_conns, self.sockets = [], {}, [], []
        self.anchors = {}  # process -> read end of its anchor pipe (utils/rank_process.py)
        try:
            self._open_rendezvous()
            self._start_ranks(payload)
            self._wait()
        except KeyboardInterrupt:
            self._stop_all()
            self._print_output()
            print(f"Interrupted: stopped all {self.world_size} ranks.", file=sys.stderr)
            raise
        finally:
            self._stop_all()
            self._close()
        if self.failures or self.timeout_report:
            # What the culprits wrote to stderr goes into the report, and what the ranks stopped
            # because of them wrote (peer-loss noise) is dropped, so a notebook that catches the
            # error and prints it shows nothing on stderr, live or stored.
            error, culprits = self._error()
            stderr = self._take_stderr(culprits)
            for rank in range(self.world_size):
                self.lines[rank][2] = []
            self._print_output()
            raise type(error)(str(error) + stderr)
        self._print_output()
        return [self.results[r] for r in range(self.world_size)]

    def _open_rendezvous(self):
        # The store and the output socket listen on loopback only, on ports the OS picks.
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(128)
        self.store_port = listener.getsockname()[1]
        self.store = compat.tcp_store("127.0.0.1", self.store_port, self.world_size,
                                      is_master=True, wait_for_workers=False,
                                      timeout=timedelta(seconds=max(self.timeout, 30)),
                                      master_listen_fd=listener.fileno())
        listener.detach()  # the store owns the socket now and closes it when it is deleted
        self.output_server = socket.socket()
        self.output_server.bind(("127.0.0.1", 0))
        self.output_server.listen(2 * self.world_size)
        self.output_server.setblocking(False)
        self.selector.register(self.output_server, selectors.EVENT_READ, ("accept", None))

    def _start_ranks(self, payload):
        self.payload = payload
        self.env = dict(os.environ)  # what the student set in the notebook, for torch inside the ranks
        self.env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        self.env.setdefault("NCCL_SOCKET_IFNAME", "lo")
        # With device_id set, torch warns once per rank that single send/recv calls are serialised;
        # lessons that use them do so on purpose, and the warning would land on stderr.
        self.env.setdefault("TORCH_NCCL_SHOW_EAGER_INIT_P2P_SERIALIZATION_WARNING", "false")
        for rank in range(self.world_size):
            self.procs.append(self._start_rank(rank))

    def _start_rank(self, rank):
        """Start one rank's process (a first one, or a replacement) and watch its result pipe and its exit."""
        ctx = forkserver.context()
        result_recv, result_send = ctx.Pipe(duplex=False)
        control_recv, control_send = ctx.Pipe(duplex=False)
        anchor_recv, anchor_send = ctx.Pipe(duplex=False)
        spec = dict(rank=rank, world_size=self.world_size, backend=self.backend,
                    store_port=self.store_port,
                    output_port=self.output_server.getsockname()[1],
                    stack_file=self._stack_path(rank), tmp=self.tmp.name, generation=self.generation_of.get(rank, 0),
                    group_timeout=getattr(self, "group_timeout", None), replace=getattr(self, "replaceable", False),
                    threads=self.threads, env=self.env, timeout=self.timeout, payload=self.payload)
        proc = ctx.Process(target=_rank_main, args=(spec, result_send, control_recv, anchor_send),
                           name=f"rank-{rank}", daemon=True)
        with forkserver.main_module_hidden():
            proc.start()
        result_send.close()
        control_recv.close()
        anchor_send.close()
        self.anchors[proc] = anchor_recv
        self.control_conns.append(control_send)
        self.result_conns[rank] = result_recv
        self.selector.register(result_recv, selectors.EVENT_READ, ("result", rank))
        self.selector.register(proc.sentinel, selectors.EVENT_READ, ("exit", rank))
        return proc

    def _replace(self, rank, why):
        """Start a new process for `rank`, which died; the others go on (launch(..., replace=N))."""
        self.replace -= 1
        self.generation_of[rank] = self.generation_of.get(rank, 0) + 1
        self.retired.append(self.procs[rank])
        self._kill_group(self.procs[rank])  # what the dead rank started goes with it
        old = self.result_conns[rank]
        self._unregister(old)
        old.close()
        self.procs[rank] = self._start_rank(rank)
        self.exited.discard(rank)
        print(f"{why}; the launcher started a replacement process for rank {rank} "
              f"(generation {self.generation_of[rank]})", flush=True)

    def _wait(self):
        deadline = time.monotonic() + self.timeout
        while len(self.exited) < self.world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._dump_stacks()
                return
            for key, _ in self.selector.select(timeout=min(remaining, 0.25)):
                self._handle(key)
            if self.failures:
                self._wait_for_root_cause()  # then stop the others
                self._note_stopped([r for r in range(self.world_size) if r not in self.results
                                    and r not in self.failures and self.procs[r].is_alive()])
                return
        self._drain(grace=2.0)

    def _handle(self, key):
        """React to one ready socket, pipe or process sentinel."""
        kind, rank = key.data
        if kind == "accept":
            self._accept()
        elif kind == "output":
            self._read_output(key.fileobj, rank)
        elif kind == "result":
            self._read_result(key.fileobj, rank)
        elif kind == "exit":
            self._rank_exited(rank)

    def _read_result(self, conn, rank):
        self._unregister(conn)
        try:
            status, body = conn.recv()
        except (EOFError, OSError):
            return
        if status == "ok":
            self.results[rank] = cloudpickle.loads(body)
        else:
            self.failures[rank] = (f"rank {rank} failed with {body['type']}: {body['message']}\n"
                                   f"Traceback of rank {rank} (most recent call last):\n"
                                   f"{format_frames(body['frames'], self.source_files)}\n"
                                   f"{body['type']}: {body['message']}")

    def _rank_exited(self, rank):
        proc = self.procs[rank]
        self._unregister(proc.sentinel)
        proc.join(1)
        self.exited.add(rank)
        conn = self.result_conns[rank]
        if rank not in self.results and rank not in self.failures and self._registered(conn) and conn.poll():
            self._read_result(conn, rank)
        if rank in self.results or rank in self.failures:
            return
        code = proc.exitcode
        if code is not None and code < 0:
            name = signal.Signals(-code).name
            why = f"rank {rank} was killed by signal {name}"
            if name == "SIGABRT":
                why += " (gloo aborts the process like this on some errors)"
        else:
            why = f"rank {rank} exited with code {code} before returning a result"
        if getattr(self, "replace", 0) > 0:
            self._replace(rank, why)
            return
        crash_log = self._read_stack_file(rank)
        self.failures[rank] = why + (f"\n{crash_log}" if crash_log else "")

    def _registered(self, obj):
        return obj in self.selector.get_map() if not isinstance(obj, int) else any(
            k.fd == obj for k in self.selector.get_map().values())

    def _unregister(self, obj):
        try:
            self.selector.unregister(obj)
        except (KeyError, ValueError):
            pass

    def _drain(self, grace):
        """Keep reading output, results and exits for up to `grace` seconds, or until all are in."""
        end = time.monotonic() + grace
        while time.monotonic() < end and self.selector.get_map().keys() - {self.output_server.fileno()}:
            for key, _ in self.selector.select(timeout=0.05):
                self._handle(key)

    def _stop_all(self):
        for proc in getattr(self, "procs", []) + getattr(self, "retired", []):
            self._kill_group(proc)
        for proc in getattr(self, "procs", []) + getattr(self, "retired", []):
            proc.join(5)

    def _kill_group(self, proc):
        """Kill a rank's process group (the rank and all it started), if its id still names that group.

        The group's id is the rank's pid. Once the forkserver has reaped a rank and its group is empty, that
        number can be reused at once by a rank of another launch, which a stale killpg would kill (seen as "Gloo
        connectFullMesh failed ... Connection closed by peer" in a parallel run). It names our group while the
        rank is alive (not yet reaped) or while the rank's anchor lives: a process of the group, which Linux
        never lets a pid be reused under. A rank that ended on its own (a result, an exit, a signal) leaves the
        anchor, so what it started (`subprocess.Popen` without a wait) is killed too.
        """
        try:
            alive = proc.is_alive()
        except (AttributeError, ValueError):  # never started, or already closed
            return
        anchor = getattr(self, "anchors", {}).get(proc)
        try:
            anchored = anchor is not None and not anchor.poll(0)  # readable = closed: the anchor is gone
        except (OSError, ValueError):
            anchored = False
        if not (alive or anchored):
            return
        kills = [lambda: os.killpg(proc.pid, signal.SIGKILL)]
        if alive:  # kill() covers a rank not yet in its group
            kills.append(proc.kill)
        for kill in kills:
            try:
                kill()
            except (ProcessLookupError, PermissionError, AttributeError, ValueError):
                pass

    def _close(self):
        for conn in self.control_conns + list(self.result_conns.values()) + self.sockets:
            conn.close()
        self.selector.close()
        if getattr(self, "output_server", None) is not None:
            self.output_server.close()
        if getattr(self, "store", None) is not None:
            del self.store
        for conn in getattr(self, "anchors", {}).values():
            conn.close()
        for proc in self.procs + getattr(self, "retired", []):
            proc.close()
        self.tmp.cleanup()
