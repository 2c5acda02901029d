"""Is a person watching a launch's output as it happens, or does a batch executor record it?

Live (JupyterLab, Colab, a terminal): each rank's stdout lines are shown as they come. Batch (nbval/pytest,
papermill, nbconvert, the course's own tools): lines are grouped in rank order, so stored outputs are
deterministic.
"""
from __future__ import annotations

import os
import re
import selectors
import sys


def output_is_live() -> bool:
    """True when a person watches the output as it happens (JupyterLab, Colab, a terminal).

    Batch executors (nbval/pytest, papermill, nbconvert, the course's runner and grader) get the
    output grouped in rank order instead. COURSE_OUTPUT=live|grouped overrides the guess, which
    goes by the program or module that started the kernel (its parent process).
    """
    mode = os.environ.get("COURSE_OUTPUT", "")
    if mode in ("live", "grouped"):
        return mode == "live"
    try:
        from IPython import get_ipython
        shell = get_ipython()
    except ImportError:
        shell = None
    if shell is None or not hasattr(shell, "kernel"):
        return sys.stdout.isatty()
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            argv = f.read().decode(errors="replace").split("\0")
    except OSError:
        return True
    name = executor_name(argv)
    return name not in _BATCH_EXECUTORS and not name.startswith("utils.tools.")


# Programs and modules that execute notebooks with nobody watching (a kernel's parent process); the course's
# own tools (utils.tools.*) too.
_BATCH_EXECUTORS = {"papermill", "pytest", "py.test", "nbval", "nbclient", "nbconvert", "jupyter-nbconvert",
                    "jupyter-execute", "execnet"}


def executor_name(argv: list) -> str:
    """The program a command line runs: its executable's name, or a Python's script or `-m` module.

    ['/x/bin/python', '-m', 'pytest', ...] -> 'pytest'; ['/x/bin/python', '/x/bin/papermill', ...] ->
    'papermill'; ['/x/bin/jupyter-lab', '--root-dir=/tmp/pytest-of-me/...'] -> 'jupyter-lab'.
    Only the program counts, never the paths it is given.
    """
    argv = [a for a in argv if a]
    if not argv:
        return ""
    name = os.path.basename(argv[0])
    if not re.fullmatch(r"python[\d.]*", name):
        return name
    args = iter(argv[1:])
    for arg in args:
        if arg == "-m":
            return next(args, "")
        if arg.startswith("-m"):
            return arg[2:]
        if arg == "-c" and "sys.stdin.readline()" in next(args, ""):
            return "execnet"  # execnet's bootstrap: a pytest-xdist worker
        if arg in ("-c", "-"):
            return name
        if arg in ("-W", "-X", "-Q"):
            next(args, None)  # an option with a separate value
        elif not arg.startswith("-"):
            return os.path.basename(arg)  # a script
    return name


class RankOutput:
    """The launcher's side of the ranks' output sockets (mixed into `_Launch`, which owns the selector).

    Each rank connects once per stream and sends "<rank> <stream>\\n", then its raw output; complete lines
    are shown live (stdout, when a person watches) or kept in `self.lines[rank][stream]` for rank order.
    """

    def _accept(self):
        try:
            conn, _ = self.output_server.accept()
        except BlockingIOError:
            return
        conn.setblocking(True)
        header = b""
        while not header.endswith(b"\n"):  # "<rank> <stream>\n", sent right after connecting
            chunk = conn.recv(1)
            if not chunk:
                conn.close()
                return
            header += chunk
        rank, stream = map(int, header.split())
        conn.setblocking(False)
        self.sockets.append(conn)
        self.selector.register(conn, selectors.EVENT_READ, ("output", (rank, stream)))

    def _read_output(self, conn, rank_stream):
        try:
            data = conn.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._unregister(conn)
            data = b"\n" if self.partial.get(rank_stream) else b""
            if not data:
                return
        text = self.partial.pop(rank_stream, b"") + data
        *complete, rest = text.split(b"\n")
        if rest:
            self.partial[rank_stream] = rest
        rank, stream = rank_stream
        for raw in complete:
            self._emit_line(rank, stream, raw.decode(errors="replace"))

    def _emit_line(self, rank, stream, line):
        """One complete line a rank wrote: stdout shown now (live), the rest kept for rank order."""
        if self.live and stream == 1:
            print(f"[rank {rank}] {line}", flush=True)
        else:
            self.lines[rank][stream].append(line)

    def _print_output(self):
        """Print the lines held back (live: only stderr), in rank order."""
        for stream, target in ((1, sys.stdout), (2, sys.stderr)):
            for rank in range(self.world_size):
                for line in self.lines[rank][stream]:
                    print(f"[rank {rank}] {line}", file=target)
                self.lines[rank][stream] = []
            target.flush()
