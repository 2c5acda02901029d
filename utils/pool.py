"""A pool of ranks that stay alive across notebook cells (`%dist start -n 4`).

`Pool(4)` starts 4 ranks exactly as `launch` does (forkserver, loopback rendezvous, backend and
device choice, `[rank R]` output, per-rank stacks; utils/launching.py), but the function each rank
runs is a small server: it keeps one namespace per rank and runs the cells it is sent in it, so a
model built in one cell is still there in the next. `%%distributed` uses the pool while one runs.

What keeps a pool trustworthy:
- Names a cell uses travel from the notebook only where the rank lacks them: the rank's own
  variables win. A shipped notebook function is re-bound to the rank's namespace, so it sees the
  rank's variables (and the cell's assignments), not a frozen copy of the notebook's.
- Every rank counts the collectives it runs on the default group. A rank whose state cannot be
  trusted any more (it died, hung, was interrupted inside a collective, or ran a different number
  of collectives than its peers) costs a report and a fresh pool: the old ranks are killed, the
  new ones start with empty namespaces, and the message says so.
- An exception on some ranks keeps the pool when every other rank finishes the cell within a short
  grace; a rank still running after it is most likely waiting in a collective for the failed one,
  and counts as a hang.
- The stop button (KeyboardInterrupt in the notebook) is forwarded to every rank as SIGINT.
- Ranks die with the notebook's process: launch's watchdog in every rank kills it when the
  notebook's end of a pipe closes (kernel restart, shutdown or crash), and `stop()` runs at exit.
"""
from __future__ import annotations

import atexit
import builtins
import ctypes
import functools
import inspect
import os
import selectors
import signal
import socket
import sys
import tempfile
import time
import types
from multiprocessing.connection import Connection

import cloudpickle
import torch
import torch.distributed as dist

from .cells import CELL_FILE, remember_source, run_cell_source
from .launching import (LaunchError, LaunchTimeout, _check_arguments, _describe_exception, _Launch,
                        _output_is_live, _to_cpu, backend_for, default_threads, device, dumps,
                        format_frames, parse_faulthandler)

_MARK = "\x00end of cell "  # what a rank writes on stdout and stderr after each cell
_RESTARTED = ("The pool was restarted: {n} fresh ranks with the process group initialised. Every rank's "
              "variables were lost; run the cells that build them again.")

# Collectives every rank of the default group must call; they are counted per rank.
_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "all_gather_object",
                "broadcast", "broadcast_object_list", "reduce", "reduce_scatter", "reduce_scatter_tensor",
                "reduce_scatter_single", "all_to_all", "all_to_all_single", "barrier", "monitored_barrier",
                "gather", "gather_object", "scatter", "scatter_object_list", "new_group")
_POINT_TO_POINT = ("send", "recv", "isend", "irecv")

_current = None  # the notebook's running pool


def current() -> "Pool | None":
    """The running pool of this notebook, or None."""
    return _current if _current is not None and _current.running else None


