"""Whether processes are gone: shared by the tests that check a launch leaves nothing running."""
import time


def alive(pid: int) -> bool:
    """Whether `pid` names a running process (a zombie counts as gone: it no longer runs anything)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False


def wait_gone(pids, seconds: float = 10.0) -> list:
    """Wait up to `seconds` for every pid to be gone; return those still alive."""
    end = time.monotonic() + seconds
    while time.monotonic() < end and any(alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if alive(p)]
