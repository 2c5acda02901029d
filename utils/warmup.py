"""Warm the launcher's forkserver in the background when a notebook imports `utils`.

The first launch of a session pays for the forkserver importing torch (seconds); every later one
only forks. Starting that import when the setup cell runs hides it behind the cells a student reads
before the first launch. It runs only in an IPython kernel's own process: never inside a rank or
the forkserver (which import `utils` too: warming there would recurse), nor under torchrun (RANK set).

The warm-up burns CPU for a few seconds, so a timing taken meanwhile would be skewed: importing
`utils.timing` (and its `rotated_rounds`) waits until it has finished.
"""
import os
import sys
import threading

_lock = threading.Lock()
_thread = None
_done = threading.Event()


def in_notebook_kernel() -> bool:
    """True in an IPython kernel's process that is not a rank, not the forkserver, not under torchrun."""
    if os.environ.get("COURSE_LAUNCHED_RANK") or "RANK" in os.environ:
        return False
    ipython = sys.modules.get("IPython")  # never imported here: a process without it is no kernel
    shell = ipython.get_ipython() if ipython is not None else None
    return shell is not None and hasattr(shell, "kernel")


def start_in_notebook() -> None:
    """Start warming when this process is a notebook's kernel (see in_notebook_kernel); else nothing."""
    if in_notebook_kernel():
        start()


def start() -> None:
    """Start the forkserver and have it import torch, in a background thread (once per process)."""
    global _thread
    with _lock:
        if _thread is not None:
            return
        _thread = threading.Thread(target=_warm, name="forkserver-warmup", daemon=True)
        _thread.start()


def _warm():
    try:
        from .forkserver import context
        process = context().Process(target=os.getpid, name="warmup")
        process.start()  # returns once the forkserver forked it: its preload (torch) is done
        process.kill()   # the probe itself has nothing to do
        process.join(10)
        process.close()
    except Exception:  # noqa: BLE001 — a failed warm-up only means a slower first launch
        pass
    finally:
        _done.set()


def wait(timeout: float = 120.0) -> bool:
    """Block until a warm-up that was started has finished; True when none runs any more."""
    if _thread is None:
        return True
    return _done.wait(timeout)
