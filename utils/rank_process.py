"""The body of every rank process that `utils.launch` starts (the launching side is utils/launching.py).

A rank leads its own process group (so the launcher can kill all it starts), sends its stdout and stderr
(C-level too) to the launcher over sockets, dumps its Python stack on SIGUSR1 (the launcher's hang report),
dies with the launcher (a watchdog thread), leaves an anchor in its group (a shell that lets the launcher kill
what the rank started after the rank is gone, and kills it if the launcher dies), initialises the default
process group and runs `fn`; its result or its exception travels back over a pipe. A replacement rank (`launch(..., replace=N)`) starts the same way with
its generation in COURSE_GENERATION and no default group: the survivors' group cannot take a newcomer, so
`fn` forms fresh groups with utils/replacement.py.
"""
from __future__ import annotations

import faulthandler
import gc
import io
import os
import shutil
import signal
import socket
import sys
import threading
from datetime import timedelta

import cloudpickle
import torch
import torch.distributed as dist

from . import compat
from .devices import RANK_MARKER, backend_for  # RANK_MARKER: set inside ranks that launch() started
from .shipping import describe_exception, dumps, to_cpu

GENERATION = "COURSE_GENERATION"      # 0 for a launch's first ranks, n for the n-th replacement process


def _rank_main(spec, result_conn, control_conn, anchor_conn=None):
    """Body of every rank process: set up, run fn, report, exit."""
    os.setsid()  # lead a process group, so the launcher can kill everything this rank starts
    _start_anchor(control_conn, anchor_conn, spec.get("tmp") or "")
    rank, world_size = spec["rank"], spec["world_size"]
    _connect_output(rank, spec["output_port"])
    os.environ.clear()
    os.environ.update(spec["env"])
    os.environ.update({RANK_MARKER: "1", "RANK": str(rank), "WORLD_SIZE": str(world_size),
                       "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world_size),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(spec["store_port"]),
                       GENERATION: str(spec["generation"])})
    # Without a barrier after init, a rank whose fn needs no peer (a print, a refused send) can finish
    # and exit while a peer is still completing gloo's connection handshake with it, which then fails
    # with "Gloo connectFullMesh failed ... Connection closed by peer". torch's store-based barrier
    # holds every rank until all have connected.
    os.environ.setdefault("TORCH_DIST_INIT_BARRIER", "1")
    _temp_files_in(spec.get("tmp"))
    stack_file = open(spec["stack_file"], "w")
    faulthandler.enable(file=stack_file, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    threading.Thread(target=_exit_with_launcher, args=(control_conn, spec.get("tmp")), daemon=True,
                     name="launcher-watchdog").start()
    torch.set_num_threads(spec["threads"])
    dist.set_debug_level_from_env()  # torch was imported before the notebook set the variable
    try:
        options = _device_options(spec["backend"], rank)
        # How long a collective waits for its peers before it fails: set once the group formed where torch can,
        # so that it does not bound the start-up barrier too (ranks of a busy machine arrive seconds apart).
        late_timeout = spec["group_timeout"] is not None and compat.CAN_SET_GROUP_TIMEOUT
        if spec["group_timeout"] is not None and not late_timeout:
            options["timeout"] = timedelta(seconds=spec["group_timeout"])
        if not spec["replace"]:  # with replacements, fn forms its own groups (utils/replacement.py)
            store = dist.TCPStore("127.0.0.1", spec["store_port"], world_size, is_master=False,
                                  timeout=timedelta(seconds=max(spec["timeout"], 30)))
            dist.init_process_group(spec["backend"], store=store, rank=rank, world_size=world_size, **options)
            if late_timeout:
                compat.set_group_timeout(spec["group_timeout"])
        fn, args, kwargs = cloudpickle.loads(spec["payload"])
        result = to_cpu(fn(*args, **kwargs))
        body = dumps(result)
    except BaseException as exc:  # noqa: BLE001 — everything is reported to the launcher
        sys.stdout.flush()
        sys.stderr.flush()
        result_conn.send(("error", describe_exception(exc)))
        os._exit(1)  # skip destroy_process_group: peers may be gone and it could block
    if dist.is_initialized():
        compat.end_group_before_exit()
    sys.stdout.flush()
    sys.stderr.flush()
    result_conn.send(("ok", body))
    os._exit(0)


def _temp_files_in(folder):
    """multiprocessing's own temporary folder (pymp-*: the listener of a tensor sent through a Pipe) goes inside
    the launch's folder, which the launcher removes: a rank ends with os._exit, so the finalizer that would remove
    it never runs. Not where a socket's path would be too long for AF_UNIX (108 bytes)."""
    if folder and len(folder) < 64:
        import multiprocessing.process
        multiprocessing.process.current_process()._config["tempdir"] = folder


def _device_options(backend, local_rank):
    """Before a NCCL group forms: make `local_rank`'s GPU this process's current one and return the options that
    bind the group to it (device_id, where torch takes it). Nothing for gloo."""
    if backend != "nccl":
        return {}
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    return compat.nccl_device_options(device)


def _connect_output(rank, port):
    """Point file descriptors 1 and 2 at the launcher, so C-level output is captured too."""
    for stream in (1, 2):
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(f"{rank} {stream}\n".encode())
        os.dup2(sock.fileno(), stream)
        sock.close()
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8",
                                  errors="backslashreplace", line_buffering=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8",
                                  errors="backslashreplace", line_buffering=True)