class Pool(_Launch):
    """N ranks with the default process group initialised, alive until `stop()`."""

    def __init__(self, world_size: int = 4, backend: str = "auto", threads: int | None = None,
                 grace: float = 2.0, interrupt_grace: float = 3.0, start_timeout: float = 60.0):
        """Start the ranks and wait until every one has its process group and is ready for cells.

        `grace`: seconds the other ranks get to finish a cell after one raised; `interrupt_grace`:
        seconds every rank gets to stop after the stop button.
        """
        global _current
        _check_arguments(_serve, world_size, backend, start_timeout, threads)
        if backend == "auto":
            backend = backend_for(world_size)
        super().__init__(world_size, backend, start_timeout, threads or default_threads(world_size))
        self.grace, self.interrupt_grace = grace, interrupt_grace
        self.running = False
        self._start()
        _current = self

    # ------------------------------------------------------------ starting and stopping

    def _start(self):
        """Start fresh ranks (launch's machinery, with `_serve` as the function) and connect to each."""
        self.tmp = tempfile.TemporaryDirectory(prefix="pool-")
        self.selector = selectors.DefaultSelector()
        self.procs, self.result_conns, self.control_conns, self.sockets = [], {}, [], []
        self.conns, self.pids, self.devices = {}, {}, {}
        self.keys = {r: set() for r in range(self.world_size)}   # names each rank has
        self.counts = {r: 0 for r in range(self.world_size)}     # default-group collectives each rank ran
        self.busy, self.cell = set(), 0
        self._reset_cell()
        self.source_files = {}
        self.live = _output_is_live()
        self.command_server = socket.socket()
        self.command_server.bind(("127.0.0.1", 0))
        self.command_server.listen(self.world_size)
        self.command_server.setblocking(False)
        self.selector.register(self.command_server, selectors.EVENT_READ, ("command-accept", None))
        try:
            self._open_rendezvous()
            self._start_ranks(dumps((_serve, (self.command_server.getsockname()[1],), {})))
            deadline = time.monotonic() + self.timeout
            while len(self.conns) < self.world_size and not self.failures and time.monotonic() < deadline:
                for key, _ in self.selector.select(timeout=0.25):
                    self._handle(key)
            if len(self.conns) < self.world_size:
                if not self.failures:
                    self.failures[min(set(range(self.world_size)) - set(self.conns))] = (
                        f"the ranks did not start within {self.timeout:g} s")
                self._wait_for_root_cause()
                error, _ = self._error()
                raise LaunchError(f"could not start the pool: {error}")
        except BaseException:
            self._shutdown()
            raise
        finally:
            self._print_output()
        self.running = True
        atexit.register(self.stop)

    def stop(self):
        """End every rank of the pool (they leave their loop; any that does not is killed)."""
        global _current
        if not self.running:
            return
        self.running = False
        for conn in self.conns.values():
            try:
                conn.send(("stop",))
            except OSError:
                pass
        end = time.monotonic() + 2.0
        while time.monotonic() < end and any(p.is_alive() for p in self.procs):
            time.sleep(0.01)
        self._shutdown()
        if _current is self:
            _current = None
        atexit.unregister(self.stop)

    def restart(self):
        """Kill every rank and start fresh ones (empty namespaces, a new process group)."""
        self.running = False
        self._shutdown()
        self._start()

    def _shutdown(self):
        """Kill what is left and release every process, socket and file (launch's cleanup)."""
        self._stop_all()
        for conn in self.conns.values():
            conn.close()
        self.command_server.close()
        self._close()

    # ------------------------------------------------------------ what the notebook calls

    def run_cell(self, source: str, names: dict, ranks=None, timeout: float = 60.0) -> list:
        """Run `source` on `ranks` (default: all); return the last expression's value per rank.

        `names` are notebook values the cell may use; each rank takes only those it lacks. The list
        has one entry per rank of the pool, None for ranks that did not run the cell. Raises
        LaunchError / LaunchTimeout like `launch`, after which the pool is either kept (the message
        says so) or restarted.
        """
        ranks = sorted(set(range(self.world_size)) if ranks is None else set(ranks))
        if not ranks or ranks[0] < 0 or ranks[-1] >= self.world_size:
            raise ValueError(f"ranks must be among 0 … {self.world_size - 1}, got {ranks}")
        self._check_running()
        lacking = {k: v for k, v in names.items() if any(k not in self.keys[r] for r in ranks)}
        payload = dumps(lacking)
        remember_source(source)  # so that stacks of a hang show the cell's lines here
        self.live = _output_is_live()
        self.cell += 1
        self._reset_cell()
        for rank in ranks:
            self.conns[rank].send(("run", self.cell, source, payload, ranks))
            self.busy.add(rank)
        try:
            outcome = self._wait_for_cell(ranks, timeout)
        except KeyboardInterrupt:
            self._interrupt(ranks)
            raise
        return self._finish_cell(ranks, outcome, timeout)

    def get(self, name: str) -> list:
        """Each rank's value of `name`, in rank order (tensors on the CPU; None where a rank lacks it).

        A value that cannot leave its rank comes as what can (a DDP module's state_dict, else its
        repr), and a note says so.
        """
        self._check_running()
        replies = self._ask(("get", name))
        values, notes, lacking = [], {}, []
        for rank in range(self.world_size):
            found, body, note = replies[rank]
            values.append(cloudpickle.loads(body) if found else None)
            if not found:
                lacking.append(rank)
            if note:
                notes.setdefault(note, []).append(rank)
        for note, ranks in notes.items():
            print(f"{name}: {note} (rank{'s' if len(ranks) > 1 else ''} {_ranks_text(ranks)})")
        if len(lacking) == self.world_size:
            raise NameError(f"no rank of the pool has a variable named {name!r}")
        if lacking:
            print(f"{name}: rank{'s' if len(lacking) > 1 else ''} {_ranks_text(lacking)} "
                  f"{'have' if len(lacking) > 1 else 'has'} no such variable: None in {'their' if len(lacking) > 1 else 'its'} place")
        return values

    def status(self) -> list:
        """One dict per rank: rank, state (idle, busy or dead), pid, device and memory in use."""
        alive = {r: self.procs[r].is_alive() for r in range(self.world_size)}
        memory = self._ask(("memory",)) if self.running and all(alive.values()) and not self.busy else {}
        rows = []
        for rank in range(self.world_size):
            state = "dead" if not alive[rank] else "busy" if rank in self.busy else "idle"
            rows.append(dict(rank=rank, state=state, pid=self.pids.get(rank), device=self.devices.get(rank),
                             memory=memory.get(rank) or _rss(self.pids.get(rank))))
        return rows

    # ------------------------------------------------------------ waiting for a cell

    def _reset_cell(self):
        self.results, self.failures, self.replies, self.notes = {}, {}, {}, {}
        self.marks, self.exited, self.broken, self.timeout_report = set(), set(), {}, ""

    def _check_running(self):
        if not self.running:
            raise RuntimeError("this pool was stopped; start one with %dist start")

    def _cell_done(self, ranks):
        return all(r in self.replies and (r, 1) in self.marks and (r, 2) in self.marks for r in ranks)

    def _wait_for_cell(self, ranks, timeout):
        """Read output and replies until the cell ends: 'done', 'dead', 'hang' or 'hang after error'."""
        deadline, first_failure = time.monotonic() + timeout, None
        while not self._cell_done(ranks):
            now = time.monotonic()
            if self.exited:
                self._drain_briefly()
                return "dead"
            if self.failures and first_failure is None:
                first_failure = now
            if first_failure is not None and now > first_failure + self.grace:
                return "hang after error"
            if now > deadline:
                return "hang"
            for key, _ in self.selector.select(timeout=0.05):
                self._handle(key)
        return "done"

    def _drain_briefly(self, seconds=0.5):
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            for key, _ in self.selector.select(timeout=0.05):
                self._handle(key)

    def _finish_cell(self, ranks, outcome, timeout):
        """Print the output, decide whether the pool can be kept, and return results or raise."""
        self.busy -= set(self.replies)
        finished = sorted(r for r in ranks if r in self.results)
        if outcome == "done" and not self.failures:
            uneven = self._uneven_counts()
            self._print_output()
            if uneven:
                self.restart()
                raise LaunchError(uneven + "\n" + _RESTARTED.format(n=self.world_size))
            for note, where in self.notes.items():
                print(f"distributed_results: {note} (rank{'s' if len(where) > 1 else ''} {_ranks_text(where)})")
            return [self.results.get(r) for r in range(self.world_size)]
        culprits = sorted(self.failures)
        lines = []
        if self.failures:
            error, culprits = self._error()
            lines = [line for line in str(error).splitlines() if not line.startswith("the other ranks")]
        restart, cls = outcome != "done", LaunchError
        if outcome == "dead":
            lines.append("the rank is gone, and with it the process group every rank shares.")
            stuck = sorted(set(ranks) - set(self.replies) - self.exited)
            if stuck:
                lines.append(self._stacks(stuck))
        elif outcome in ("hang", "hang after error"):
            stuck = sorted(set(ranks) - set(self.replies) - self.exited)
            if outcome == "hang":
                cls = LaunchTimeout
                lines.append(f"the cell timed out after {timeout:g} s: {len(stuck)} of {len(ranks)} ranks still "
                             "running. Likely a hang: a rank skipped or reordered a collective, or sends and "
                             "receives wait on each other (deadlock).")
            else:
                lines.append(f"ranks {_ranks_text(stuck)} were still running {self.grace:g} s after that: most "
                             "likely waiting in a collective for the failed rank, so this counts as a hang.")
            lines.append(self._stacks(stuck))
        uneven = self._uneven_counts() if not restart else ""
        if uneven:
            restart = True
            lines.append(uneven)
        if finished:
            lines.append(f"ranks that finished the cell: {_ranks_text(finished)}")
        stderr = self._take_stderr(culprits)
        for rank in range(self.world_size):
            self.lines[rank][2] = []
        self._print_output()
        if restart:
            self.restart()
            lines.append(_RESTARTED.format(n=self.world_size))
        else:
            lines.append("The pool is kept: every rank's variables are as the cell left them.")
        raise cls("\n".join(lines) + stderr)

    def _uneven_counts(self):
        """A sentence when ranks ran different numbers of collectives (their group is out of step)."""
        if len(set(self.counts.values())) <= 1:
            return ""
        counts = ", ".join(f"rank {r}: {c}" for r, c in sorted(self.counts.items()))
        return (f"the ranks ran different numbers of collectives ({counts}): one skipped a collective its "
                "peers completed, so the next one would mix up data or hang.")

    def _interrupt(self, ranks):
        """The stop button: SIGINT to every busy rank; keep the pool only if all stopped cleanly."""
        for rank in sorted(self.busy):
            try:
                os.kill(self.pids[rank], signal.SIGINT)
            except ProcessLookupError:
                pass
        end = time.monotonic() + self.interrupt_grace
        try:
            while time.monotonic() < end and not self._cell_done(ranks) and not self.exited:
                for key, _ in self.selector.select(timeout=0.05):
                    self._handle(key)
        except KeyboardInterrupt:  # pressed again: do not wait any longer
            pass
        self.busy -= set(self.replies)
        stuck = sorted(set(ranks) - set(self.replies))
        inside = sorted(self.broken)
        for rank in range(self.world_size):
            self.lines[rank][2] = [line for line in self.lines[rank][2] if "KeyboardInterrupt" not in line]
        self._print_output()
        if stuck or inside or self.exited or self._uneven_counts():
            why = (f"ranks {_ranks_text(stuck)} did not stop within {self.interrupt_grace:g} s (most likely blocked "
                   "in a collective, where a rank cannot be interrupted)" if stuck else
                   f"ranks {_ranks_text(inside)} stopped inside a collective" if inside else
                   "a rank died" if self.exited else self._uneven_counts())
            self.restart()
            print(f"Interrupted: {why}. " + _RESTARTED.format(n=self.world_size), file=sys.stderr)
        else:
            print("Interrupted: every rank stopped outside a collective; the pool is kept with every rank's "
                  "variables.", file=sys.stderr)

    def _stacks(self, ranks):
        """Every listed rank's Python stack now (faulthandler on SIGUSR1, as launch's hang report)."""
        before = {r: self._stack_file_size(r) for r in ranks}
        for rank in ranks:
            try:
                os.kill(self.pids[rank], signal.SIGUSR1)
            except ProcessLookupError:
                pass
        sizes, end = {}, time.monotonic() + 3.0
        while time.monotonic() < end:
            self._drain_briefly(0.1)
            now = {r: self._stack_file_size(r) for r in ranks}
            if all(now[r] > before[r] for r in ranks) and now == sizes:
                break
            sizes = now
        lines = ["Where each rank is stuck (most recent call last):"]
        for rank in ranks:
            try:
                with open(self._stack_path(rank), errors="replace") as f:
                    f.seek(before[rank])
                    text = f.read()
            except OSError:
                text = ""
            frames = [[f for f in thread if "utils/pool.py" not in f[0]] for thread in parse_faulthandler(text)]
            stacks = [format_frames(thread, self.source_files) for thread in frames]
            body = "\n  --- another thread ---\n".join(s for s in stacks if s)
            lines.append(f"rank {rank}:\n{body or '  (no stack: the rank did not answer)'}")
        return "\n".join(lines)

    def _ask(self, message, timeout=10.0):
        """Send `message` to every (idle) rank and collect one reply from each."""
        self.answers = {}
        for conn in self.conns.values():
            conn.send(message)
        end = time.monotonic() + timeout
        while len(self.answers) < self.world_size and time.monotonic() < end and not self.exited:
            for key, _ in self.selector.select(timeout=0.05):
                self._handle(key)
        if len(self.answers) < self.world_size:
            self.restart()
            raise LaunchError("a rank did not answer. " + _RESTARTED.format(n=self.world_size))
        return self.answers

    # ------------------------------------------------------------ events (launch's, plus the pool's)

    def _handle(self, key):
        kind, rank = key.data
        if kind == "command-accept":
            self._accept_command()
        elif kind == "reply":
            self._read_reply(key.fileobj, rank)
        else:
            super()._handle(key)

    def _accept_command(self):
        try:
            sock, _ = self.command_server.accept()
        except BlockingIOError:
            return
        sock.setblocking(True)
        conn = Connection(sock.detach())
        try:
            _, rank, pid, where = conn.recv()  # ("hello", rank, pid, device), sent on connecting
        except (EOFError, OSError):
            conn.close()
            return
        self.conns[rank], self.pids[rank], self.devices[rank] = conn, pid, where
        self.selector.register(conn, selectors.EVENT_READ, ("reply", rank))

    def _read_reply(self, conn, rank):
        try:
            message = conn.recv()
        except (EOFError, OSError):
            self._unregister(conn)
            return
        kind = message[0]
        if kind == "answer":
            self.answers[rank] = message[1]
            return
        _, cell, status, body, keys, count, inside = message
        if cell != self.cell:
            return
        self.replies[rank], self.keys[rank], self.counts[rank] = status, set(keys), count
        if inside:
            self.broken[rank] = True
        if status == "ok":
            value, note = body
            self.results[rank] = cloudpickle.loads(value)
            if note:
                self.notes.setdefault(note, []).append(rank)
        elif status == "error":
            self.failures[rank] = (f"rank {rank} failed with {body['type']}: {body['message']}\n"
                                   f"Traceback of rank {rank} (most recent call last):\n"
                                   f"{format_frames(body['frames'], self.source_files)}\n"
                                   f"{body['type']}: {body['message']}")

    def _emit_line(self, rank, stream, line):
        before, mark, _ = line.partition(_MARK)
        if mark:
            self.marks.add((rank, stream))
            if not before:
                return
        super()._emit_line(rank, stream, before)

    def _rank_exited(self, rank):
        super()._rank_exited(rank)
        self.busy.discard(rank)


