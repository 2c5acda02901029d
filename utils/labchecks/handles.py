"""Which communication handles a rank waits for, and when: the trace lab 2 judges overlap from.

Overlap means that a call's communication is still in flight while later gradients are computed. What a rank
does shows it: an asynchronous call returns a handle (a `Work`) at once, and the program later waits for it. So
inside `track(events)`, on this rank:
  - every `dist.<collective>`, `dist.send/recv/isend/irecv` and `dist.batch_isend_irecv` call made from user
    code gets a handle number: the ("comm", op, bytes, t, -1) events the byte counter appended during the call
    (`bytecount.count_bytes()` must be active, entered first) are rewritten with the number of the handles the
    call returned, or keep −1 when it returned none (a blocking call: done when it returned);
  - the first time the program waits for a handle, ("wait", how, 0, t, number) is appended: `work.wait()`,
    `work.get_future()` then `.wait()` (also of a future chained from it by `.then()` or combined by
    `torch.futures.collect_all` / `wait_all`), or `work.is_completed()` / `future.done()` answering True.
`fates(events)` reads a step's events back: for each call, whether it was still in flight when a later gradient
became ready. The `Work` and `Future` classes refuse new attributes on their objects, so their methods are
patched on the classes, for the duration of the block only.
"""
from __future__ import annotations

import contextlib
import functools
import threading

import torch
import torch.distributed as dist

from .. import bytecount, trace

_WORK = dist.Work
_FUTURE = torch._C.Future
_inside = threading.local()   # a call made inside a tracked call (batch_isend_irecv's isend) is the outer one's


class _Tracker:
    def __init__(self, events):
        self.events, self.handles, self.waited = events, {}, set()
        self.keep = []          # the handles and futures seen, alive until the block ends: their ids stay theirs

    def adopt(self, obj, numbers):
        if obj is not None:
            self.keep.append(obj)
            self.handles.setdefault(id(obj), set()).update(numbers)

    def numbers(self, obj):
        return self.handles.get(id(obj), set())

    def wait(self, obj, how):
        for number in sorted(self.numbers(obj) - self.waited):
            self.waited.add(number)
            self.events.append(("wait", how, 0, trace.now(), number))


def _calling(tracker, original):
    @functools.wraps(original)
    def call(*args, **kwargs):
        if getattr(_inside, "depth", 0):
            return original(*args, **kwargs)
        start = len(tracker.events)
        _inside.depth = 1
        try:
            result = original(*args, **kwargs)
        finally:
            _inside.depth = 0
        works = [w for w in (result if isinstance(result, (list, tuple)) else [result]) if isinstance(w, _WORK)]
        if works:
            number = len(tracker.keep)        # unique within the block
            for w in works:
                tracker.adopt(w, {number})
            for i in range(start, len(tracker.events)):
                kind, op, sent, t, _ = tracker.events[i]
                if kind == "comm":
                    tracker.events[i] = (kind, op, sent, t, number)
        return result
    return call


def _patch_methods(tracker):
    """(class, name, replacement) for every method through which a handle is waited for or chained."""
    work_wait, work_done, work_future = _WORK.wait, _WORK.is_completed, _WORK.get_future
    fut_wait, fut_done, fut_then = _FUTURE.wait, _FUTURE.done, _FUTURE.then
    collect = torch._C._collect_all

    def wait(self, *args, **kwargs):
        tracker.wait(self, "work.wait()")
        return work_wait(self, *args, **kwargs)

    def is_completed(self):
        done = work_done(self)
        if done:
            tracker.wait(self, "work.is_completed()")
        return done

    def get_future(self):
        future = work_future(self)
        tracker.adopt(future, tracker.numbers(self))
        return future

    def future_wait(self):
        tracker.wait(self, "future.wait()")
        return fut_wait(self)

    def done(self):
        finished = fut_done(self)
        if finished:
            tracker.wait(self, "future.done()")
        return finished

    def then(self, callback):
        future = fut_then(self, callback)
        tracker.adopt(future, tracker.numbers(self))
        return future

    def collect_all(futures):
        combined = collect(futures)
        tracker.adopt(combined, set().union(*(tracker.numbers(f) for f in futures)))
        return combined

    return [(_WORK, "wait", wait), (_WORK, "is_completed", is_completed), (_WORK, "get_future", get_future),
            (_FUTURE, "wait", future_wait), (_FUTURE, "done", done), (_FUTURE, "then", then),
            (torch._C, "_collect_all", collect_all)]