# The anchor: a shell in the rank's group that outlives the rank. It keeps the group's id (the rank's pid) from
# naming anyone else while it lives (Linux reuses no pid that a live group still has as its id), so the launcher
# can kill the group after the rank itself is gone. If the control pipe closes while it lives, the launching
# process died (was killed): the anchor removes the launch's folder ($1), which that process can no longer
# remove, and kills the group. (At a launch's end the launcher kills the group before it closes the pipe.)
# Its stdout is the anchor pipe: the launcher sees it closed exactly when the anchor is gone.
_ANCHOR = 'while read -r _; do :; done; rm -rf -- "$1"; kill -9 0'


def _start_anchor(control_conn, anchor_conn, folder):
    """Spawn this rank's anchor (stdin: the control pipe; stdout: the anchor pipe), then drop our end of the latter."""
    if anchor_conn is None:
        return
    for fd in os.listdir("/proc/self/fd"):  # the pipes the forkserver passed us are inheritable: keep them here
        try:
            if int(fd) > 2:
                os.set_inheritable(int(fd), False)
        except OSError:
            pass
    try:
        os.posix_spawn("/bin/sh", ["sh", "-c", _ANCHOR, "sh", folder], os.environ, file_actions=[
            (os.POSIX_SPAWN_DUP2, control_conn.fileno(), 0), (os.POSIX_SPAWN_DUP2, anchor_conn.fileno(), 1),
            (os.POSIX_SPAWN_OPEN, 2, os.devnull, os.O_WRONLY, 0)])
    except OSError:
        pass  # no anchor: the pipe closes with this rank, and the launcher kills the group only while the rank lives
    anchor_conn.close()


def _exit_with_launcher(control_conn, folder=None):
    """Watchdog: when the launching process goes away, remove its launch's folder (it cannot any more) and take
    this rank's whole group with it (the anchor does the same: whichever wakes first)."""
    try:
        control_conn.recv()
    except (EOFError, OSError):
        pass
    if folder:
        shutil.rmtree(folder, ignore_errors=True)
    os.killpg(0, signal.SIGKILL)


def run_under_torchrun(fn, args, kwargs, backend):
    """torchrun started this process as one rank: run fn here and gather every rank's result."""
    created = not dist.is_initialized()
    if created:
        if backend == "auto":  # as launch() decides: NCCL only when each of this node's ranks has its own GPU
            backend = backend_for(int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"])))
        dist.init_process_group(backend, **_device_options(backend, int(os.environ.get("LOCAL_RANK", 0))))
    try:
        result = to_cpu(fn(*args, **kwargs))
        results = [None] * dist.get_world_size()
        dist.all_gather_object(results, result)
        return results
    finally:
        if created:
            # A DDP module that fn built is garbage in a reference cycle that still holds the
            # group; freed only at interpreter exit, gloo's threads then abort the process.
            gc.collect()
            dist.destroy_process_group()
