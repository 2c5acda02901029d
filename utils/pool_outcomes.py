"""How a cell on a pool ends, seen from the notebook (mixed into `Pool`, utils/pool.py).

The pool waits for every rank's reply to a cell, then decides: keep the pool (every rank finished, or an
exception on some ranks while the others finished within the grace) or restart it (a rank died, hung, was
interrupted inside a collective, or ran a different number of collectives than its peers), and says which.
The stop button's SIGINT to every busy rank is judged the same way.
"""
from __future__ import annotations

import os
import signal
import sys
import time

from .launching import LaunchError, LaunchTimeout
from .pool_rank import _ranks_text

_RESTARTED = ("The pool was restarted: {n} fresh ranks with the process group initialised. Every rank's "
              "variables were lost; run the cells that build them again.")


class CellOutcomes:
    """Waiting for a cell and judging its end (mixed into `Pool`, which provides the selector, `_handle`, `restart`
    and launch's reports)."""

    def _reset_cell(self):
        """Forget the previous cell's results, failures, replies and marks."""
        self.results, self.failures, self.replies, self.notes = {}, {}, {}, {}
        self.marks, self.exited, self.broken, self.timeout_report = set(), set(), {}, ""
        self.stopped = {}

    def _cell_done(self, ranks):
        """Whether every rank of `ranks` replied and flushed its stdout and stderr."""
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
        """Handle events for `seconds` more (the output and replies of ranks still alive)."""
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