@contextlib.contextmanager
def track(events):
    """Number the handles of the calls made inside the block and append a "wait" event when each is first
    waited for (see the module's docstring). Enter it inside `bytecount.count_bytes()`."""
    tracker = _Tracker(events)
    names = bytecount.POINT_TO_POINT + bytecount.COLLECTIVES + ("batch_isend_irecv",)
    saved = [(holder, name, getattr(holder, name)) for holder, name, _ in bytecount._module_targets(names)]
    wrappers = {}
    try:
        for holder, name, original in saved:   # one wrapper per function: P2POp checks isend by identity
            wrappers.setdefault(id(original), _calling(tracker, original))
            setattr(holder, name, wrappers[id(original)])
        methods = _patch_methods(tracker)
        saved += [(holder, name, getattr(holder, name)) for holder, name, _ in methods]
        for holder, name, replacement in methods:
            setattr(holder, name, replacement)
        yield tracker
    finally:
        for holder, name, original in reversed(saved):
            setattr(holder, name, original)


# ------------------------------------------------------------------ reading a step's events back

# The names an event's second field holds, numbered so a trace can travel as integers (`code`, `name`): how a
# handle was first waited for (a poll that answered True is no wait: nothing blocked), and the calls.
POLLS = ("work.is_completed()", "future.done()")
WAITS = ("work.wait()", "future.wait()")
NAMES = ("",) + WAITS + POLLS + bytecount.POINT_TO_POINT + bytecount.COLLECTIVES + ("batch_isend_irecv",)


def code(name) -> int:
    """The number of an event's name (0: a name not in NAMES)."""
    return NAMES.index(name) if name in NAMES else 0


def name(number) -> str:
    return NAMES[number] if 0 <= number < len(NAMES) else ""


BLOCKING, WAITED_AT_ONCE, AFTER_BACKWARD, NEVER_WAITED, IN_FLIGHT = (
    "blocking", "waited at once", "after backward", "never waited", "in flight")


def fates(events):
    """[(bytes, fate, gradients ready before it, gradients ready before its first wait or None)] per call.

    fate: IN_FLIGHT when a gradient became ready between the call and the first wait for its handle (its
    communication overlapped later gradients); else BLOCKING (no handle: done when the call returned),
    AFTER_BACKWARD (issued once the last gradient was ready), NEVER_WAITED, or WAITED_AT_ONCE (waited before
    any later gradient was ready). A handle waited for before the block ended and never waited are told apart
    for every call; "in flight" needs a wait too.
    """
    ready, seen, first_wait = [], 0, {}
    for e in events:
        if e[0] == "grad":
            seen += 1
        elif e[0] == "wait":
            first_wait.setdefault(e[4], seen)
        ready.append(seen)
    total = seen
    out = []
    for i, e in enumerate(events):
        if e[0] != "comm":
            continue
        before, waited = ready[i], first_wait.get(e[4]) if e[4] >= 0 else None
        if e[4] < 0:
            fate = BLOCKING
        elif waited is None:
            fate = NEVER_WAITED
        elif waited > before:
            fate = IN_FLIGHT
        elif before == total:
            fate = AFTER_BACKWARD
        else:
            fate = WAITED_AT_ONCE
        out.append((e[2], fate, before, waited))
    return out


def stalls(events):
    """[(what, gradients ready before it, the call it waited for)] for each time backward was made to wait for
    communication in one step's events: a blocking call (one that returned no handle: dist.send/recv, a
    collective without async_op=True, dist.barrier()), or the first wait for a handle (not a poll that answered
    True), made after the first gradient was ready and before the last. Waits once the last gradient is ready
    (in its hook, a final autograd callback, finish_gradient_synchronization()) are how a step ends: not
    stalls. `the call` is (gradients ready before it) for a wait, None for a blocking call."""
    grads = [i for i, e in enumerate(events) if e[0] == "grad"]
    if len(grads) < 2:
        return []
    first, last = grads[0], grads[-1]
    issued, ready, out = {}, 0, []
    for i, e in enumerate(events):
        if e[0] == "grad":
            ready += 1
            continue
        if e[0] == "comm" and e[4] >= 0:
            issued.setdefault(e[4], ready)
        if not first < i < last:
            continue
        if e[0] == "comm" and e[4] < 0:
            out.append((e[1] or "a call", ready, None))
        elif e[0] == "wait" and e[1] not in POLLS:
            out.append((e[1] or "a wait", ready, issued.get(e[4])))
    return out
