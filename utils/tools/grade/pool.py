"""The checker's handle on one pool of verdict processes (utils/tools/grade/rank.py): start, send, collect, kill.

The pool runs in the submission's sandbox when there is one. Every way it can fail becomes a PoolFailure whose
message says, in the student's terms, what happened: no reply in time (timed_out: the checker judges the part
again with a longer limit), a reply it cannot read, or a process that ended, with how it ended (rank.py reports
each rank's exit code or signal) and its last output.
"""
from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time

from . import wire
from .processes import kill_tree

STARTUP_TIMEOUT = 120.0  # seconds for a pool to import torch and run the solution cells
MAX_REPLY = 64 << 20     # bytes of tensors one rank may send back for one task
ERROR_GRACE = 3.0        # seconds the other ranks get to reply after one rank's code raised
WAIT_WINDOW = 1.0        # at a time limit, seconds over which the processes' states are sampled: deadlock or loop?
WAIT_SAMPLES = 50
WAITING_SHARE = 0.25     # under this share of looks running, a process waits; a loop runs in ~all of them, busy
                         # machine or not; in between counts as computing (judged again, never a wrong 0)
TAIL = 2000              # characters of a process's own output kept, to explain a crash
LAST_WORDS = 5.0         # seconds to wait, after a process ended, for its last output and how it ended


class PoolFailure(Exception):
    """The pool could not finish a task: the message says why, in the student's terms. timed_out: it ran out of
    time (the part is judged again with a longer limit) rather than crashed or answered garbage."""

    def __init__(self, message, timed_out=False):
        super().__init__(message)
        self.timed_out = timed_out


def _signal_name(number) -> str:
    import signal
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def how_it_ended(ended: dict | None, limits: dict | None) -> str:
    """ "exited with code 1", "was killed by SIGKILL (…)" from rank.py's status line, with what is known of who sent
    the signal: the sandbox's own limits raise SIGXCPU and SIGXFSZ; the kernel's out-of-memory killer and other
    processes send SIGKILL; the grader itself had not stopped the pool (it says so when it did)."""
    if ended is None:
        return "ended"
    if "signal" in ended:
        name, limits = _signal_name(ended["signal"]), limits or {}
        cause = {"SIGXCPU": f"its CPU-time limit ({limits.get('cpu_seconds', '?')} s of CPU per process)",
                 "SIGXFSZ": f"its file-size limit ({limits.get('file_size', 0) >> 20} MiB per file)",
                 "SIGKILL": "not sent by the grader: the kernel's out-of-memory killer, or a process of the "
                            "submission's own",
                 "SIGSEGV": "a crash in native code (torch, a C extension) or memory it may not touch",
                 "SIGABRT": "native code aborted (e.g. a C++ exception in torch, or a failed assertion)"}.get(name)
        return f"was killed by {name}" + (f" ({cause})" if cause else "")
    return f"exited with code {ended.get('code')}"


