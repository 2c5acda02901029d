"""The verdict processes: a pool of ranks that run a submission's solution cells, then the cases they are sent.

    python -m utils.tools.grade.rank        (started by utils/tools/grade/checker.py only)

One process starts, imports torch, the lab's verdict module and the lab's leading definition cells (all
trusted), and forks one rank per pool slot; it runs no student code itself, waits for its ranks, and exits with
them. Each rank runs the rest of the cells (the solution cells among them) and then serves tasks. This is
trusted code in processes that run student code, so nothing a rank reports is believed beyond its bytes: it
answers with raw tensors and JSON numbers (utils/tools/grade/wire.py), and the checker judges them.

stdin of the first process: one frame {"verdicts": path, "cells": [[label, source], ...], "leading": k (cells
run before forking), "ranks": [[commands fd, results fd, output fd], ...], "store_port": port or null,
"timeout": s}. Each rank then reads its commands fd, one frame per task:
    {"part": grade_id, "world_size": N (0: no process group), "prefix": store prefix, "rank": r,
     "timeout": seconds, "cases": [{"params": {...}, "tensors": [descriptors]}]} + this rank's inputs
and writes to its results fd {"ready": true, "cell_errors": {label: error}}, then per task
    {"cases": [{"outputs": [descriptor | {"type": name}], "measured": {...}} | {"value": ...} | {"error": "..."}]}
Its stdout and stderr (student prints, warnings) go to its output fd, which the checker reads and caps.

A task's inputs reach a rank only when the checker sends that task, after every rank replied to the previous
one; every rank is undumpable and holds only its own pipes, so another rank cannot read them.
"""
from __future__ import annotations

import os
import sys
import traceback
from datetime import timedelta

from . import wire
from .processes import die_with_parent, make_undumpable

MAX_ERROR = 1500  # characters of one error message sent back


def describe_error(error: BaseException, labels) -> str:
    """ "TypeName: message (solution cell 'x', line 7: source line)" for the innermost frame in a cell."""
    text = f"{type(error).__name__}: {error}".strip()
    where = ""
    for frame in reversed(traceback.extract_tb(error.__traceback__)):
        if frame.filename in labels:
            where = f" ({frame.filename}, line {frame.lineno}" + (f": {frame.line.strip()}" if frame.line else "") + ")"
            break
    lines = text.splitlines() or [text]
    text = "\n".join(lines[:8]) + ("\n…" if len(lines) > 8 else "")
    return text[:MAX_ERROR] + where[:300]


def run_cells(cells, namespace, errors) -> None:
    """Execute each cell's source in the namespace, as a notebook would; errors are kept per cell, not fatal."""
    for label, source in cells:
        try:
            exec(compile(source, label, "exec"), namespace)
        except BaseException as error:  # noqa: BLE001 — SystemExit and KeyboardInterrupt included
            errors[label] = describe_error(error, {label})


def _measured(values) -> dict:
    """Only plain numbers survive (what a program measured is reported, never trusted)."""
    if type(values) is not dict:
        return {}
    return {k[:50]: v for k, v in list(values.items())[:200]
            if type(k) is str and type(v) in (int, float)}


MAX_OUTPUTS = 16  # tensors (or other values) one rank sends back per case


def _encode_outputs(outputs, offset) -> tuple[list, bytes]:
    """Descriptors of the tensors among outputs (offsets from `offset`), {"type": name} for anything else."""
    import torch

    if type(outputs) not in (list, tuple):
        outputs = [outputs]
    if len(outputs) > MAX_OUTPUTS:  # the verdict program's own bug: say so instead of dropping data
        raise RuntimeError(f"the verdict program returned {len(outputs)} outputs for one case; at most "
                           f"{MAX_OUTPUTS} travel: pack tensors together (e.g. one flat tensor per kind)")
    described, payload = [], b""
    for value in outputs:
        if isinstance(value, torch.Tensor):
            (descriptor,), raw = wire.pack([value])
            descriptor["offset"] = offset + len(payload)
            described.append(descriptor)
            payload += raw
        else:
            described.append({"type": type(value).__name__})
    return described, payload


def run_task(verdicts, namespace, labels, header, payload, store):
    """Run every case of one task on this rank; return (reply header, payload)."""
    spec = verdicts.PARTS[header["part"]]
    world_size = header["world_size"]
    replies, out = [], b""
    group = False
    try:
        if world_size:
            import torch.distributed as dist
            os.environ.update(RANK=str(header["rank"]), WORLD_SIZE=str(world_size))
            dist.init_process_group("gloo", store=dist.PrefixStore(header["prefix"], store), rank=header["rank"],
                                    world_size=world_size, timeout=timedelta(seconds=header["timeout"]))
            group = True
        for case in header["cases"]:
            try:
                if world_size:
                    outputs, measured = spec.program(namespace, case["params"], wire.unpack(case["tensors"], payload))
                    described, raw = _encode_outputs(outputs, len(out))
                    replies.append({"outputs": described, "measured": _measured(measured)})
                    out += raw
                else:
                    replies.append({"value": spec.program(namespace, case["params"])})
            except BaseException as error:  # noqa: BLE001 — the student's code may raise anything
                replies.append({"error": describe_error(error, labels)})
    finally:
        if group:
            import torch.distributed as dist
            dist.destroy_process_group()
    return {"cases": replies}, out


def serve(setup, slot, namespace, errors, verdicts) -> None:
    """The life of one rank after the fork: its own pipes only, the remaining cells, then tasks until EOF."""
    commands_fd, results_fd, output_fd = setup["ranks"][slot]
    for other in setup["ranks"]:
        for fd in other:
            if fd not in (commands_fd, results_fd, output_fd):
                os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(output_fd, 1)
    os.dup2(output_fd, 2)
    for fd in (null, output_fd):
        os.close(fd)
    commands, results = os.fdopen(commands_fd, "rb"), os.fdopen(results_fd, "wb")
    store = None
    if setup.get("store_port"):
        import torch.distributed as dist
        store = dist.TCPStore("127.0.0.1", setup["store_port"], is_master=False,
                              timeout=timedelta(seconds=setup["timeout"]))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(setup["store_port"]))
    run_cells(setup["cells"][setup["leading"]:], namespace, errors)
    wire.write_frame(results, {"ready": True, "cell_errors": errors})
    labels = {label for label, _ in setup["cells"]}
    while (frame := wire.read_frame(commands)) is not None:
        reply, payload = run_task(verdicts, namespace, labels, *frame, store)
        wire.write_frame(results, reply, payload)


def main() -> int:
    die_with_parent()
    make_undumpable()  # inherited by every rank forked below
    setup, _ = wire.read_frame(sys.stdin.buffer)
    from .verdicts import load_module
    verdicts = load_module(setup["verdicts"])
    if setup.get("store_port"):
        import torch
        torch.set_num_threads(1)
    namespace, errors = {"__name__": "__main__"}, {}
    run_cells(setup["cells"][:setup["leading"]], namespace, errors)  # the lab's own cells: trusted
    sys.stdout.flush()
    sys.stderr.flush()
    children = []
    for slot in range(len(setup["ranks"])):
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                die_with_parent()
                serve(setup, slot, namespace, errors, verdicts)
            except BaseException:  # noqa: BLE001 — reported on the output pipe; the checker sees the exit
                traceback.print_exc()
                code = 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)  # skip teardown: threads the student started must not keep a rank alive
        children.append(pid)
    for fds in setup["ranks"]:
        for fd in fds:
            os.close(fd)
    for pid in children:
        os.waitpid(pid, 0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
