"""The forkserver every rank is forked from: what it imports first, and what it removes when it ends.

`context()` is the multiprocessing context `launch` and the rank pool start ranks with. Its server imports
`FORKSERVER_PRELOAD` once (torch among them), so a rank costs a fork, not an `import torch`.

The server listens on a Unix socket that multiprocessing puts in the launching process's own temporary folder
(`/tmp/pymp-*`). That folder is removed by the launching process when it exits normally, but a notebook kernel is
often killed instead (nbval, papermill and the grader stop their kernels so), and then the folder stayed behind, one
per kernel. The server outlives its kernel by a moment (it ends when the kernel's end of its "alive" pipe closes),
so it removes the folder itself: `context()` names the folder in `FOLDER_VARIABLE` before the server starts, and
utils/_forkserver_exit.py, which only the server imports, removes it when the server exits.
"""
from __future__ import annotations

import contextlib
import multiprocessing
import os
import sys

__all__ = ["FORKSERVER_PRELOAD", "FOLDER_VARIABLE", "context", "main_module_hidden"]

# What the forkserver imports before it forks any rank: the launcher (and so torch), and torch._dynamo, which a
# rank's first torch.optim constructor imports (~1-2 s per rank). Importing them must not ask the CUDA driver
# anything (torch.cuda.is_available() initialises it): every rank is forked from the server, and a process forked
# after that cannot use CUDA (the course's device-placement test checks it).
FORKSERVER_PRELOAD = ("utils.launching", "torch._dynamo", "utils._forkserver_exit")

# The launching process's multiprocessing folder (its forkserver's socket is there), for the server to remove.
FOLDER_VARIABLE = "COURSE_FORKSERVER_FOLDER"


def context():
    """The forkserver context, with the launcher (and so torch) preloaded in the server."""
    ctx = multiprocessing.get_context("forkserver")
    from multiprocessing import forkserver, util
    if forkserver._forkserver._forkserver_pid is None:  # not started yet: preload and environment may still change
        ctx.set_forkserver_preload(list(FORKSERVER_PRELOAD))
        os.environ[FOLDER_VARIABLE] = util.get_temp_dir()
    return ctx


@contextlib.contextmanager
def main_module_hidden():
    """Keep multiprocessing from re-importing the launching script in every rank.

    fn travels by value, so a rank never needs `__main__`; re-running a script without an
    `if __name__ == "__main__":` guard would even launch again from inside the rank.
    """
    main = sys.modules["__main__"]
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if k in main.__dict__}
    main.__dict__.pop("__file__", None)
    main.__spec__ = None
    try:
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)
