"""A simulated network link per rank: communication takes α + bytes/bandwidth, so slow links show on a CPU.

On one machine, gloo moves bytes between processes through memory: far faster (and far noisier) than any
network between GPUs. `SimulatedLink` gives each rank a link with a latency α and a bandwidth you choose:

    link = SimulatedLink(alpha=1e-3, bandwidth=100e6)      # 1 ms per message, 100 MB/s (bytes per second)
    link.all_reduce(grad)                                   # real all-reduce + the ring's time on this link
    work = link.all_reduce(grad, async_op=True)             # returns at once; work.wait() blocks until done
    link.send(nbytes)                                       # occupy the link with one message (no data moved)
    print(link.measure_host_cost())                         # "host cost 0.05 ms (p90 0.08 ms) vs α 1 ms ..."
    link.close()                                            # finish what was issued, free the shared table

The rules:
- Each rank's link is one FIFO channel. A message of b bytes finishes no sooner than α + b/bandwidth after
  the previous message on that link finished (or after it was issued, if the link was idle). So two
  back-to-back 1 MiB messages take 2α + 2 MiB/bandwidth.
- An all-reduce of M bytes on N ranks is a ring: 2(N−1) messages of M/N bytes each, i.e.
  2(N−1)·α + 2(N−1)/N·M/bandwidth. It starts when the *last* rank has issued it (a collective cannot finish
  before every rank has contributed); the real `dist.all_reduce` runs too, so results are exact.
- The link's schedule is the rule's alone: `work.start` and `work.end` are when the simulated network carries
  the operation, and the next one queues behind `work.end`. A handle completes no sooner than `work.end`
  *and* no sooner than the real operation: the link only ever adds time to what the ranks wait. `work.done`
  records when the handle really completed; `work.done − work.end` is host time the simulator itself took on
  top of the network (the real gloo call, waking up from sleep on a busy CPU). Late host work does not move
  the network's schedule, as a real network does not wait for another operation's host bookkeeping.
- Waiting sleeps: a waiting rank burns no CPU, so 4 ranks on 2 cores can wait without slowing each other.

How it is cheap (the simulator must cost far less than the α it models; `benchmarks/bench_simlink.py`):
- No extra collective and no worker thread per operation. On its first all-reduce a link maps a small table
  in shared memory (one file under /dev/shm, removed again as soon as every rank has mapped it, so nothing
  is left behind even if a rank dies). Each rank writes its issue time of each all-reduce into its own
  column, then starts the real `dist.all_reduce` asynchronously and returns.
- The schedule is settled lazily, in issue order, when a handle is waited (or polled): once the real
  all-reduce is done every rank has issued it, so every issue time is in the table; the start is the latest
  of them (or the end of the previous operation), and `wait()` sleeps until the end.
- A handle's `get_future()` (what a DDP communication hook returns) is completed from the autograd engine's
  final callback, which runs on the backward thread before DDP's own final callback waits for its buckets:
  it sleeps until the last bucket's end and completes every future in order. Outside backward a helper
  thread completes it instead. (Not for DDP's static_graph=True, whose first step all-reduces from inside
  a final callback.) A future handed out during backward therefore completes at the end of backward, no
  sooner than its `end`: `done` records that, so for DDP's buckets only the last one's `done − end` is host
  cost.

The simulated start of a collective uses the ranks' issue times on `time.perf_counter()`, one clock shared by all
processes of one machine (as `utils.trace` does): the link is for single-machine runs, not for multi-node jobs.

From a DDP communication hook (lesson 04): `ddp.register_comm_hook(link, simlink.allreduce_hook)` averages
each gradient bucket through the link and returns the future DDP expects.
"""
from __future__ import annotations

import collections
import math
import mmap
import os
import re
import statistics
import tempfile
import threading
import time
from typing import NamedTuple

import torch
import torch.distributed as dist

__all__ = ["SimulatedLink", "SimWork", "HostCost", "ring_messages", "allreduce_hook"]

_SLOTS = 4096                      # all-reduces in flight a rank may be ahead of the slowest one
_PREFIX = "dpfs-simlink-"          # shared-memory file names: prefix, creator's pid, a counter
_made = 0


