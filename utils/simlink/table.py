"""The simulated link's issue table: when each rank issued each collective, in shared memory.

A collective on the simulated link cannot start before the *last* rank has issued it. Each rank writes its issue
time of collective #seq into its own column of a small table that every process of the group maps (one file under
/dev/shm, removed as soon as every rank has mapped it, so nothing is left behind even if a rank dies). Once the
real collective is done, every rank has issued it, so every issue time is in the table: `last_issue(seq)` is the
latest. The table has `SLOTS` rows, reused in turn (slot = seq mod SLOTS); each rank records how many collectives
it has settled, so nobody overwrites a slot another rank has still to read.
"""
from __future__ import annotations

import contextlib
import mmap
import os
import re
import tempfile

import torch.distributed as dist

SLOTS = 4096                       # collectives in flight a rank may be ahead of the slowest one
PREFIX = "dpfs-simlink-"           # shared-memory file names: prefix, creator's pid, a counter, random
_made = 0


class IssueTable:
    """Shared memory: per rank, the issue time and sequence number of each collective (slot = seq mod slots),
    and how far that rank has settled. Built collectively: every rank of `group` must construct it."""

    def __init__(self, group, slots: int = None):
        global _made
        self.slots = SLOTS if slots is None else slots
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        size = 8 * self.world * (1 + 2 * self.slots)
        holder = [None]
        path = None
        if self.rank == 0:
            _made += 1
            folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
            sweep(folder)
            path = os.path.join(folder, f"{PREFIX}{os.getpid()}-{_made}-{os.urandom(4).hex()}")
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            os.ftruncate(fd, size)
            os.close(fd)
            holder = [path]
        try:
            src = 0 if group is None else dist.get_global_rank(group, 0)
            dist.broadcast_object_list(holder, src=src, group=group)
            fd = os.open(holder[0], os.O_RDWR)
            try:
                self._map = mmap.mmap(fd, size)
            finally:
                os.close(fd)
            dist.barrier(group=group)           # everyone has it mapped: the name can go
        finally:
            if path is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
        self._cells = memoryview(self._map).cast("d")      # [settled seq per rank] + [slot][rank][time, seq]

    def write(self, seq, issued):
        """Record this rank's issue time of collective #seq."""
        i = self.world + 2 * ((seq % self.slots) * self.world + self.rank)
        self._cells[i] = issued
        self._cells[i + 1] = seq                            # written last: the slot is complete

    def last_issue(self, seq, what="collective"):
        """The latest rank's issue time of collective #seq (call it once the real collective is done)."""
        base = self.world + 2 * (seq % self.slots) * self.world
        cells = self._cells[base:base + 2 * self.world]
        if any(cells[2 * r + 1] != seq for r in range(self.world)):
            found = [int(cells[2 * r + 1]) for r in range(self.world)]
            raise RuntimeError(f"simulated link: {what} #{seq} finished but the ranks' issue table holds "
                               f"#{found}; every rank must call the link's collectives in the same order")
        return max(cells[0::2])

    def settled(self, seq):
        """This rank has read collective #seq's row: its slot may be reused."""
        self._cells[self.rank] = seq + 1

    def slowest_settled(self):
        """How many collectives the slowest rank has settled."""
        return min(self._cells[:self.world])

    def close(self):
        self._cells.release()
        self._map.close()


def sweep(folder):
    """Remove tables a killed process left between creating and unlinking them (a window of milliseconds)."""
    for name in os.listdir(folder):
        match = re.fullmatch(re.escape(PREFIX) + r"(\d+)-.*", name)
        if match:
            try:
                os.kill(int(match.group(1)), 0)
            except ProcessLookupError:
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(folder, name))
            except OSError:
                pass
