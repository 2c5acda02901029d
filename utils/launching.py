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
  `LaunchError` / `LaunchTimeout` with the remote traceback or every rank's Python stack, and all
  processes the launch started are killed: each rank leads its own process group, and a watchdog
  thread in every rank kills that group if the launching process disappears.
"""
from __future__ import annotations

import contextlib
import faulthandler
import gc
import importlib
import inspect
import io
import linecache
import multiprocessing
import os
import pickle
import re
import selectors
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
import types
from datetime import timedelta

import cloudpickle
import torch
import torch.distributed as dist

from . import compat

BACKENDS = ("auto", "gloo", "nccl")
_RANK_MARKER = "COURSE_LAUNCHED_RANK"  # set inside ranks that launch() started
_PEER_LOSS = ("Connection closed by peer", "Connection reset", "Broken pipe", "ECONNRESET",
              "Socket closed", "Connection refused")  # how gloo says "another rank went away"


class LaunchError(RuntimeError):
    """A rank failed. The message names the rank, what went wrong and where."""


class LaunchTimeout(LaunchError):
    """No result by the deadline: most often a hang. The message shows every rank's stack."""


# ---------------------------------------------------------------- choosing backend and device

def _gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def backend_for(world_size: int) -> str:
    """'nccl' when every rank can have its own CUDA GPU, otherwise 'gloo'."""
    return "nccl" if 0 < world_size <= _gpu_count() else "gloo"


def device() -> torch.device:
    """This rank's device: `cuda:<local rank>` under NCCL, else the CPU.

    Outside any rank (the notebook process itself) it is the best single device: cuda:0 or cpu.
    """
    if dist.is_available() and dist.is_initialized():
        if dist.get_backend() == "nccl":
            local_rank = int(os.environ.get("LOCAL_RANK", dist.get_rank() % torch.cuda.device_count()))
            return torch.device("cuda", local_rank)
        return torch.device("cpu")
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def default_threads(world_size: int) -> int:
    """Intra-op threads per rank so that all ranks together use each core once."""
    return max(1, len(os.sched_getaffinity(0)) // world_size)


def describe(world_size: int = 4) -> None:
    """Print which backend and devices a launch of `world_size` ranks will use here."""
    backend = backend_for(world_size)
    gpus = _gpu_count()
    if backend == "nccl":
        where = "one CUDA GPU per rank (" + ("cuda:0" if world_size == 1 else f"cuda:0 … cuda:{world_size - 1}") + ")"
    elif gpus:
        where = (f"CPU ({gpus} GPU(s) found, fewer than {world_size} ranks: NCCL needs one per rank, so every rank "
                 "computes on the CPU, where utils.device() puts its tensors)")
    else:
        where = "CPU (no CUDA GPU found)"
    print(f"{world_size} rank{'s' if world_size != 1 else ''} will use backend '{backend}' on {where}")


# ---------------------------------------------------------------- the public entry point

def launch(fn, *args, world_size: int = 4, backend: str = "auto", timeout: float = 60.0,
           threads: int | None = None, **kwargs) -> list:
    """Run `fn(*args, **kwargs)` on `world_size` ranks; return their results in rank order.

    Each rank has the default process group initialised (`dist.get_rank()`, collectives work).
    Tensors in the results come back on the CPU. `threads` sets torch's intra-op threads per rank
    (default: cores // world_size, at least 1). Raises LaunchError if a rank fails and
    LaunchTimeout after `timeout` seconds; either way every rank process is gone afterwards.
    Under torchrun (RANK and WORLD_SIZE set), runs `fn` once in this process for its rank.
    """
    if os.environ.get(_RANK_MARKER):
        raise RuntimeError("launch() was called inside a rank it started; call it from the notebook.")
    _check_arguments(fn, world_size, backend, timeout, threads)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return _run_under_torchrun(fn, args, kwargs, backend)
    if backend == "auto":
        backend = backend_for(world_size)
    try:
        payload = dumps((fn, args, kwargs))
    except Exception as exc:
        raise ValueError(f"could not send fn and its arguments to the ranks ({type(exc).__name__}: "
                         f"{exc}); pass plain data, tensors, functions or classes.") from None
    threads = threads or default_threads(world_size)
    try:
        return _Launch(world_size, backend, timeout, threads).run(payload, source_files_of(fn))
    except KeyboardInterrupt as stop:  # ■ pressed: every rank is stopped; the launcher's inner frames are noise
        raise stop.with_traceback(None) from None


class _Pickler(cloudpickle.Pickler):
    """cloudpickle, plus: anything registered in sys.modules travels as an import by name.

    cloudpickle ships a module global's submodules that the function's names mention; some torch
    "modules" (e.g. torch.distributed.config) are objects it cannot pickle, so a notebook global
    named `config` would otherwise break a launch.
    """

    def reducer_override(self, obj):
        if isinstance(obj, types.ModuleType) and sys.modules.get(obj.__name__) is obj:
            return importlib.import_module, (obj.__name__,)
        return super().reducer_override(obj)


def dumps(obj) -> bytes:
    """Pickle `obj` the way launch() ships functions and results (by value, modules by name)."""
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buffer.getvalue()


def _check_arguments(fn, world_size, backend, timeout, threads):
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


def _run_under_torchrun(fn, args, kwargs, backend):
    """torchrun started this process as one rank: run fn here and gather every rank's result."""
    created = not dist.is_initialized()
    if created:
        if backend == "auto":
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend)
    try:
        result = _to_cpu(fn(*args, **kwargs))
        results = [None] * dist.get_world_size()
        dist.all_gather_object(results, result)
        return results
    finally:
        if created:
            # A DDP module that fn built is garbage in a reference cycle that still holds the
            # group; freed only at interpreter exit, gloo's threads then abort the process.
            gc.collect()
            dist.destroy_process_group()


