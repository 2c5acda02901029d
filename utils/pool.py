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
import os
import selectors
import signal
import socket
import sys
import tempfile
import time
from multiprocessing.connection import Connection

import cloudpickle

from .cells import remember_source
from .launching import (LaunchError, LaunchTimeout, _check_arguments, _Launch, _output_is_live, backend_for,
                        default_threads, dumps, format_frames)
from .pool_rank import _MARK, _ranks_text, _rss, _serve

_RESTARTED = ("The pool was restarted: {n} fresh ranks with the process group initialised. Every rank's "
              "variables were lost; run the cells that build them again.")


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
        self.stopped = {}

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