def _ranks_text(ranks):
    return ", ".join(map(str, ranks))


def _rss(pid):
    """Resident memory of a process, e.g. '412.3 MiB (RSS)', read from /proc."""
    try:
        with open(f"/proc/{pid}/status") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration, TypeError):
        return "?"
    return f"{kib / 1024:.1f} MiB (RSS)"


# ---------------------------------------------------------------- the rank side

class _RankState:
    """What a rank's server knows about the cell it runs and the collectives it made."""

    def __init__(self):
        self.count = 0           # default-group collectives run so far
        self.ranks = None        # ranks running the current cell when not all of them
        self.in_cell = False     # True while the cell's own code runs (SIGINT interrupts only then)
        self.interrupted_inside = False


def _serve(port):
    """A rank's loop: run each cell the notebook sends in this rank's namespace, until told to stop."""
    sock = socket.create_connection(("127.0.0.1", port))
    conn = Connection(sock.detach())
    state = _RankState()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    _count_collectives(state, world_size)

    def on_sigint(signum, frame):
        if state.in_cell:
            raise KeyboardInterrupt
    signal.signal(signal.SIGINT, on_sigint)
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    conn.send(("hello", rank, os.getpid(), str(device())))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            os._exit(0)
        if message[0] == "stop":
            return None
        if message[0] == "run":
            conn.send(_run(state, namespace, *message[1:]))
        elif message[0] == "get":
            conn.send(("answer", _look_up(namespace, message[1])))
        elif message[0] == "memory":
            conn.send(("answer", _memory()))