class Pool:
    """`size` ranks (utils/tools/grade/rank.py) that ran the solution cells and wait for tasks."""

    def __init__(self, size, setup, task_timeout, env, cwd, sandbox=None):
        self.size, self.task_timeout = size, task_timeout
        self.limits = json.loads((sandbox or {}).get("env", {}).get("COURSE_SANDBOX", "{}"))
        self.events = queue.Queue()
        self.commands, self.results, self.outputs = [], [], []
        self.tails = [bytearray() for _ in range(size + 1)]  # the last: the first process's own
        self.drains, self.ended, self.killed = [], {}, False
        self.cell_errors = {}
        self.started = time.time()
        self.proc = None
        theirs = []
        try:
            for _ in range(size):
                pipes = [os.pipe() for _ in range(3)]  # commands (to it), results and output (from it)
                theirs.append([pipes[0][0], pipes[1][1], pipes[2][1]])
                self.commands.append(os.fdopen(pipes[0][1], "wb"))
                self.results.append(os.fdopen(pipes[1][0], "rb"))
                self.outputs.append(os.fdopen(pipes[2][0], "rb"))
            status_read, status_write = os.pipe()  # how each rank ended (rank.py writes it)
            self.status = os.fdopen(status_read, "r")
            theirs.append([status_write])
            command = [*(sandbox or {}).get("prefix", []), sys.executable, "-m", "utils.tools.grade.rank"]
            self.proc = subprocess.Popen(command, stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                         pass_fds=[fd for fds in theirs for fd in fds],
                                         env={**env, **(sandbox or {}).get("env", {})}, cwd=cwd,
                                         start_new_session=True)
            child_fds = [list(fds) for fds in theirs[:-1]]  # pass_fds keeps the numbers
            for fd in (fd for fds in theirs for fd in fds):
                os.close(fd)
            theirs = []
            for index in range(size):
                self.drains.append(threading.Thread(target=self._drain, args=(self.outputs[index], index), daemon=True))
                threading.Thread(target=self._replies, args=(index,), daemon=True).start()
            self.drains.append(threading.Thread(target=self._drain, args=(self.proc.stdout, size), daemon=True))
            for thread in self.drains:
                thread.start()
            threading.Thread(target=self._statuses, daemon=True).start()
            self._write(self.proc.stdin, dict(setup, ranks=child_fds, status=status_write), b"", close=True)
            replies = self._collect(range(size), time.monotonic() + max(STARTUP_TIMEOUT, task_timeout),
                                    "running your solution cells", "code at the top level of a cell that never ends?")
        except BaseException:
            for fd in (fd for fds in theirs for fd in fds):
                os.close(fd)
            self.kill()
            raise
        for header, _ in replies.values():
            if header.get("ready") is not True:
                self.kill()
                raise PoolFailure("a verdict process did not start properly")
            errors = header.get("cell_errors")
            if isinstance(errors, dict):
                self.cell_errors.update({str(k)[:100]: str(v)[:2000] for k, v in errors.items()})

    # -------------------------------------------------------------- reading the processes

    def _drain(self, stream, index):
        """A process's own output (what the student's code prints): read as it comes, only its tail kept, to
        explain a crash. It never reaches a verdict, so printing does not change a grade; the time limit bounds
        how long a process may spend printing."""
        while chunk := stream.read1(1 << 16):
            self.tails[index] = (self.tails[index] + chunk)[-TAIL:]

    def _statuses(self):
        """rank.py's line for each rank that ended: {"rank": r, "code": c} or {"rank": r, "signal": s}."""
        try:
            for line in self.status:
                try:
                    ended = json.loads(line)
                    self.ended[int(ended["rank"])] = {k: int(v) for k, v in ended.items() if k in ("code", "signal")}
                except (ValueError, KeyError, TypeError):
                    continue
        except (OSError, ValueError):  # closed by kill()
            pass

    def _exit_message(self, index, doing) -> str:
        """Why the process of rank `index` ended, with its last output: waited for (the drain thread reads to
        the end of its output; rank.py reports how it ended once it has waited for it)."""
        deadline = time.monotonic() + LAST_WORDS
        self.drains[index].join(timeout=LAST_WORDS)
        while index not in self.ended and self.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        tail = self._tail(index)
        who = f"the process of rank {index}" if self.size > 1 else "the verdict process"
        if index in self.ended:
            how = how_it_ended(self.ended[index], self.limits)
        elif self.proc.poll() is not None:  # the first process is gone: its ranks die with it (PR_SET_PDEATHSIG)
            first = self.proc.returncode
            how = (f"was stopped because the first verdict process, its parent, "
                   + (f"was killed by {_signal_name(-first)}" if first < 0 else f"exited with code {first}")
                   + (" (the sandbox: " + self._tail(self.size).splitlines()[-1][:300] + ")"
                      if self._tail(self.size) else ""))
        else:
            how = "ended (how is unknown: the first verdict process did not report it)"
        return f"{who} {how} while {doing}" + (f"; its last output:\n{tail}" if tail else "")

    def _crowd(self) -> str:
        """ " (the sandbox held N processes …)" when the pool's processes number over half their limit (a fork
        bomb), else ""."""
        import psutil

        limit = self.limits.get("processes")
        try:
            count = len(psutil.Process(self.proc.pid).children(recursive=True))
        except psutil.Error:
            return ""
        if not limit or count < limit // 2:
            return ""
        return (f" (its sandbox held {count} processes, against a limit of {limit} processes and threads: a "
                "process that forks without end?)")

    def _all_waiting(self) -> float | None:
        """Whether every process of the pool waits (a deadlock, graded 0) rather than computes (out of time, judged
        again with a longer limit): the largest share of WAIT_SAMPLES state samples, over WAIT_WINDOW seconds, in
        which one process was running or runnable, if under WAITING_SHARE, else None. A runnable process counts as
        running even while a busy machine gives it no CPU, so the load does not make a loop look like a wait;
        a rank blocked in a collective wakes only now and then."""
        import psutil

        try:
            processes = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            return None
        running = dict.fromkeys(processes, 0)
        for _ in range(WAIT_SAMPLES):
            for process in processes:
                try:
                    running[process] += process.status() in (psutil.STATUS_RUNNING, psutil.STATUS_WAKING)
                except psutil.Error:
                    pass  # ended: it runs no more
            time.sleep(WAIT_WINDOW / WAIT_SAMPLES)
        share = max(running.values(), default=0) / WAIT_SAMPLES
        return share if processes and share < WAITING_SHARE else None

    def _replies(self, index):
        try:
            while (frame := wire.read_frame(self.results[index], MAX_REPLY)) is not None:
                self.events.put(("reply", index, frame))
        except (wire.WireError, OSError, ValueError) as error:
            self.events.put(("garbled", index, str(error)))
            return
        self.events.put(("exit", index, None))

    def _tail(self, index) -> str:
        text = self.tails[index].decode("utf-8", "replace").strip()
        return "\n".join(text.splitlines()[-8:])

    def _collect(self, ranks, deadline, doing, hang_hint=None) -> dict:
        """{rank: frame} once every rank in `ranks` replied; PoolFailure at the first hang or crash."""
        ranks, replies, raised_at = set(ranks), {}, None
        while ranks - replies.keys():
            limit = deadline if raised_at is None else min(deadline, raised_at + ERROR_GRACE)
            try:
                kind, index, data = self.events.get(timeout=max(0.0, limit - time.monotonic()))
            except queue.Empty:
                if raised_at is not None:  # some rank's code raised and the others wait for it
                    return replies
                waiting = sorted(ranks - replies.keys())
                seconds = max(STARTUP_TIMEOUT, self.task_timeout) if hang_hint else self.task_timeout
                if hang_hint:
                    raise PoolFailure(f"no result after {seconds:g} s while {doing}: {hang_hint}{self._crowd()}",
                                      True) from None
                share = self._all_waiting()
                head = f"no result after {self.task_timeout:g} s while {doing}"
                silent = f"rank(s) {', '.join(map(str, waiting))} never replied"
                if share is not None:  # every process waits: wrong on any machine, graded 0 whatever the load
                    looks = (f"the busiest process was running in {share:.0%} of {WAIT_SAMPLES} looks over "
                             f"{WAIT_WINDOW:g} s")
                    raise PoolFailure(f"{head}: a call that waits forever (nothing was computing: {looks})"
                                      if len(ranks) == 1 else
                                      f"{head}: a deadlock (every rank waiting for another: {looks}); {silent}") from None
                raise PoolFailure(f"{head}: still computing (an endless loop, or a machine too busy){self._crowd()}"
                                  if len(ranks) == 1 else
                                  f"{head}: the ranks were still computing (an endless loop, or a machine too busy); "
                                  f"{silent}{self._crowd()}", True) from None
            if kind == "reply" and index in ranks:
                replies[index] = data
                cases = data[0].get("cases")
                if raised_at is None and isinstance(cases, list) and any(
                        isinstance(c, dict) and "error" in c for c in cases):
                    raised_at = time.monotonic()
            elif kind == "garbled":
                raise PoolFailure(f"a process sent back something unreadable while {doing} ({data[:200]})")
            elif kind == "exit":
                raise PoolFailure(self._exit_message(index, doing))
        return replies

    # -------------------------------------------------------------- tasks

    @staticmethod
    def _write(stream, header, payload, close=False):
        """Write one frame without ever blocking the checker on a stuck process."""
        def write():
            try:
                wire.write_frame(stream, header, payload)
                if close:
                    stream.close()
            except (OSError, ValueError):
                pass  # it died: its reader reports that
        threading.Thread(target=write, daemon=True).start()

    def run(self, frames: dict, doing: str) -> dict:
        """Send frames[rank] = (header, payload) to those ranks; return {rank: reply frame}."""
        for index, (header, payload) in frames.items():
            self._write(self.commands[index], header, payload)
        return self._collect(frames, time.monotonic() + self.task_timeout, doing)

    def kill(self):
        """Kill the first process and every rank (with anything they started); close our pipe ends."""
        if self.proc is not None:  # the first process leads a session its ranks stay in (unless they leave it:
            # then they are its descendants, or, orphaned, the checker's, which kills all it has when it ends)
            kill_tree(self.proc.pid, self.proc.poll() is None, (self.proc.pid,), self.started)
            self.proc.wait()
        for stream in self.commands + self.results + self.outputs + [getattr(self, "status", None)]:
            try:
                if stream is not None:
                    stream.close()
            except OSError:
                pass
        self.proc = None
