"""Process plumbing for the grader: environments, private temporary folders, and leaving nothing running.

Every process the grader starts for a submission (the feedback worker and its kernel, the verdict checker and
its rank processes) gets an environment without torchrun's variables and a TMPDIR inside that submission's
private folder, which is removed afterwards; and every one of them is killed, with whatever it started, on
every path (finished, timed out, interrupted).
"""
from __future__ import annotations

import os
import signal
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]
# Grading inside a torchrun/SLURM job must not make the lab's utils.launch think it is one of its ranks.
_RANK_ENVIRONMENT = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                     "MASTER_ADDR", "MASTER_PORT", "COURSE_LAUNCHED_RANK"}


def short_temporary_folder(prefix: str) -> Path:
    """A new private folder with a short absolute path (Unix socket paths must stay under ~107 characters)."""
    base = "/tmp" if os.path.isdir("/tmp") and os.access("/tmp", os.W_OK) else None
    return Path(tempfile.mkdtemp(prefix=prefix, dir=base))


def child_environment(tmpdir, **extra) -> dict:
    """This process's environment for a grader child: no rank variables, the course importable, TMPDIR private."""
    env = {k: v for k, v in os.environ.items()
           if k not in _RANK_ENVIRONMENT and not k.startswith("TORCHELASTIC_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    env.update(TMPDIR=str(tmpdir), PYTHONUNBUFFERED="1", PYDEVD_DISABLE_FILE_VALIDATION="1",
               # torch._dynamo, imported by a rank's first optimizer, makes its cache folder: inside the private one
               # (a clean-clone run under load once found it at /tmp/torchinductor_root, read-only in the sandbox)
               TORCHINDUCTOR_CACHE_DIR=str(Path(tmpdir) / "torchinductor"))
    env.update({k: str(v) for k, v in extra.items()})
    return env


def session_of(pid):
    try:
        return os.getsid(pid)
    except (OSError, AttributeError):
        return None


def _freeze_and_kill(procs) -> None:
    """SIGSTOP every process first (so none restarts what we kill), then SIGKILL them all and wait up to 5 s for
    each to be gone or a zombie."""
    import psutil

    for proc in procs:
        try:
            proc.send_signal(signal.SIGSTOP)
        except psutil.Error:
            pass
    for proc in procs:
        try:
            proc.kill()
        except psutil.Error:
            pass
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(not _dead(p) for p in procs):
        time.sleep(0.02)


def _dead(proc) -> bool:
    """Gone, or a zombie. A zombie runs nothing; psutil would wait for whoever reaps it (its parent, or the
    machine's init), which under load can take the whole timeout, for each of kill_tree's rounds."""
    import psutil

    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


def kill_tree(pid: int, alive: bool, sessions=(), since: float = 0.0) -> None:
    """SIGKILL a process, its descendants, and every process in a session one of them leads.

    Kernels and rank processes start sessions of their own, so killing one process group is not enough.
    alive=False: the process has exited (its pid may be reused); only sessions are swept then. Only our
    user's processes started after `since` (epoch seconds) are touched, and never our own session.
    """
    import psutil

    ours, me, uid = session_of(0), os.getpid(), os.getuid()
    for _ in range(5):  # repeat: a process may fork while we look
        procs = []
        if alive:
            try:
                root = psutil.Process(pid)
                procs = [root] + root.children(recursive=True)
            except psutil.Error:
                pass
        swept = ({session_of(p.pid) for p in procs} | set(sessions) | {pid}) - {ours, None}
        for proc in psutil.process_iter(["uids", "create_time"]):
            info = proc.info
            if (proc not in procs and session_of(proc.pid) in swept and info["uids"]
                    and info["uids"].real == uid and (info["create_time"] or 0) >= since - 1):
                procs.append(proc)
        procs = [p for p in procs if p.pid != me and not _dead(p)]
        if not procs:
            return
        _freeze_and_kill(procs)
        alive = False  # the root is gone now; later rounds sweep sessions only


def kill_descendants() -> None:
    """SIGKILL every descendant of this process (and the sessions they lead): nothing it started outlives it."""
    import psutil

    for _ in range(5):
        try:
            children = psutil.Process().children(recursive=True)
        except psutil.Error:
            return
        if not children:
            return
        _freeze_and_kill(children)


def become_subreaper() -> None:
    """Linux: orphans of our children stay our descendants (re-parented to us), so we can find and kill them."""
    _prctl(36, 1)  # PR_SET_CHILD_SUBREAPER


def make_undumpable() -> None:
    """Linux: other processes of our user can no longer read this one's memory or open its files and pipes
    through /proc or attach a debugger to it (PR_SET_DUMPABLE 0). The grader's trusted processes and each
    rank do this, so one rank cannot read another rank's inputs or write into the checker's pipes."""
    _prctl(4, 0)  # PR_SET_DUMPABLE


def die_with_parent() -> None:
    """Linux: SIGKILL this process when the process (thread) that started it dies, even by SIGKILL, so a grader
    killed outright does not leave its children running (PR_SET_PDEATHSIG)."""
    parent = os.getppid()
    _prctl(1, signal.SIGKILL)
    if os.getppid() != parent:  # it died before the request took effect
        os._exit(1)


def _prctl(option, value):
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)
    except Exception:  # not Linux: the protection is simply absent
        pass


def exit_on_signals() -> None:
    """Turn SIGTERM and SIGHUP into SystemExit, so `finally` blocks run and clean up."""
    def stop(signum, frame):
        raise SystemExit(128 + signum)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, stop)