def _run(state, namespace, cell, source, payload, ranks):
    """Run one cell; the reply says how it ended, what the rank now holds, and its collective count."""
    status, inside = "ok", False
    state.ranks = None if len(ranks) == dist.get_world_size() else set(ranks)
    state.interrupted_inside = False
    try:
        _adopt(cloudpickle.loads(payload), namespace)
        state.in_cell = True
        value = run_cell_source(source, namespace)
        state.in_cell = False
        body = _travel(value)
    except BaseException as exc:  # noqa: BLE001 — reported to the notebook; the rank lives on
        state.in_cell = False
        status = "interrupted" if isinstance(exc, KeyboardInterrupt) else "error"
        inside = state.interrupted_inside
        body = _describe_exception(exc)
    state.ranks = None
    sys.stdout.flush()
    sys.stderr.flush()
    _flush_c_stdio()
    for fd in (1, 2):
        os.write(fd, (_MARK + str(cell) + "\n").encode())
    keys = sorted(k for k in namespace if not k.startswith("__"))
    return ("done", cell, status, body, keys, state.count, inside)


def _flush_c_stdio():
    """C-level output (printf in a library) still buffered in this process."""
    try:
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):
        pass


def _adopt(shipped, namespace):
    """Take the notebook's values this rank lacks; bind shipped functions to the rank's namespace.

    A notebook function travels with a copy of the globals it reads. Re-made with the rank's
    namespace as its globals, it sees the rank's own variables, as the cell's code does.
    """
    todo = [(k, v) for k, v in shipped.items() if k not in namespace]
    while todo:
        name, value = todo.pop()
        if name in namespace:
            continue
        if _shipped_function(value):
            todo.extend((k, v) for k, v in value.__globals__.items()
                        if not k.startswith("__") and k not in namespace and k != name)
            value = _rebind(value, namespace)
        namespace[name] = value


