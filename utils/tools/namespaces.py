"""The machine's side of utils/tools/cluster.py: its network namespaces, the commands that make and remove them,
and the processes started in them.

A Cluster's namespaces are named `dpfs<slot>p<creator pid>n<node>` (`...sw` for a switch), so `ours()` finds every
one any Cluster made and `sweep()` can tell those whose creator is gone. Deleting a namespace first kills every
process still in it, then deletes it with its links. Kept free of torch and of the utils package, like cluster.py,
which runs as a plain file too.
"""
from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time

_NAME = re.compile(r"^dpfs(\d+)p(\d+)(n\d+|sw)$")


def _ip(*args, check=True, netns=None) -> str:
    """Run `ip ARGS` (inside `netns` if given); its stdout. A failure raises with ip's own message."""
    argv = ["ip"] + (["-n", netns] if netns else []) + list(args)
    proc = subprocess.run(argv, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout


def _namespaces() -> list[str]:
    """Every network namespace of the machine, by name."""
    return [line.split()[0] for line in _ip("netns", "list").splitlines() if line.strip()]


def ours() -> list[str]:
    """The namespaces any Cluster made that still exist (of this run or any other)."""
    return [name for name in _namespaces() if _NAME.match(name)]


def _alive(pid: int) -> bool:
    """Whether process `pid` exists (a namespace's creator, which may belong to another user)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_inside(netns: str) -> None:
    """SIGKILL every process still running in `netns` (all of them were started there by a Cluster)."""
    for _ in range(50):
        pids = [int(p) for p in _ip("netns", "pids", netns, check=False).split()]
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.02)
    raise RuntimeError(f"processes in namespace {netns} survive SIGKILL: {pids}")


def _delete(netns: str) -> None:
    """Kill every process in `netns`, then delete it (and with it its links)."""
    _kill_inside(netns)
    _ip("netns", "del", netns, check=False)


def sweep() -> list[str]:
    """Delete the namespaces (and so the links) of Clusters whose creator process is gone; the names deleted."""
    gone = []
    for name in ours():
        creator = int(_NAME.match(name).group(2))
        if not _alive(creator):
            _delete(name)
            gone.append(name)
    return gone


def _run_checked(argv: list[str]) -> None:
    """Run `argv`; a failure raises with its stderr."""
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed: {proc.stderr.strip()}")


def _stop(proc: subprocess.Popen, grace: float = 3.0) -> None:
    """SIGTERM the process group of `proc`, SIGKILL it after `grace` seconds."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)   # the group's other members (torchrun's workers) too
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(5)
