"""Futures of the simulated link's handles, for DDP communication hooks, and the hook itself.

A DDP communication hook returns a `torch.futures.Future`; DDP waits for it at the end of backward. A future of
a link's handle must not complete before the handle's modelled `end`, yet nothing in the hook may sleep (that
would stall backward). So:
- inside backward, each future is completed from the autograd engine's final callback, which runs on the
  backward thread before DDP's own final callback waits for its buckets: it sleeps until the last bucket's end
  and completes every future in order;
- outside backward a helper thread completes it instead; the same thread completes, `GRACE` seconds late, a
  future the final callback missed (DDP's static_graph=True all-reduces its first step from inside a final
  callback).
A future handed out during backward therefore completes at the end of backward, no sooner than its `end`: the
handle's `done` records that, so for DDP's buckets only the last one's `done − end` is host cost.
"""
from __future__ import annotations

import collections
import threading
import time

import torch
import torch.distributed as dist

GRACE = 0.1                        # seconds after which the helper thread completes a future backward did not


def fine_sleep():
    """Let this thread's sleeps wake up on time."""
    # Linux lets a sleeping thread wake up to 50 µs late by default (timer slack): 5 % of a 1 ms α. Ask for 1 µs.
    try:
        import ctypes
        ctypes.CDLL(None).prctl(29, 1000, 0, 0, 0)        # PR_SET_TIMERSLACK, in nanoseconds
    except (OSError, AttributeError):
        pass                                              # not Linux: sleeps keep the system's precision


class FutureCompletion:
    """Mixed into SimulatedLink: `_future_of(work)` and the machinery that completes those futures on time.

    The link provides `_lock`, `_wait(work)` and `_closed`; `_init_futures()` sets up the rest."""

    def _init_futures(self):
        self._backward_target = None              # the last work whose future completes at the end of backward
        self._later = collections.deque()                  # works whose future the helper thread completes
        self._watched = collections.deque()                  # futures backward should complete, the helper's fallback
        self._watching = False
        self._helper = None
        self._helper_wake = threading.Condition(self._lock)

    def _stop_helper(self):
        with self._lock:
            self._helper_wake.notify_all()
        if self._helper is not None:
            self._helper.join()

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
            self._watched.append(work)                       # if backward's callback comes too late (a hook
            self._watching = True
            self._start_helper()                             # called from a final callback), the helper does it
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
        if self._later:
            self._helper_wake.notify()

    def _next_for_helper(self):
        # under the lock: a future to complete now, or None after waiting a while (or when closed and idle)
        while self._watched and self._watched[0].done is not None:
            self._watched.popleft()
        if self._later:
            return self._later.popleft()
        now = time.perf_counter()
        if self._watched and now > self._watched[0].issued + self._watched[0]._seconds + GRACE:
            return self._watched.popleft()                   # backward's final callback did not come in time
        if not self._closed:                                 # watching: look again every GRACE (no notify per op)
            self._helper_wake.wait(GRACE if self._watching else None)
        return None

    def _help(self):
        fine_sleep()
        while True:
            with self._lock:
                work = self._next_for_helper()
                if work is None:
                    if self._closed and not self._later:
                        return
                    continue
            try:
                self._wait(work)
            except Exception as exc:                          # hand the failure to whoever waits
                if not work._future.done():
                    work._future.set_exception(exc)


def allreduce_hook(link: "SimulatedLink", bucket):
    """DDP communication hook: average the bucket's gradients through `link`; returns a Future of the tensor.

    (No return annotation: DDP checks it must be the real Future[Tensor] type, not a postponed string.)

        ddp_model.register_comm_hook(link, allreduce_hook)
    """
    tensor = bucket.buffer()
    tensor.div_(dist.get_world_size(link.group))
    return link.all_reduce(tensor, async_op=True).get_future()