def ring_messages(nbytes: float, world_size: int) -> list:
    """The messages one rank sends in a ring all-reduce of `nbytes`: 2(N−1) of nbytes/N each (none for N = 1)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    return [nbytes / world_size] * (2 * (world_size - 1))


def _fine_sleep():
    # Linux lets a sleeping thread wake up to 50 µs late by default (timer slack): 5 % of a 1 ms α. Ask for 1 µs.
    try:
        import ctypes
        ctypes.CDLL(None).prctl(29, 1000, 0, 0, 0)        # PR_SET_TIMERSLACK, in nanoseconds
    except (OSError, AttributeError):
        pass                                              # not Linux: sleeps keep the system's precision


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
    completed (>= end, and >= the real operation); `issued`: when this rank issued it.
    """

    def __init__(self, link, index, issued, seconds, real=None, seq=None, result=None):
        self._link, self._index, self.issued, self._seconds = link, index, issued, seconds
        self._real, self._seq, self._result = real, seq, result
        self._real_done = None
        self._future = None
        self.start = self.end = self.done = None

    def wait(self) -> bool:
        self._link._wait(self)
        return True

    def is_completed(self) -> bool:
        return self._link._poll(self)

    def get_future(self) -> torch.futures.Future:
        return self._link._future_of(self)


class HostCost(NamedTuple):
    """How late handles complete beyond their modelled end (seconds), against the link's α."""
    median: float
    p90: float
    alpha: float
    samples: int

    def __str__(self):
        return (f"host cost {self.median * 1e3:.3g} ms (p90 {self.p90 * 1e3:.3g} ms) vs α {self.alpha * 1e3:.3g} ms "
                f"per message ({self.median / self.alpha:.2f} α)" if self.alpha > 0 else
                f"host cost {self.median * 1e3:.3g} ms (p90 {self.p90 * 1e3:.3g} ms), α 0")


class _IssueTable:
    """Shared memory: per rank, the issue time and sequence number of each all-reduce (slot = seq mod _SLOTS),
    and how far that rank has settled (so nobody overwrites a slot another rank has still to read)."""

    def __init__(self, group):
        global _made
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        size = 8 * self.world * (1 + 2 * _SLOTS)
        holder = [None]
        path = None
        if self.rank == 0:
            _made += 1
            folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
            _sweep(folder)
            path = os.path.join(folder, f"{_PREFIX}{os.getpid()}-{_made}-{os.urandom(4).hex()}")
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
                with _suppress(FileNotFoundError):
                    os.unlink(path)
        self._cells = memoryview(self._map).cast("d")      # [settled seq per rank] + [slot][rank][time, seq]

    def write(self, seq, issued):
        i = self.world + 2 * ((seq % _SLOTS) * self.world + self.rank)
        self._cells[i] = issued
        self._cells[i + 1] = seq                            # written last: the slot is complete

    def last_issue(self, seq):
        base = self.world + 2 * (seq % _SLOTS) * self.world
        cells = self._cells[base:base + 2 * self.world]
        if any(cells[2 * r + 1] != seq for r in range(self.world)):
            found = [int(cells[2 * r + 1]) for r in range(self.world)]
            raise RuntimeError(f"simulated link: all-reduce #{seq} finished but the ranks' issue table holds "
                               f"#{found}; every rank must call the link's all-reduces in the same order")
        return max(cells[0::2])

    def settled(self, seq):
        self._cells[self.rank] = seq + 1                    # how many all-reduces this rank has settled

    def slowest_settled(self):
        return min(self._cells[:self.world])

    def close(self):
        self._cells.release()
        self._map.close()


class _suppress:
    def __init__(self, *kinds):
        self.kinds = kinds

    def __enter__(self):
        return self

    def __exit__(self, kind, *_):
        return kind is not None and issubclass(kind, self.kinds)


def _sweep(folder):
    # remove tables a killed process left between creating and unlinking them (a window of milliseconds)
    for name in os.listdir(folder):
        match = re.fullmatch(re.escape(_PREFIX) + r"(\d+)-.*", name)
        if match:
            try:
                os.kill(int(match.group(1)), 0)
            except ProcessLookupError:
                with _suppress(OSError):
                    os.unlink(os.path.join(folder, name))
            except OSError:
                pass


