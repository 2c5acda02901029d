"""Imported by the forkserver's preload (utils/forkserver.py): when the server exits after its launching process
ended, it removes that process's multiprocessing folder (the server's own socket is in it), which a killed notebook
kernel leaves behind.

Only the server acts: a process that imports this module for another reason (a test importing the preload list, a
script) registers nothing, and neither does a server whose launching process lives on (it keeps using the folder).
Ranks forked from the server inherit the registration but end with os._exit, and the pid check skips them anyway.
"""
import atexit
import os
import shutil
import tempfile
import time
from pathlib import Path

from .forkserver import FOLDER_VARIABLE

# how long the exiting server waits to see its launching process gone (the server's "alive" pipe closes while the
# process is still being torn down, a moment before the server is handed to a new parent)
PARENT_GONE_WAIT = 2.0


def _is_forkserver() -> bool:
    """True in multiprocessing's forkserver process (started as `python -c 'from multiprocessing.forkserver ...'`)."""
    try:
        command = Path("/proc/self/cmdline").read_bytes()
    except OSError:
        return False
    return b"from multiprocessing.forkserver import main" in command


def _remove(folder: str, server_pid: int, launcher_pid: int) -> None:
    """In the server's own process, once its launching process is gone: remove that process's pymp-* folder."""
    if os.getpid() != server_pid:
        return
    end = time.monotonic() + PARENT_GONE_WAIT
    while os.getppid() == launcher_pid and time.monotonic() < end:
        time.sleep(0.02)
    path = Path(folder)
    if os.getppid() != launcher_pid and path.name.startswith("pymp-") and path.is_dir():
        shutil.rmtree(path, ignore_errors=True)


_folder = os.environ.get(FOLDER_VARIABLE)
if _folder and _is_forkserver() and Path(_folder).parent.resolve() == Path(tempfile.gettempdir()).resolve():
    atexit.register(_remove, _folder, os.getpid(), os.getppid())
