"""What a launch says when ranks fail or hang: the root cause first, stacks of the stuck, stopped ranks named.

`FailureReports` is a part of the launcher (utils/launching.py's `_Launch`, and the pool that extends it): after
a first failure it waits for the rank that caused it; on a timeout it collects every live rank's Python stack
(faulthandler writes it on SIGUSR1) and names ranks whose process is stopped, which cannot answer; it builds
the error to raise, blaming the root cause and dropping the peer-loss complaints of the ranks stopped because
of it.
"""
from __future__ import annotations

import os
import signal
import time

from .reports import format_frames, parse_faulthandler, stopped_reason

_PEER_LOSS = ("Connection closed by peer", "Connection reset", "Broken pipe", "ECONNRESET",
              "Socket closed", "Connection refused")  # how gloo says "another rank went away"


class LaunchError(RuntimeError):
    """A rank failed. The message names the rank, what went wrong and where."""


class LaunchTimeout(LaunchError):
    """No result by the deadline: most often a hang. The message shows every rank's stack."""


class FailureReports:
    """The launcher's failure and hang reports (mixed into `_Launch`; it provides procs, failures, lines, _drain)."""

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
        """Timeout: ask every live rank for its Python stack (faulthandler on SIGUSR1), and name a stopped one.

        A stopped process (SIGSTOP, a debugger) cannot run its signal handler: its state in /proc says so at
        once, so the report names it instead of waiting for a stack it cannot write.
        """
        stuck = [r for r in range(self.world_size) if self.procs[r].is_alive()]
        self._note_stopped(stuck)
        answering = [r for r in stuck if r not in self.stopped]
        for rank in answering:
            try:
                os.kill(self.procs[rank].pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
        self._wait_for_stack_files(answering)
        stacks = {r: self._read_stack_file(r) or "  (no stack: the rank did not answer)" for r in answering}
        finished = sorted(set(range(self.world_size)) - set(stuck))
        lines = [f"launch timed out after {self.timeout:g} s: {len(stuck)} of {self.world_size} ranks still "
                 "running. " + ("A rank is stopped:" if self.stopped else
                                "Likely a hang: a rank skipped or reordered a collective, or sends and receives "
                                "wait on each other (deadlock).")]
        if self.stopped:
            lines.append(self._stopped_lines())
        if finished:
            lines.append("Ranks that had finished: " + ", ".join(map(str, finished)))
        if answering:
            lines.append("Where each rank is stuck (most recent call last):")
        for rank in answering:
            lines.append(f"rank {rank}:\n{stacks[rank]}")
        self.timeout_report = "\n".join(lines)

    def _note_stopped(self, ranks):
        """Remember which of `ranks` are stopped processes: their pid and why (utils/reports.py reads /proc)."""
        self.stopped = {}
        for rank in ranks:
            pid = self.procs[rank].pid
            reason = stopped_reason(pid)
            if reason:
                self.stopped[rank] = (pid, reason)

    def _stopped_lines(self):
        """A line per stopped rank: it did not fail, it does not run; then how to resume it."""
        return "\n".join(
            f"rank {rank} is {reason}: alive, so nothing reports a death, but it cannot run: its peers wait for "
            f"it in their next collective, and it cannot answer for its stack.\n  (its pid is {pid}: "
            f"`kill -CONT {pid}` resumes it)" for rank, (pid, reason) in sorted(self.stopped.items()))

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
        generation = getattr(self, "generation_of", {}).get(rank, 0)   # a replaced rank's process writes anew
        return os.path.join(self.tmp.name, f"stack-{rank}.txt" if not generation else f"stack-{rank}.g{generation}.txt")

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

    def _take_stderr(self, ranks, last=20):
        parts = []
        for rank in ranks:
            lines, self.lines[rank][2] = self.lines[rank][2][-last:], []
            if lines:
                parts.append(f"\nstderr of rank {rank} (last {len(lines)} lines):\n" +
                             "\n".join("  " + line for line in lines))
        return "".join(parts)

    def _error(self):
        """The exception to raise, and the ranks it blames (their stderr goes into the report)."""
        if self.timeout_report and not self.failures:
            return LaunchTimeout(self.timeout_report), list(range(self.world_size))
        if getattr(self, "stopped", None):
            # Stopped ranks caused the others' errors (their group's timeout ran out waiting for them).
            lines = [self._stopped_lines()]
            for rank in sorted(self.failures):
                first_line = self.failures[rank].splitlines()[0]
                first_line = first_line.split(" failed with ", 1)[-1]
                lines.append(f"rank {rank} failed while it waited: " +
                             (first_line[:157] + "..." if len(first_line) > 160 else first_line))
            return LaunchError("\n".join(lines)), sorted(self.stopped)
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

    def _stacks(self, ranks):
        """Every listed rank's Python stack now (faulthandler on SIGUSR1), for a pool's hang report.

        A stopped rank cannot answer: it is named by its process state instead of waited for.
        """
        stopped = {r: stopped_reason(self.pids[r]) for r in ranks}
        stopped = {r: why for r, why in stopped.items() if why}
        ranks = [r for r in ranks if r not in stopped]
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
        lines = [f"rank {r} is {why}: it cannot run, so it cannot answer for its stack, and its peers wait for it "
                 f"(`kill -CONT {self.pids[r]}` resumes it)." for r, why in sorted(stopped.items())]
        lines.append("Where each rank is stuck (most recent call last):")
        for rank in ranks:
            try:
                with open(self._stack_path(rank), errors="replace") as f:
                    f.seek(before[rank])
                    text = f.read()
            except OSError:
                text = ""
            frames = [[f for f in thread if "utils/pool" not in f[0]] for thread in parse_faulthandler(text)]
            stacks = [format_frames(thread, self.source_files) for thread in frames]
            body = "\n  --- another thread ---\n".join(s for s in stacks if s)
            lines.append(f"rank {rank}:\n{body or '  (no stack: the rank did not answer)'}")
        return "\n".join(lines)
