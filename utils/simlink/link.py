"""The simulated link itself: one FIFO channel per rank, its operations, and when each one starts and ends.

The rules are in the package's docstring (`utils.simlink`). This module holds the schedule: operations are
issued (`send`, `all_reduce`, `all_gather`), settled lazily in issue order (a collective's start is the last
rank's issue time, read from the shared issue table of `utils.simlink.table`, or the end of the previous
operation), and completed when waited or polled. Futures for DDP hooks: `utils.simlink.futures`.
"""
from __future__ import annotations

import collections
import math
import statistics
import threading
import time
from typing import NamedTuple

import torch
import torch.distributed as dist

from .. import compat
from ..devices import device
from . import table as _table
from .futures import FutureCompletion, fine_sleep

__all__ = ["SimulatedLink", "SimWork", "HostCost", "ring_messages", "all_gather_messages", "rank_quantile"]


def ring_messages(nbytes: float, world_size: int) -> list:
    """The messages one rank sends in a ring all-reduce of `nbytes`: 2(N−1) of nbytes/N each (none for N = 1)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    return [nbytes / world_size] * (2 * (world_size - 1))


def all_gather_messages(shard_bytes: float, world_size: int) -> list:
    """The messages one rank sends in a ring all-gather of `shard_bytes` per rank: N−1 of shard_bytes each."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    return [shard_bytes] * (world_size - 1)


def _check_settings(alpha, bandwidth):
    for name, value in (("alpha", alpha), ("bandwidth", bandwidth)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name} must be a number (seconds, bytes per second), got {value!r}")
    if not (0 <= alpha < math.inf) or not (0 < bandwidth <= math.inf):
        raise ValueError(f"need 0 <= alpha < inf seconds and bandwidth > 0 bytes/s, "
                         f"got alpha={alpha}, bandwidth={bandwidth}")


class SimWork:
    """Handle of one operation on a link: `wait()` blocks (sleeping) until it is done; `get_future()` for hooks.

    `start`, `end`: when the simulated network carries it (None until settled); `done`: when the handle
    completed (>= end, and >= the real operation); `issued`: when this rank issued it; `real_done`: when this
    rank saw the real operation complete.
    """

    def __init__(self, link, index, issued, seconds, real=None, seq=None, result=None):
        self._link, self._index, self.issued, self._seconds = link, index, issued, seconds
        self._real, self._seq, self._result = real, seq, result
        self._real_done = None
        self._future = None
        self.start = self.end = self.done = None

    @property
    def real_done(self):
        """When this rank saw the real operation complete (None until settled; `issued` for a plain message)."""
        return self._real_done

    def wait(self) -> bool:
        self._link._wait(self)
        return True

    def is_completed(self) -> bool:
        return self._link._poll(self)

    def get_future(self) -> torch.futures.Future:
        return self._link._future_of(self)


