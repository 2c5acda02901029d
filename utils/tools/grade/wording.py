"""Feedback a student can be sent as is: library internals worded as what they mean for the student's code.

`plain(message)` rewrites what torch and gloo print when a rank dies (build paths, C++ frames, SIGABRT) into one
sentence about the student's code, and drops the internals. Everything else passes unchanged.
"""
from __future__ import annotations

import re

# A path into torch's or gloo's build or sources, with its line number: "[../third_party/gloo/gloo/transport/
# tcp/pair.cc:534]", "/pytorch/torch/csrc/distributed/c10d/ProcessGroupGloo.cpp:2035", a site-packages path.
_BUILD_PATH = re.compile(r"\[?(?:[\w.~-]*/)*(?:third_party|torch/csrc|c10|aten|site-packages|dist-packages|pytorch)/"
                         r"[^\s\]\)]*\]?")
_CPP_FRAME = re.compile(r"^\s*(?:frame #\d+|Exception raised from|\(no backtrace available\)|#\d+ 0x[0-9a-f]+)", re.I)
_GLOO_RECEIVE = re.compile(r"gloo|pair\.cc|preamble|ProcessGroupGloo", re.I)
_RECEIVE = re.compile(r"recv|receiv|read error|preamble|nbytes|length|size|connection (closed|reset)", re.I)
_ABORT = re.compile(r"SIGABRT|signal 6|Aborted|core dumped|terminate called|died with signal|exited with (code|signal) -?6",
                    re.I)

GLOO_RECEIVE = "a rank aborted inside gloo while receiving — message sizes differ between ranks?"
GLOO_OTHER = "a rank failed inside gloo (torch.distributed's CPU backend) — do every send and recv pair up?"
ABORTED = "a rank aborted (the process was killed by SIGABRT inside a library call)"


def plain(message: str) -> str:
    """message with library internals replaced by what they mean (see the module docstring)."""
    if not message:
        return message
    gloo = bool(_GLOO_RECEIVE.search(message))
    aborted = bool(_ABORT.search(message))
    summary = None
    if gloo and (_RECEIVE.search(message) or aborted):
        summary = GLOO_RECEIVE
    elif gloo and (_BUILD_PATH.search(message)):
        summary = GLOO_OTHER
    elif aborted:
        summary = ABORTED
    lines, said = [], False
    for line in message.splitlines():
        internal = (_CPP_FRAME.match(line) or _BUILD_PATH.search(line) or _ABORT.search(line)
                    or (summary and _GLOO_RECEIVE.search(line)))
        if internal:
            if summary and not said:
                indent = line[:len(line) - len(line.lstrip())]
                lines.append(indent + summary)
                said = True
            continue
        lines.append(line)
    return "\n".join(lines)