def _shipped_function(value):
    """A plain function that travelled by value (its globals are not a real module's)."""
    if not isinstance(value, types.FunctionType):
        return False
    module = sys.modules.get(value.__module__)
    return module is None or value.__globals__ is not vars(module)


def _rebind(fn, namespace):
    new = types.FunctionType(fn.__code__, namespace, fn.__name__, fn.__defaults__, fn.__closure__)
    new.__kwdefaults__, new.__qualname__, new.__doc__ = fn.__kwdefaults__, fn.__qualname__, fn.__doc__
    new.__dict__.update(fn.__dict__)
    return new


def _travel(value):
    """(pickled value, note): tensors to the CPU; what cannot leave the rank replaced by what can."""
    value = _to_cpu(value)
    if isinstance(value, torch.nn.parallel.DistributedDataParallel):
        return dumps(_cpu_state(value.module)), ("a DistributedDataParallel module cannot leave its rank: "
                                                 "its module's state_dict() came instead (tensors on the CPU)")
    if isinstance(value, torch.nn.Module) and any(t.device.type != "cpu" for t in value.state_dict().values()):
        return dumps(_cpu_state(value)), "a module on a GPU: its state_dict() came instead (tensors on the CPU)"
    try:
        return dumps(value), None
    except Exception as exc:  # noqa: BLE001
        why = f"{type(value).__name__} cannot leave its rank ({type(exc).__name__})"
        if callable(getattr(value, "state_dict", None)):
            try:
                return dumps(_cpu_state(value)), why + ": its state_dict() came instead (tensors on the CPU)"
            except Exception:  # noqa: BLE001
                pass
        return dumps(repr(value)), why + ": its repr() came instead"


