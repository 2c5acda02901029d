"""A pool of ranks that stay alive across notebook cells (`%dist start -n 4`).

`Pool(4)` starts 4 ranks exactly as `launch` does (forkserver, loopback rendezvous, backend and
device choice, `[rank R]` output, per-rank stacks; utils/launching.py), but the function each rank
runs is a small server: it keeps one namespace per rank and runs the cells it is sent in it, so a
model built in one cell is still there in the next. `%%distributed` uses the pool while one runs.
The rank's side is utils/pool_rank.py; how the end of a cell is judged (keep the pool or restart it),
utils/pool_outcomes.py.

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
import selectors
import socket
import tempfile
import time
from multiprocessing.connection import Connection

import cloudpickle

from .cells import remember_source
from .launching import (LaunchError, LaunchTimeout, _check_arguments, _Launch, _output_is_live,  # noqa: F401
                        backend_for, default_threads, dumps, format_frames)   # LaunchTimeout: run_cell raises it on a hang
from .pool_outcomes import _RESTARTED, CellOutcomes
from .pool_rank import _MARK, _ranks_text, _rss, _serve

_current = None  # the notebook's running pool


def current() -> "Pool | None":
    """The running pool of this notebook, or None."""
    return _current if _current is not None and _current.running else None


class Pool(CellOutcomes, _Launch):
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
        self.anchors = {}
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

    def _check_running(self):
        """Refuse to use a stopped pool."""
        if not self.running:
            raise RuntimeError("this pool was stopped; start one with %dist start")

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
        """One selector event: a rank's command connection, a reply on it, or one of launch's events."""
        kind, rank = key.data
        if kind == "command-accept":
            self._accept_command()
        elif kind == "reply":
            self._read_reply(key.fileobj, rank)
        else:
            super()._handle(key)

    def _accept_command(self):
        """Take a starting rank's command connection; its hello says its rank, pid and device."""
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
        """Read one message of a rank: an answer to `_ask`, or its reply to the current cell."""
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
        """Launch's output line, less the end-of-cell mark a rank writes on each stream (noted: that stream is done)."""
        before, mark, _ = line.partition(_MARK)
        if mark:
            self.marks.add((rank, stream))
            if not before:
                return
        super()._emit_line(rank, stream, before)

    def _rank_exited(self, rank):
        """Launch's handling of a rank that exited; it is no longer busy."""
        super()._rank_exited(rank)
        self.busy.discard(rank)