# ---------------------------------------------------------------- the launching side

def _forkserver_context():
    """The forkserver context, with this module (and so torch) preloaded in the server."""
    ctx = multiprocessing.get_context("forkserver")
    from multiprocessing import forkserver
    if forkserver._forkserver._forkserver_pid is None:  # not started yet: preload may still change
        # torch._dynamo is what a rank's first torch.optim constructor imports (~1-2 s per rank).
        ctx.set_forkserver_preload([__name__, "torch._dynamo"])
    return ctx


@contextlib.contextmanager
def _main_module_hidden():
    """Keep multiprocessing from re-importing the launching script in every rank.

    fn travels by value, so a rank never needs `__main__`; re-running a script without an
    `if __name__ == "__main__":` guard would even launch again from inside the rank.
    """
    main = sys.modules["__main__"]
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if k in main.__dict__}
    main.__dict__.pop("__file__", None)
    main.__spec__ = None
    try:
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)


def _output_is_live() -> bool:
    """True when a person watches the output as it happens (JupyterLab, Colab, a terminal).

    Batch executors (nbval/pytest, papermill, nbconvert, the course's runner and grader) get the
    output grouped in rank order instead. COURSE_OUTPUT=live|grouped overrides the guess, which
    goes by the program or module that started the kernel (its parent process).
    """
    mode = os.environ.get("COURSE_OUTPUT", "")
    if mode in ("live", "grouped"):
        return mode == "live"
    try:
        from IPython import get_ipython
        shell = get_ipython()
    except ImportError:
        shell = None
    if shell is None or not hasattr(shell, "kernel"):
        return sys.stdout.isatty()
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            argv = f.read().decode(errors="replace").split("\0")
    except OSError:
        return True
    name = executor_name(argv)
    return name not in _BATCH_EXECUTORS and not name.startswith("utils.tools.")


# Programs and modules that execute notebooks with nobody watching (a kernel's parent process); the course's
# own tools (utils.tools.*) too.
_BATCH_EXECUTORS = {"papermill", "pytest", "py.test", "nbval", "nbclient", "nbconvert", "jupyter-nbconvert",
                    "jupyter-execute", "execnet"}


