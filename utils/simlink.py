"""A simulated network link per rank: communication takes α + bytes/bandwidth, so slow links show on a CPU.

On one machine, gloo moves bytes between processes through memory: far faster (and far noisier) than any
network between GPUs. `SimulatedLink` gives each rank a link with a latency α and a bandwidth you choose:

    link = SimulatedLink(alpha=1e-3, bandwidth=100e6)      # 1 ms per message, 100 MB/s (bytes per second)
    link.all_reduce(grad)                                   # real all-reduce + the ring's time on this link
    work = link.all_reduce(grad, async_op=True)             # returns at once; work.wait() blocks until done
    link.send(nbytes)                                       # occupy the link with one message (no data moved)
    link.close()                                            # stop the link's worker thread

The rules:
- Each rank's link is one FIFO channel. A message of b bytes finishes no sooner than α + b/bandwidth after
  the previous message on that link finished (or after it was issued, if the link was idle). So two
  back-to-back 1 MiB messages take 2α + 2 MiB/bandwidth.
- An all-reduce of M bytes on N ranks is a ring: 2(N−1) messages of M/N bytes each, i.e.
  2(N−1)·α + 2(N−1)/N·M/bandwidth. It starts when the *last* rank has issued it (a collective cannot finish
  before every rank has contributed); the real `dist.all_reduce` runs too, so results are exact.
- The link's schedule is the rule's alone: `work.start` and `work.end` are when the simulated network carries
  the operation, and the next one queues behind `work.end`. A handle completes (`wait()` returns) no sooner
  than `work.end` *and* no sooner than the real operation: the link only ever adds time to what the ranks
  wait. `work.done` records when the handle really completed; `work.done − work.end` is host time the
  simulator itself took on top of the network (the real gloo call and this link's thread, which on a busy
  CPU run late). Late host work does not move the network's schedule, as a real network does not wait for
  another operation's host bookkeeping: it shows in what the ranks wait, not in the link's record.
- Waiting sleeps (a worker thread per link sleeps until each operation's finish time): a waiting rank burns
  no CPU, so 4 ranks on 2 cores can wait on their links without slowing each other's compute.

The simulated start of a collective uses the ranks' issue times on `time.perf_counter()`, one clock shared by all
processes of one machine (as `utils.trace` does): the link is for single-machine runs, not for multi-node jobs.

From a DDP communication hook (lesson 04): `ddp.register_comm_hook(link, simlink.allreduce_hook)` averages
each gradient bucket through the link and returns the future DDP expects.
"""
from __future__ import annotations

import queue
import threading
import time

import torch
import torch.distributed as dist

__all__ = ["SimulatedLink", "SimWork", "ring_messages", "allreduce_hook"]


def ring_messages(nbytes: float, world_size: int) -> list:
    """The messages one rank sends in a ring all-reduce of `nbytes`: 2(N−1) of nbytes/N each (none for N = 1)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    return [nbytes / world_size] * (2 * (world_size - 1))


class SimWork:
    """Handle of one operation on a link: `wait()` blocks (sleeping) until it is done; `get_future()` for hooks."""

    def __init__(self, future: torch.futures.Future):
        self._future = future
        self.start = self.end = None            # when the simulated network carries the operation
        self.done = None                        # when the handle completed: >= end, and >= the real operation

    def wait(self) -> bool:
        self._future.wait()
        return True

    def is_completed(self) -> bool:
        return self._future.done()

    def get_future(self) -> torch.futures.Future:
        return self._future


class SimulatedLink:
    """This rank's link: latency `alpha` seconds per message, `bandwidth` bytes per second.

    Change `alpha` and `bandwidth` between operations if you like: each operation is charged with the values
    current when it is issued. `busy_until` is when the link finishes everything issued so far (known once
    those operations have started).
    """

    def __init__(self, alpha: float, bandwidth: float, group=None):
        if alpha < 0 or bandwidth <= 0:
            raise ValueError(f"need alpha >= 0 and bandwidth > 0, got alpha={alpha}, bandwidth={bandwidth}")
        self.alpha, self.bandwidth, self.group = float(alpha), float(bandwidth), group
        self.busy_until = 0.0
        self._queue: queue.Queue = queue.Queue()
        self._worker = threading.Thread(target=self._run, name="simulated-link", daemon=True)
        self._worker.start()

    # ------------------------------------------------------------------ costs
    def message_seconds(self, nbytes: float) -> float:
        """Time one message of `nbytes` occupies the link: α + nbytes / bandwidth."""
        return self.alpha + nbytes / self.bandwidth

    # ------------------------------------------------------------------ operations
    def send(self, nbytes: float, async_op: bool = False):
        """Occupy the link with one message of `nbytes` (no data moves; pair it with real sends if needed)."""
        return self._submit(None, [nbytes], None, async_op)

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM, async_op: bool = False):
        """`dist.all_reduce(tensor, op)` for real, taking at least the ring's time on this link.

        Every rank of the group must call it (it is a collective). Returns None, or a SimWork if async_op.
        """
        world = dist.get_world_size(self.group)
        nbytes = tensor.numel() * tensor.element_size()
        issued = torch.tensor([time.perf_counter()], dtype=torch.float64)
        clock_work = dist.all_reduce(issued, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        data_work = dist.all_reduce(tensor, op=op, group=self.group, async_op=True)
        return self._submit((clock_work, issued, data_work), ring_messages(nbytes, world), tensor, async_op)

    def close(self) -> None:
        """Finish what was issued, then stop the worker thread."""
        self._queue.put(None)
        self._worker.join()

    # ------------------------------------------------------------------ machinery
    def _submit(self, real, messages, result, async_op):
        future = torch.futures.Future()
        work = SimWork(future)
        costs = [self.message_seconds(b) for b in messages]
        self._queue.put((time.perf_counter(), real, costs, result, future, work))
        if async_op:
            return work
        work.wait()
        return None

    def _run(self):
        # One operation at a time, in issue order: that is what makes the link a FIFO channel.
        while (item := self._queue.get()) is not None:
            issued, real, costs, result, future, work = item
            try:
                if real is not None:                      # a collective: starts when the last rank issued it
                    clock_work, last_issue, data_work = real
                    clock_work.wait()
                    issued = last_issue.item()
                work.start = max(issued, self.busy_until)
                work.end = self.busy_until = work.start + sum(costs)
                if real is not None:
                    data_work.wait()                      # the exact result: done no sooner than the real call
                delay = work.end - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)                     # waiting burns no CPU
                work.done = time.perf_counter()           # later than work.end when the host ran late
                future.set_result(result)
            except Exception as exc:                      # hand the failure to whoever waits
                future.set_exception(exc)


def allreduce_hook(link: SimulatedLink, bucket):
    """DDP communication hook: average the bucket's gradients through `link`; returns a Future of the tensor.

    (No return annotation: DDP checks it must be the real Future[Tensor] type, not a postponed string.)

        ddp_model.register_comm_hook(link, allreduce_hook)
    """
    tensor = bucket.buffer()
    tensor.div_(dist.get_world_size(link.group))
    return link.all_reduce(tensor, async_op=True).get_future()