class SimulatedLink:
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
        self._seq = 0                             # all-reduces issued (their slot in the shared table)
        self._table = None
        self._unsettled = collections.deque()     # issued, not yet given start and end, in issue order
        self._open = collections.deque()          # settled, not yet completed, in issue order
        self._lock = threading.RLock()
        self._backward_target = None              # the last work whose future completes at the end of backward
        self._later = collections.deque()         # works whose future the helper thread completes
        self._helper = None
        self._helper_wake = threading.Condition(self._lock)
        self._closed = False
        _fine_sleep()                             # this thread sleeps in wait()

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
        """`dist.all_reduce(tensor, op)` for real, taking at least the ring's time on this link.

        Every rank of the group must call it (it is a collective). Returns None, or a SimWork if async_op.
        """
        issued = time.perf_counter()
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"all_reduce needs a torch.Tensor, got {type(tensor).__name__}")
        if not dist.is_initialized():
            raise RuntimeError("SimulatedLink.all_reduce needs torch.distributed initialised: call it inside a "
                               "function run by utils.launch(...)")
        if self._closed:
            raise RuntimeError("this SimulatedLink is closed: make a new one")
        if self._table is None:
            self._table = _IssueTable(self.group)
            issued = time.perf_counter()          # the table's one-time setup is no part of the operation
        table = self._table
        nbytes = tensor.numel() * tensor.element_size()
        seconds = sum(map(self.message_seconds, ring_messages(nbytes, table.world)))
        seq = self._seq
        if seq >= _SLOTS:
            self._wait_for_slot(seq)
        table.write(seq, issued)
        real = dist.all_reduce(tensor, op=op, group=self.group, async_op=True)
        self._seq += 1
        return self._finish(self._issue(issued, seconds, real, seq, tensor), async_op)

    def close(self) -> None:
        """Finish what was issued, then free the link's shared table (and stop its helper thread, if any)."""
        if self._closed:
            return
        last = self._unsettled[-1] if self._unsettled else self._open[-1] if self._open else None
        if last is not None:
            self._wait(last)
        with self._lock:
            self._closed = True
            self._helper_wake.notify_all()
        if self._helper is not None:
            self._helper.join()
        if self._table is not None:
            self._table.close()
            self._table = None

    def measure_host_cost(self, repeats: int = 21, nbytes: int = 256, compute=None) -> HostCost:
        """Median and 90th percentile of how late a `nbytes` all-reduce's handle completes beyond its modelled
        end, at this link's current α and bandwidth: every rank of the group must call it (it all-reduces).

        `compute()`, if given, runs between issue and wait (keep it shorter than the operation). Samples are
        every rank's handles; the result is the same on every rank.
        """
        if repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {repeats}")
        probe, late = torch.zeros(max(1, nbytes // 4)), []
        for _ in range(repeats):
            dist.barrier(group=self.group)
            work = self.all_reduce(probe, async_op=True)
            if compute is not None:
                compute()
            work.wait()
            late.append(work.done - work.end)
        mine = torch.tensor(late, dtype=torch.float64)
        everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(everyone, mine, group=self.group)
        xs = sorted(torch.cat(everyone).tolist())
        return HostCost(statistics.median(xs), xs[min(len(xs) - 1, int(0.9 * len(xs)))], self.alpha, len(xs))

    # ------------------------------------------------------------------ machinery
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
        # the slot this all-reduce writes was last used _SLOTS all-reduces ago: every rank must have read it
        while self._table.slowest_settled() <= seq - _SLOTS:
            head = self._unsettled[0] if self._unsettled else None
            if head is not None and head._seq is not None and head._seq <= seq - _SLOTS:
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
                    begin = head.issued
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
                w.done = now if w is work else min(now, max(w.end, w._real_done or w.end))
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

    def _future_of(self, work):
        with self._lock:
            if work._future is not None:
                return work._future
            work._future = torch.futures.Future()
            if work.done is not None:
                work._future.set_result(work._result)
                return work._future
            try:                                             # one callback per future: cheap, and robust
                torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            except RuntimeError:                             # not inside backward: the helper thread does it
                self._later.append(work)
                self._start_helper()
                return work._future
            self._backward_target = work                     # (to a backward that failed before its callbacks)
            return work._future

    def _end_of_backward(self):
        # the autograd engine's final callback, on the backward thread: sleep until the last future's end
        with self._lock:
            target, self._backward_target = self._backward_target, None
        if target is not None:                               # the first callback does it; the others find None
            self._wait(target)

    def _start_helper(self):
        if self._helper is None:
            self._helper = threading.Thread(target=self._help, name="simulated-link-futures", daemon=True)
            self._helper.start()
        self._helper_wake.notify()

    def _help(self):
        _fine_sleep()
        while True:
            with self._lock:
                while not self._later and not self._closed:
                    self._helper_wake.wait()
                if not self._later:
                    return
                work = self._later.popleft()
            try:
                self._wait(work)
            except Exception as exc:                          # hand the failure to whoever waits
                if not work._future.done():
                    work._future.set_exception(exc)


def allreduce_hook(link: SimulatedLink, bucket):
    """DDP communication hook: average the bucket's gradients through `link`; returns a Future of the tensor.

    (No return annotation: DDP checks it must be the real Future[Tensor] type, not a postponed string.)

        ddp_model.register_comm_hook(link, allreduce_hook)
    """
    tensor = bucket.buffer()
    tensor.div_(dist.get_world_size(link.group))
    return link.all_reduce(tensor, async_op=True).get_future()
