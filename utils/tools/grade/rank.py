"""The verdict processes: a pool of ranks that run a submission's solution cells, then the cases they are sent.

    python -m utils.tools.grade.rank        (started by utils/tools/grade/checker.py only)

One process starts, imports torch, the lab's verdict module and the lab's leading definition cells (all
trusted), and forks one rank per pool slot; it runs no student code itself, waits for its ranks, and exits with
them. Each rank runs the rest of the cells (the solution cells among them) and then serves tasks. This is
trusted code in processes that run student code, so nothing a rank reports is believed beyond its bytes: it
answers with raw tensors and JSON numbers (utils/tools/grade/wire.py), and the checker judges them.

stdin of the first process: one frame {"verdicts": {"name", "source"} (the lab's verdict module as text: it is
never on a path student code can open), "hidden": [module names student code must not import here, e.g. the
private reference formulas: stand-ins that raise], "cells": [[label, source], ...], "leading": k (cells run
before forking), "ranks": [[commands fd, results fd, output fd], ...], "status": fd, "store": bool, "timeout": s}.
With "store", the first process hosts the ranks' rendezvous store on its loopback (a sandbox has its own) after
forking them and hands each rank the port. It writes one JSON line per rank that ends to the status fd:
{"rank": r, "code": exit code} or {"rank": r, "signal": number}. Each rank then reads its commands fd, one frame
per task:
    {"part": grade_id, "world_size": N (0: no process group), "prefix": store prefix, "rank": r,
     "timeout": seconds, "cases": [{"params": {...}, "tensors": [descriptors]}]} + this rank's inputs
and writes to its results fd {"ready": true, "cell_errors": {label: error}}, then per task
    {"cases": [{"outputs": [descriptor | {"type": name}], "measured": {...}} | {"value": ...} | {"error": "..."}]}
Its stdout and stderr (student prints, warnings) go to its output fd, which the checker reads and caps.

A task's inputs reach a rank only when the checker sends that task, after every rank replied to the previous
one; every rank is undumpable and holds only its own pipes, so another rank cannot read them.
"""
from __future__ import annotations

import json
import os
import sys
import traceback
import types
from datetime import timedelta

from . import wire
from .processes import die_with_parent, make_undumpable
from .sandbox import confine

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


class Hidden(types.ModuleType):
    """A private module's stand-in where student code runs: importing it works (a verdict module may import it
    for its checker-side functions), using it raises."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(f"{self.__name__} is not available where student code runs")


def load_verdicts(spec, hidden):
    """The lab's verdict module from its text (it never touches the disk here), private modules hidden."""
    for name in hidden:
        sys.modules[name] = Hidden(name)
        parent, _, child = name.rpartition(".")
        if parent in sys.modules:
            setattr(sys.modules[parent], child, sys.modules[name])
    module = types.ModuleType(spec["name"])
    module.__file__ = f"<verdicts {spec['name']}>"
    sys.modules[spec["name"]] = module
    exec(compile(spec["source"], module.__file__, "exec"), module.__dict__)
    return module


def serve(setup, slot, namespace, errors, verdicts, port_fd) -> None:
    """The life of one rank after the fork: its own pipes only, the remaining cells, then tasks until EOF."""
    commands_fd, results_fd, output_fd = setup["ranks"][slot]
    for other in setup["ranks"]:
        for fd in other:
            if fd not in (commands_fd, results_fd, output_fd):
                os.close(fd)
    os.close(setup["status"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(output_fd, 1)
    os.dup2(output_fd, 2)
    for fd in (null, output_fd):
        os.close(fd)
    commands, results = os.fdopen(commands_fd, "rb"), os.fdopen(results_fd, "wb")
    store = None
    if port_fd is not None:
        import torch.distributed as dist
        with os.fdopen(port_fd, "rb") as pipe:
            port = int(pipe.read(16) or 0)   # written by the first process once every rank is forked
        if not port:
            raise RuntimeError("the first verdict process could not start the rendezvous store")
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=setup["timeout"]))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    run_cells(setup["cells"][setup["leading"]:], namespace, errors)
    wire.write_frame(results, {"ready": True, "cell_errors": errors})
    labels = {label for label, _ in setup["cells"]}
    while (frame := wire.read_frame(commands)) is not None:
        reply, payload = run_task(verdicts, namespace, labels, *frame, store)
        wire.write_frame(results, reply, payload)


def _describe(status) -> dict:
    if os.WIFSIGNALED(status):
        return {"signal": os.WTERMSIG(status)}
    return {"code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else -1}


def main() -> int:
    confine()  # in a sandbox: its limits, and as root its own user (before anything else runs)
    die_with_parent()
    make_undumpable()  # inherited by every rank forked below
    setup, _ = wire.read_frame(sys.stdin.buffer)
    verdicts = load_verdicts(setup["verdicts"], setup.get("hidden", ()))
    if setup.get("store"):
        import torch
        torch.set_num_threads(1)
    namespace, errors = {"__name__": "__main__"}, {}
    run_cells(setup["cells"][:setup["leading"]], namespace, errors)  # the lab's own cells: trusted
    sys.stdout.flush()
    sys.stderr.flush()
    children, ports = {}, []
    for slot in range(len(setup["ranks"])):
        read_port, write_port = os.pipe() if setup.get("store") else (None, None)
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                die_with_parent()
                for fd in ports + [write_port]:
                    if fd is not None:
                        os.close(fd)
                serve(setup, slot, namespace, errors, verdicts, read_port)
            except BaseException:  # noqa: BLE001 — reported on the output pipe; the checker sees the exit
                traceback.print_exc()
                code = 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)  # skip teardown: threads the student started must not keep a rank alive
        children[pid] = slot
        if read_port is not None:
            os.close(read_port)
            ports.append(write_port)
    for fds in setup["ranks"]:
        for fd in fds:
            os.close(fd)
    store = None
    if ports:  # the ranks' rendezvous, on this sandbox's own loopback
        import torch.distributed as dist
        try:
            store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                  timeout=timedelta(seconds=max(setup["timeout"], 30)))
            port = store.port
        except Exception:  # noqa: BLE001 — each rank reports that it got no port
            traceback.print_exc()
            port = 0
        for fd in ports:
            try:
                os.write(fd, str(port).encode())
            except OSError:
                pass  # that rank is already gone: the checker sees it
            os.close(fd)
    with os.fdopen(setup["status"], "w") as status:
        while children:
            pid, code = os.waitpid(-1, 0)
            if pid in children:
                status.write(json.dumps({"rank": children.pop(pid), **_describe(code)}) + "\n")
                status.flush()
    del store
    return 0


if __name__ == "__main__":
    sys.exit(main())