def rank_quantile(xs, q: float) -> float:
    """The q-quantile as HostCost takes it: the value at rank ⌊q·n⌋ of the n sorted samples (no interpolation)."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


class HostCost(NamedTuple):
    """How late handles complete beyond their modelled end (seconds), against the link's α: the median, the
    75th and the 90th percentile of `samples` handles."""
    median: float
    p75: float
    p90: float
    alpha: float
    samples: int

    def __str__(self):
        ratio = f" = {self.median / self.alpha:.2f} α" if self.alpha > 0 else ""
        return (f"host cost {self.median * 1e3:.3g} ms vs α {self.alpha * 1e3:.3g} ms per message{ratio} "
                f"(median of {self.samples} handles; p75 {self.p75 * 1e3:.3g} ms, p90 {self.p90 * 1e3:.3g} ms)")


class SimulatedLink(FutureCompletion):
    """This rank's link: latency `alpha` seconds per message, `bandwidth` bytes per second.

    Change `alpha` and `bandwidth` between operations if you like: each operation is charged with the values
    current when it is issued. `busy_until` is when the link finishes everything settled so far (operations
    are settled, in issue order, when a handle is waited or polled).
    """

    def __init__(self, alpha: float, bandwidth: float, group=None):
        _check_settings(alpha, bandwidth)
        self.alpha, self.bandwidth, self.group = float(alpha), float(bandwidth), group
        self.busy_until = 0.0
        self._issued = 0                          # operations issued on this link
        self._seq = 0                             # collectives issued (their slot in the shared table)
        self._table = None
        self._unsettled = collections.deque()     # issued, not yet given start and end, in issue order
        self._open = collections.deque()          # settled, not yet completed, in issue order
        self._lock = threading.RLock()
        self._closed = False
        self._init_futures()
        fine_sleep()                             # this thread sleeps in wait()

    # ------------------------------------------------------------------ costs
    def message_seconds(self, nbytes: float) -> float:
        """Time one message of `nbytes` occupies the link: α + nbytes / bandwidth."""
        return self.alpha + nbytes / self.bandwidth

    # ------------------------------------------------------------------ operations
    def send(self, nbytes: float, async_op: bool = False):
        """Occupy the link with one message of `nbytes` (no data moves; pair it with real sends if needed)."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, (int, float)) or not 0 <= nbytes < math.inf:
            raise ValueError(f"send(nbytes): need a number of bytes >= 0, got {nbytes!r}")
        work = self._issue(time.perf_counter(), self.message_seconds(nbytes))
        return self._finish(work, async_op)

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM, async_op: bool = False):
        """`dist.all_reduce(tensor, op)` for real, taking at least the ring's time on this link:
        2(N−1) messages of M/N bytes, 2(N−1)·α + 2(N−1)/N·M/bandwidth.

        Every rank of the group must call it (it is a collective). Returns None, or a SimWork if async_op.
        """
        issued = time.perf_counter()
        self._check_tensor("all_reduce", tensor)
        issued = self._ensure_table(issued)
        nbytes = tensor.numel() * tensor.element_size()
        seconds = sum(map(self.message_seconds, ring_messages(nbytes, self._table.world)))
        return self._collective(issued, seconds, async_op, tensor,
                                lambda: dist.all_reduce(tensor, op=op, group=self.group, async_op=True))

    def all_gather(self, output: torch.Tensor, shard: torch.Tensor, async_op: bool = False):
        """All-gather for real (`output` = every rank's `shard`, in rank order, as `all_gather_into_tensor`),
        taking at least the ring's time on this link: N−1 messages of the shard's bytes,
        (N−1)·α + (N−1)·shard_bytes/bandwidth.

        Every rank of the group must call it (it is a collective): like an all-reduce it starts when the last
        rank has issued it, so a rank that issues early waits for the late one. Returns None, or a SimWork if
        async_op.
        """
        issued = time.perf_counter()
        self._check_tensor("all_gather", shard)
        self._check_tensor("all_gather", output)
        issued = self._ensure_table(issued)
        world = self._table.world
        if output.numel() != world * shard.numel() or output.dtype != shard.dtype:
            raise ValueError(f"all_gather: output must hold {world} × the shard's {shard.numel()} elements of "
                             f"{shard.dtype}, got {output.numel()} of {output.dtype}")
        nbytes = shard.numel() * shard.element_size()
        seconds = sum(map(self.message_seconds, all_gather_messages(nbytes, world)))
        return self._collective(issued, seconds, async_op, output,
                                lambda: compat.all_gather_single(output, shard, group=self.group, async_op=True))

    def close(self) -> None:
        """Finish what was issued, then free the link's shared table (and stop its helper thread, if any)."""
        if self._closed:
            return
        last = self._unsettled[-1] if self._unsettled else self._open[-1] if self._open else None
        if last is not None:
            self._wait(last)
        with self._lock:
            self._closed = True
        self._stop_helper()
        if self._table is not None:
            self._table.close()
            self._table = None

    def measure_host_cost(self, repeats: int = 21, nbytes: int = 256, compute=None) -> HostCost:
        """Median, 75th and 90th percentile of how late a `nbytes` all-reduce's handle completes beyond its
        modelled end, at this link's current α and bandwidth: every rank of the group must call it (it all-reduces).

        `compute()`, if given, runs between issue and wait (keep it shorter than the operation). Samples are
        every rank's handles; the result is the same on every rank.
        """
        if repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {repeats}")
        probe, late = torch.zeros(max(1, nbytes // 4), device=device()), []
        for _ in range(repeats):
            dist.barrier(group=self.group)
            work = self.all_reduce(probe, async_op=True)
            if compute is not None:
                compute()
            work.wait()
            late.append(work.done - work.end)
        mine = torch.tensor(late, dtype=torch.float64, device=device())
        everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(everyone, mine, group=self.group)
        xs = torch.cat(everyone).tolist()
        return HostCost(statistics.median(xs), rank_quantile(xs, 0.75), rank_quantile(xs, 0.9), self.alpha, len(xs))

    # ------------------------------------------------------------------ machinery
    def _check_tensor(self, name, tensor):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} needs a torch.Tensor, got {type(tensor).__name__}")
        if not dist.is_initialized():
            raise RuntimeError(f"SimulatedLink.{name} needs torch.distributed initialised: call it inside a "
                               "function run by utils.launch(...)")
        if self._closed:
            raise RuntimeError("this SimulatedLink is closed: make a new one")

    def _ensure_table(self, issued):
        if self._table is None:
            self._table = _table.IssueTable(self.group)
            return time.perf_counter()            # the table's one-time setup is no part of the operation
        return issued

    def _collective(self, issued, seconds, async_op, result, start_real):
        # record this rank's issue time in the shared table, start the real collective, queue it on the link
        seq = self._seq
        if seq >= self._table.slots:
            self._wait_for_slot(seq)
        self._table.write(seq, issued)
        real = start_real()
        self._seq += 1
        return self._finish(self._issue(issued, seconds, real, seq, result), async_op)

    def _issue(self, issued, seconds, real=None, seq=None, result=None):
        if self._closed:
            raise RuntimeError("this SimulatedLink is closed: make a new one")
        _check_settings(self.alpha, self.bandwidth)        # they may have been changed since construction
        work = SimWork(self, self._issued, issued, seconds, real, seq, result)
        self._issued += 1
        with self._lock:
            self._unsettled.append(work)
            self._settle(work, block=False)                 # what can be settled now costs no wait later
        return work

    def _finish(self, work, async_op):
        if async_op:
            return work
        self._wait(work)
        return None

    def _wait_for_slot(self, seq):
        # the slot this collective writes was last used `slots` collectives ago: every rank must have read it
        slots = self._table.slots
        while self._table.slowest_settled() <= seq - slots:
            head = self._unsettled[0] if self._unsettled else None
            if head is not None and head._seq is not None and head._seq <= seq - slots:
                self._settle(head, block=True)
            else:
                time.sleep(1e-4)

    def _settle(self, work, block):
        """Give start and end to every operation up to `work`, in issue order. False if one is not ready."""
        with self._lock:
            while work.end is None:
                head = self._unsettled[0]
                if head._real is not None:
                    if not head._real.is_completed():
                        if not block:
                            return False
                        self._lock.release()                # others may issue or poll meanwhile
                        try:
                            head._real.wait()
                        finally:
                            self._lock.acquire()
                        continue                            # the head may have been settled meanwhile
                    head._real.wait()                       # done (raises if it failed): every rank has issued
                    head._real_done = time.perf_counter()   # it, so its issue time is in the table
                    begin = self._table.last_issue(head._seq)
                    self._table.settled(head._seq)
                else:
                    begin = head._real_done = head.issued            # nothing real to wait for
                head.start = max(begin, self.busy_until)
                head.end = self.busy_until = head.start + head._seconds
                self._unsettled.popleft()
                self._open.append(head)
            return True

    def _complete_through(self, work, now):
        # work is complete at `now`, and so is everything issued before it (FIFO, real operations done)
        with self._lock:
            while self._open and self._open[0]._index <= work._index:
                w = self._open.popleft()
                # a future completes now; a plain handle was complete (polling would have said so) since then
                w.done = now if w is work or w._future is not None else min(now, max(w.end, w._real_done))
                if w._future is not None and not w._future.done():
                    w._future.set_result(w._result)

    def _wait(self, work):
        if work.done is not None:
            return
        self._settle(work, block=True)
        delay = work.end - time.perf_counter()
        if delay > 0:
            time.sleep(delay)                                # waiting burns no CPU
        self._complete_through(work, time.perf_counter())

    def _poll(self, work):
        if work.done is not None:
            return True
        if not self._settle(work, block=False):
            return False
        now = time.perf_counter()
        if now < work.end:
            return False
        self._complete_through(work, now)
        return True