def executor_name(argv: list) -> str:
    """The program a command line runs: its executable's name, or a Python's script or `-m` module.

    ['/x/bin/python', '-m', 'pytest', ...] -> 'pytest'; ['/x/bin/python', '/x/bin/papermill', ...] ->
    'papermill'; ['/x/bin/jupyter-lab', '--root-dir=/tmp/pytest-of-me/...'] -> 'jupyter-lab'.
    Only the program counts, never the paths it is given.
    """
    argv = [a for a in argv if a]
    if not argv:
        return ""
    name = os.path.basename(argv[0])
    if not re.fullmatch(r"python[\d.]*", name):
        return name
    args = iter(argv[1:])
    for arg in args:
        if arg == "-m":
            return next(args, "")
        if arg.startswith("-m"):
            return arg[2:]
        if arg == "-c" and "sys.stdin.readline()" in next(args, ""):
            return "execnet"  # execnet's bootstrap: a pytest-xdist worker
        if arg in ("-c", "-"):
            return name
        if arg in ("-W", "-X", "-Q"):
            next(args, None)  # an option with a separate value
        elif not arg.startswith("-"):
            return os.path.basename(arg)  # a script
    return name


class _Launch:
    """One launch: its processes, sockets, store and temporary files, and their cleanup."""

    def __init__(self, world_size, backend, timeout, threads):
        self.world_size, self.backend, self.timeout, self.threads = world_size, backend, timeout, threads
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
        ctx = _forkserver_context()
        env = dict(os.environ)  # what the student set in the notebook, for torch inside the ranks
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        env.setdefault("NCCL_SOCKET_IFNAME", "lo")
        # With device_id set, torch warns once per rank that single send/recv calls are serialised;
        # lessons that use them do so on purpose, and the warning would land on stderr.
        env.setdefault("TORCH_NCCL_SHOW_EAGER_INIT_P2P_SERIALIZATION_WARNING", "false")
        for rank in range(self.world_size):
            result_recv, result_send = ctx.Pipe(duplex=False)
            control_recv, control_send = ctx.Pipe(duplex=False)
            spec = dict(rank=rank, world_size=self.world_size, backend=self.backend,
                        store_port=self.store_port,
                        output_port=self.output_server.getsockname()[1],
                        stack_file=self._stack_path(rank),
                        threads=self.threads, env=env, timeout=self.timeout, payload=payload)
            proc = ctx.Process(target=_rank_main, args=(spec, result_send, control_recv),
                               name=f"rank-{rank}", daemon=True)
            with _main_module_hidden():
                proc.start()
            result_send.close()
            control_recv.close()
            self.procs.append(proc)
            self.control_conns.append(control_send)
            self.result_conns[rank] = result_recv
            self.selector.register(result_recv, selectors.EVENT_READ, ("result", rank))
            self.selector.register(proc.sentinel, selectors.EVENT_READ, ("exit", rank))

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

    def _accept(self):
        try:
            conn, _ = self.output_server.accept()
        except BlockingIOError:
            return
        conn.setblocking(True)
        header = b""
        while not header.endswith(b"\n"):  # "<rank> <stream>\n", sent right after connecting
            chunk = conn.recv(1)
            if not chunk:
                conn.close()
                return
            header += chunk
        rank, stream = map(int, header.split())
        conn.setblocking(False)
        self.sockets.append(conn)
        self.selector.register(conn, selectors.EVENT_READ, ("output", (rank, stream)))

    def _read_output(self, conn, rank_stream):
        try:
            data = conn.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._unregister(conn)
            data = b"\n" if self.partial.get(rank_stream) else b""
            if not data:
                return
        text = self.partial.pop(rank_stream, b"") + data
        *complete, rest = text.split(b"\n")
        if rest:
            self.partial[rank_stream] = rest
        rank, stream = rank_stream
        for raw in complete:
            self._emit_line(rank, stream, raw.decode(errors="replace"))

    def _emit_line(self, rank, stream, line):
        """One complete line a rank wrote: stdout shown now (live), the rest kept for rank order."""
        if self.live and stream == 1:
            print(f"[rank {rank}] {line}", flush=True)
        else:
            self.lines[rank][stream].append(line)

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

    def _wait_for_root_cause(self):
        """After a first failure, give the rank that caused it time to report too.

        A rank that lost its peer often reports before the peer's own death is noticed (a signal
        reaches the launcher through the forkserver), so wait longer while only such
        consequences are known.
        """
        self._drain(grace=0.5)
        end = time.monotonic() + 2.0
        while time.monotonic() < end and all(self._is_peer_loss(r) for r in self.failures):
            self._drain(grace=0.1)

    def _is_peer_loss(self, rank):
        return any(sign in self.failures[rank] for sign in _PEER_LOSS)

    def _dump_stacks(self):
        """Timeout: ask every live rank for its Python stack (faulthandler on SIGUSR1)."""
        stuck = [r for r in range(self.world_size) if self.procs[r].is_alive()]
        for rank in stuck:
            try:
                os.kill(self.procs[rank].pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
        self._wait_for_stack_files(stuck)
        stacks = {r: self._read_stack_file(r) or "  (no stack: the rank did not answer)" for r in stuck}
        finished = sorted(set(range(self.world_size)) - set(stuck))
        lines = [f"launch timed out after {self.timeout:g} s: {len(stuck)} of {self.world_size} ranks still "
                 "running. Likely a hang: a rank skipped or reordered a collective, or sends and receives "
                 "wait on each other (deadlock)."]
        if finished:
            lines.append("Ranks that had finished: " + ", ".join(map(str, finished)))
        lines.append("Where each rank is stuck (most recent call last):")
        for rank in stuck:
            lines.append(f"rank {rank}:\n{stacks[rank]}")
        self.timeout_report = "\n".join(lines)

    def _wait_for_stack_files(self, ranks, limit=3.0):
        """Until every rank's dump is written and stops growing (a starved rank answers late)."""
        sizes, end = {}, time.monotonic() + limit
        while time.monotonic() < end:
            self._drain(grace=0.1)
            now = {r: self._stack_file_size(r) for r in ranks}
            if all(now.values()) and now == sizes:
                return
            sizes = now

    def _stack_path(self, rank):
        """Where rank `rank`'s faulthandler writes its stacks."""
        return os.path.join(self.tmp.name, f"stack-{rank}.txt")

    def _stack_file_size(self, rank):
        try:
            return os.path.getsize(self._stack_path(rank))
        except OSError:
            return 0

    def _read_stack_file(self, rank):
        """This rank's Python stack(s) as faulthandler wrote them, tidied; '' if none."""
        try:
            with open(self._stack_path(rank), errors="replace") as f:
                text = f.read()
        except OSError:
            return ""
        header = "Fatal Python error: " + text.split("Fatal Python error: ")[1].splitlines()[0] + "\n" \
            if "Fatal Python error: " in text else ""
        stacks = [format_frames(frames, self.source_files) for frames in parse_faulthandler(text)]
        return header + "\n  --- another thread ---\n".join(s for s in stacks if s)

    def _stop_all(self):
        for proc in getattr(self, "procs", []):
            # Only a rank still alive: once the forkserver has reaped one, its pid (and group id) can
            # be reused at once by a rank of another launch, which a stale killpg would kill
            # (seen as "Gloo connectFullMesh failed ... Connection closed by peer" in a parallel run).
            # is_alive() is True only before the reaping, so the pid still names our rank.
            try:
                alive = proc.is_alive()
            except (AttributeError, ValueError):  # never started, or already closed
                continue
            if not alive:
                continue
            for kill in (lambda: os.killpg(proc.pid, signal.SIGKILL), proc.kill):
                try:  # the group catches anything the rank started; kill() covers a rank not yet in it
                    kill()
                except (ProcessLookupError, PermissionError, AttributeError, ValueError):
                    pass
        for proc in getattr(self, "procs", []):
            proc.join(5)

    def _close(self):
        for conn in self.control_conns + list(self.result_conns.values()) + self.sockets:
            conn.close()
        self.selector.close()
        if getattr(self, "output_server", None) is not None:
            self.output_server.close()
        if getattr(self, "store", None) is not None:
            del self.store
        for proc in self.procs:
            proc.close()
        self.tmp.cleanup()

    def _take_stderr(self, ranks, last=20):
        parts = []
        for rank in ranks:
            lines, self.lines[rank][2] = self.lines[rank][2][-last:], []
            if lines:
                parts.append(f"\nstderr of rank {rank} (last {len(lines)} lines):\n" +
                             "\n".join("  " + line for line in lines))
        return "".join(parts)

    def _print_output(self):
        """Print the lines held back (live: only stderr), in rank order."""
        for stream, target in ((1, sys.stdout), (2, sys.stderr)):
            for rank in range(self.world_size):
                for line in self.lines[rank][stream]:
                    print(f"[rank {rank}] {line}", file=target)
                self.lines[rank][stream] = []
            target.flush()

    def _error(self):
        """The exception to raise, and the ranks it blames (their stderr goes into the report)."""
        if self.timeout_report and not self.failures:
            return LaunchTimeout(self.timeout_report), list(range(self.world_size))
        # Report the root cause: a rank whose peer vanished fails *because* of another rank.
        ranks = sorted(self.failures, key=lambda r: (self._is_peer_loss(r), r))
        lines, culprits = [self.failures[ranks[0]]], [ranks[0]]
        for rank in ranks[1:]:
            if not self._is_peer_loss(rank):
                culprits.append(rank)
                first_line = self.failures[rank].splitlines()[0]
                lines.append(f"rank {rank} also failed: " +
                             (first_line[:157] + "..." if len(first_line) > 160 else first_line))
        # Ranks that only lost a peer, or were still running, were stopped because of the above.
        stopped = sorted(set(range(self.world_size)) - set(self.results) - set(culprits))
        if stopped:
            lines.append(f"the other ranks were stopped: {', '.join(map(str, stopped))}")
        return LaunchError("\n".join(lines)), sorted(culprits)


# ---------------------------------------------------------------- the rank side

def _rank_main(spec, result_conn, control_conn):
    """Body of every rank process: set up, run fn, report, exit."""
    os.setsid()  # lead a process group, so the launcher can kill everything this rank starts
    rank, world_size = spec["rank"], spec["world_size"]
    _connect_output(rank, spec["output_port"])
    os.environ.clear()
    os.environ.update(spec["env"])
    os.environ.update({_RANK_MARKER: "1", "RANK": str(rank), "WORLD_SIZE": str(world_size),
                       "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world_size),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(spec["store_port"])})
    # Without a barrier after init, a rank whose fn needs no peer (a print, a refused send) can finish
    # and exit while a peer is still completing gloo's connection handshake with it, which then fails
    # with "Gloo connectFullMesh failed ... Connection closed by peer". torch's store-based barrier
    # holds every rank until all have connected.
    os.environ.setdefault("TORCH_DIST_INIT_BARRIER", "1")
    stack_file = open(spec["stack_file"], "w")
    faulthandler.enable(file=stack_file, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    threading.Thread(target=_exit_with_launcher, args=(control_conn,), daemon=True,
                     name="launcher-watchdog").start()
    torch.set_num_threads(spec["threads"])
    dist.set_debug_level_from_env()  # torch was imported before the notebook set the variable
    try:
        options = {}
        if spec["backend"] == "nccl":
            torch.cuda.set_device(rank)
            if "device_id" in inspect.signature(dist.init_process_group).parameters:
                options["device_id"] = torch.device("cuda", rank)  # NCCL then knows each rank's GPU
        store = dist.TCPStore("127.0.0.1", spec["store_port"], world_size, is_master=False,
                              timeout=timedelta(seconds=max(spec["timeout"], 30)))
        dist.init_process_group(spec["backend"], store=store, rank=rank, world_size=world_size, **options)
        fn, args, kwargs = cloudpickle.loads(spec["payload"])
        result = _to_cpu(fn(*args, **kwargs))
        body = dumps(result)
    except BaseException as exc:  # noqa: BLE001 — everything is reported to the launcher
        sys.stdout.flush()
        sys.stderr.flush()
        result_conn.send(("error", _describe_exception(exc)))
        os._exit(1)  # skip destroy_process_group: peers may be gone and it could block
    compat.end_group_before_exit()
    sys.stdout.flush()
    sys.stderr.flush()
    result_conn.send(("ok", body))
    os._exit(0)


def _connect_output(rank, port):
    """Point file descriptors 1 and 2 at the launcher, so C-level output is captured too."""
    for stream in (1, 2):
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(f"{rank} {stream}\n".encode())
        os.dup2(sock.fileno(), stream)
        sock.close()
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8",
                                  errors="backslashreplace", line_buffering=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8",
                                  errors="backslashreplace", line_buffering=True)


def _exit_with_launcher(control_conn):
    """Watchdog: when the launching process goes away, take this rank's whole group with it."""
    try:
        control_conn.recv()
    except (EOFError, OSError):
        pass
    os.killpg(0, signal.SIGKILL)


def _describe_exception(exc):
    """What the launcher needs to show a remote traceback: type, message and raw frames."""
    frames = [(f.filename, f.lineno, f.name, f.line or "") for f in traceback.extract_tb(exc.__traceback__)]
    return {"type": type(exc).__name__, "message": str(exc), "frames": frames}


def _to_cpu(value):
    """Move tensors in (nested) lists, tuples and dicts to the CPU before they travel."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu() if value.device.type != "cpu" else value
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(_to_cpu(v) for v in value)
    if isinstance(value, dict) and type(value) is dict:
        return {k: _to_cpu(v) for k, v in value.items()}
    return value


# ---------------------------------------------------------------- tidy reports

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def short_path(path: str) -> str:
    """A path without machine-specific prefixes: '<cell>', 'utils/x.py', 'torch/…', 'python/…'."""
    if re.search(r"ipykernel_\d+[/\\]\d+\.py$", path) or path.startswith("<ipython-input"):
        return "<cell>"
    match = re.search(r"(?:site|dist)-packages[/\\](.*)$", path)
    if match:
        return match.group(1)
    if path.startswith(_REPO_ROOT):
        return path[len(_REPO_ROOT):]
    match = re.search(r"[/\\]lib[/\\]python3\.\d+[/\\](.*)$", path)
    if match:
        return "python/" + match.group(1)
    return path


# Frames of the course's plumbing (launcher, cell magic and pool, byte counter, lab-check harness): not the student's.
_PLUMBING = ("utils/launching.py", "utils/magic.py", "utils/cells.py", "utils/pool.py", "utils/bytecount.py",
             "utils/labchecks/", "multiprocessing", "<string>")


def format_frames(frames, source_files=None) -> str:
    """Traceback lines for (file, line, function, code) frames, most recent call last.

    Frames of the launcher's own plumbing are dropped. cloudpickle renames the file of every
    function it ships to '<dynamic-code>'; `source_files` (function name → file, from the launching
    process) recovers it, and with it the line of code from the notebook's cell cache.
    """
    source_files = source_files or {}
    out = []
    for filename, lineno, name, code in frames:
        if any(p in filename for p in _PLUMBING):
            continue
        if filename == "<dynamic-code>" and name in source_files:
            filename = source_files[name]
        code = code or linecache.getline(filename, lineno).strip()
        out.append(f'  File "{short_path(filename)}", line {lineno}, in {name}')
        if code:
            out.append(f"    {code}")
    return "\n".join(out)


def parse_faulthandler(text: str) -> list:
    """Frames of each thread in a faulthandler dump, most recent call last; the watchdog left out."""
    threads, current = [], None
    for line in text.splitlines():
        if line.startswith(("Thread 0x", "Current thread 0x", "Stack (most")):
            current = []
            threads.append(current)
        elif current is not None:
            match = re.match(r'\s*File "(.*)", line (\d+) in (.*)', line)
            if match:
                current.append((match.group(1), int(match.group(2)), match.group(3), ""))
    return [list(reversed(t)) for t in threads if t and not any(f[2] == "_exit_with_launcher" for f in t)]


def source_files_of(fn) -> dict:
    """Function name → source file for fn and the functions of the launching script or notebook."""
    files = {}
    main = sys.modules.get("__main__")
    candidates = list(vars(main).values()) if main is not None else []
    for obj in candidates + [fn]:
        code = getattr(obj, "__code__", None)
        stack = [code] if code is not None else []
        while stack:
            code = stack.pop()
            files[code.co_name] = code.co_filename
            stack.extend(c for c in code.co_consts if hasattr(c, "co_filename"))
    return files