def _cpu_state(obj):
    return {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in obj.state_dict().items()}


def _look_up(namespace, name):
    if name not in namespace:
        return False, None, None
    body, note = _travel(namespace[name])
    return True, body, note


def _memory():
    text = _rss(os.getpid())
    if torch.cuda.is_available() and dist.get_backend() == "nccl":
        text += f", {torch.cuda.memory_allocated() / 2**20:.1f} MiB CUDA allocated"
    return text


def _count_collectives(state, world_size):
    """Wrap torch.distributed's collectives in this rank: count them, check them against --ranks."""
    def wrap(name, fn, point_to_point):
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def counted(*args, **kwargs):
            try:
                arguments = signature.bind_partial(*args, **kwargs).arguments
            except TypeError:
                arguments = {}
            group = arguments.get("group")
            default = group is None or group is dist.GroupMember.WORLD
            if state.ranks is not None and default:
                _refuse(name, arguments, state.ranks, world_size, point_to_point)
            if default and not point_to_point:
                state.count += 1
            try:
                return fn(*args, **kwargs)
            except KeyboardInterrupt:
                state.interrupted_inside = True
                raise

        return counted

    for names, point_to_point in ((_COLLECTIVES, False), (_POINT_TO_POINT, True)):
        for name in names:
            fn = getattr(dist, name, None)
            if fn is not None and not getattr(fn, "_pool_counted", False):
                wrapped = wrap(name, fn, point_to_point)
                wrapped._pool_counted = True
                setattr(dist, name, wrapped)


def _refuse(name, arguments, ranks, world_size, point_to_point):
    """A cell run with --ranks calls what needs a rank that is not running it: fail now, not hang."""
    idle = sorted(set(range(world_size)) - ranks)
    running = _ranks_text(sorted(ranks))
    if point_to_point:
        peer = arguments.get("dst", arguments.get("src"))
        if peer is None or peer in ranks:
            return
        raise RuntimeError(f"dist.{name} with rank {peer}, which is not running this cell (it runs on ranks "
                           f"{running} only, --ranks): it would wait forever.")
    raise RuntimeError(f"dist.{name} on the default group needs all {world_size} ranks, but this cell runs on "
                       f"ranks {running} only (--ranks): ranks {_ranks_text(idle)} would never join, so it would "
                       f"hang. Run it on every rank, or on a group of these ranks made with dist.new_group "
                       f"in a cell that every rank runs.")
