"""Jupyter kernels the course's tools start themselves talk over IPC sockets in a private folder.

utils/tools/run.py (via papermill) and the grader (via nbclient) start kernels headless. Over TCP
every kernel warns "Kernel is running over TCP without encryption" and listens on localhost ports any local
user can reach; over IPC its channels are Unix sockets in a folder only we can enter. jupyter_client's IPC
default is a *relative* "kernel-ipc" path: it litters the notebook's folder (and made nbclient time out),
so the sockets go to an absolute path in a fresh folder under /tmp, short because a Unix socket path must
stay under ~107 characters. The folder is removed afterwards.

    with ipc_kernel_manager_class() as manager_class:
        papermill.execute_notebook(..., kernel_manager_class=manager_class)

`output`, a file opened for writing, receives what the kernel process itself writes to its stdout and stderr
(its own log lines, e.g. "[IPKernelApp] ERROR | KeyboardInterrupt caught in kernel." when a cell is interrupted
on purpose, and C++ log lines from torch), which otherwise land on the tool's console between its summary lines.
What cells print still goes into the notebook. (nbval, which builds its own kernel manager for the notebook
tests, stays on TCP; conftest.py gives its kernels a temporary folder of the test session's own.)

Each kernel's TMPDIR is a folder inside the private one (`temp_folder=False` keeps the caller's: the grader's
kernel already has its submission's private TMPDIR). A kernel is stopped by killing its whole process group, and
the multiprocessing forkserver the lessons start is in that group: neither the kernel nor the server runs its exit
cleanup, so what they made in the temporary folder (multiprocessing's pymp-*/listener-*, torch's
tmp*/_remote_module_non_scriptable.py) stayed in /tmp, one pymp-* folder per notebook run. Inside the private
folder it goes with it.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

MAX_SOCKET_PATH = 100  # bytes; Linux allows 107 for a Unix socket path, macOS 103
# the longest socket path a kernel makes in its TMPDIR: multiprocessing's listener (a tensor sent through a Pipe)
DEEPEST_SOCKET = "t/pymp-00000000/listener-00000000"


def socket_folder(parent=None) -> Path:
    """A new private folder for kernel sockets: under `parent`, else /tmp (short), else the temp folder."""
    if parent is None and os.path.isdir("/tmp") and os.access("/tmp", os.W_OK):
        parent = "/tmp"
    folder = Path(tempfile.mkdtemp(prefix="k-", dir=parent))
    if len(str(folder / DEEPEST_SOCKET)) > MAX_SOCKET_PATH:
        shutil.rmtree(folder, ignore_errors=True)
        raise OSError(f"kernel socket folder {folder} is too long for Unix sockets (> {MAX_SOCKET_PATH} "
                      "characters): use a shorter temporary folder")
    os.chmod(folder, 0o700)
    return folder


@contextlib.contextmanager
def ipc_kernel_manager_class(base=None, parent=None, output=None, temp_folder=True):
    """A kernel manager class (subclass of `base`, default AsyncKernelManager) whose kernels use IPC sockets in
    one private folder, removed when the block ends. Kernels started from it get distinct socket names and, with
    `temp_folder`, a TMPDIR inside that folder; with `output` (a file open for writing), their processes' stdout
    and stderr go to it."""
    if base is None:
        from jupyter_client.manager import AsyncKernelManager as base
    folder = socket_folder(parent)
    temp = folder / "t"
    if temp_folder:
        temp.mkdir(mode=0o700)

    class IPCKernelManager(base):
        def __init__(self, **kwargs):
            kwargs.setdefault("transport", "ipc")
            kwargs.setdefault("ip", str(folder / "k"))
            super().__init__(**kwargs)

        def start_kernel(self, **kwargs):
            # Popen's own arguments: a restart reuses them (the manager keeps its launch arguments)
            if output is not None:
                kwargs.setdefault("stdout", output)
                kwargs.setdefault("stderr", output)
            if temp_folder:
                kwargs["env"] = {**(kwargs.get("env") or os.environ), "TMPDIR": str(temp)}
            return super().start_kernel(**kwargs)  # a coroutine for an async base: the caller awaits it

    try:
        yield IPCKernelManager
    finally:
        shutil.rmtree(folder, ignore_errors=True)
