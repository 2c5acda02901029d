"""Tidy reports of what a rank was doing: its traceback or stack, in the student's terms, and its process state.

The launcher (utils/launching.py), the pool (utils/pool.py) and the lab checks show remote tracebacks and
faulthandler stack dumps. These helpers drop the course's own plumbing frames, give cloudpickled notebook
functions their cell back, shorten machine-specific paths, and read a process's state from /proc, so a
report can say that a rank is *stopped* (SIGSTOP, a debugger) instead of waiting for a stack it cannot write.
"""
from __future__ import annotations

import linecache
import os
import re
import sys

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def short_path(path: str) -> str:
    """A path without machine-specific prefixes: '<cell>', 'utils/x.py', 'torch/…', 'python/…'."""
    if re.search(r"ipykernel_\d+[/\\]\d+\.py$", path) or path.startswith("<ipython-input"):
        return "<cell>"
    match = re.search(r"(?:site|dist)-packages[/\\](.*)$", path)
    if match:
        return match.group(1)
    if path.startswith(_REPO_ROOT):
        return path[len(_REPO_ROOT):]
    match = re.search(r"[/\\]lib[/\\]python3\.\d+[/\\](.*)$", path)
    if match:
        return "python/" + match.group(1)
    return path


# Frames of the course's plumbing (launcher, cell magic and pool, byte counter, lab-check harness): not the student's.
_PLUMBING = ("utils/launching.py", "utils/rank_process.py", "utils/failure_reports.py", "utils/shipping.py",
             "utils/magic.py", "utils/cells.py", "utils/pool.py", "utils/pool_outcomes.py", "utils/pool_rank.py",
             "utils/bytecount.py", "utils/comm_calls.py", "utils/comm_counting.py", "utils/labchecks/",
             "multiprocessing", "<string>")


def format_frames(frames, source_files=None) -> str:
    """Traceback lines for (file, line, function, code) frames, most recent call last.

    Frames of the launcher's own plumbing are dropped. cloudpickle renames the file of every
    function it ships to '<dynamic-code>'; `source_files` (function name → file, from the launching
    process) recovers it, and with it the line of code from the notebook's cell cache.
    """
    source_files = source_files or {}
    out = []
    for filename, lineno, name, code in frames:
        if any(p in filename for p in _PLUMBING):
            continue
        if filename == "<dynamic-code>" and name in source_files:
            filename = source_files[name]
        code = code or linecache.getline(filename, lineno).strip()
        out.append(f'  File "{short_path(filename)}", line {lineno}, in {name}')
        if code:
            out.append(f"    {code}")
    return "\n".join(out)


def parse_faulthandler(text: str) -> list:
    """Frames of each thread in a faulthandler dump, most recent call last; the watchdog left out."""
    threads, current = [], None
    for line in text.splitlines():
        if line.startswith(("Thread 0x", "Current thread 0x", "Stack (most")):
            current = []
            threads.append(current)
        elif current is not None:
            match = re.match(r'\s*File "(.*)", line (\d+) in (.*)', line)
            if match:
                current.append((match.group(1), int(match.group(2)), match.group(3), ""))
    return [list(reversed(t)) for t in threads if t and not any(f[2] == "_exit_with_launcher" for f in t)]


def source_files_of(fn) -> dict:
    """Function name → source file for fn and the functions of the launching script or notebook."""
    files = {}
    main = sys.modules.get("__main__")
    candidates = list(vars(main).values()) if main is not None else []
    for obj in candidates + [fn]:
        code = getattr(obj, "__code__", None)
        stack = [code] if code is not None else []
        while stack:
            code = stack.pop()
            files[code.co_name] = code.co_filename
            stack.extend(c for c in code.co_consts if hasattr(c, "co_filename"))
    return files


# /proc/<pid>/stat's state letters that mean "will not run until someone resumes it".
_STOPPED_STATES = {"T": "stopped (SIGSTOP, SIGTSTP or a job-control stop)", "t": "stopped by a debugger (tracing stop)"}


def process_state(pid) -> str:
    """The kernel's one-letter state of process `pid` (R running, S sleeping, T stopped, Z zombie, …); '' if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except (OSError, TypeError):
        return ""
    return text.rsplit(")", 1)[1].split()[0] if ")" in text else ""


def stopped_reason(pid) -> str:
    """Why process `pid` cannot run ('stopped (SIGSTOP …)'), or '' when it can (running, sleeping or gone)."""
    return _STOPPED_STATES.get(process_state(pid), "")
