"""The rank's side of a pool (utils/pool.py): a server that runs the cells the notebook sends, in one namespace.

Each rank keeps its variables between cells, takes from the notebook only the names it lacks, counts the
collectives it runs on the default group (the pool restarts when the counts part), refuses a collective that
needs a rank not running the cell (`--ranks`), and turns what cannot leave the rank into what can.
"""
from __future__ import annotations

import builtins
import ctypes
import functools
import inspect
import os
import signal
import socket
import sys
import types
from multiprocessing.connection import Connection

import cloudpickle
import torch
import torch.distributed as dist

from .cells import run_cell_source
from .launching import device
from .shipping import describe_exception as _describe_exception
from .shipping import dumps
from .shipping import to_cpu as _to_cpu

_MARK = "\x00end of cell "  # what a rank writes on stdout and stderr after each cell

# Collectives every rank of the default group must call; they are counted per rank.
_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "all_gather_object",
                "broadcast", "broadcast_object_list", "reduce", "reduce_scatter", "reduce_scatter_tensor",
                "reduce_scatter_single", "all_to_all", "all_to_all_single", "barrier", "monitored_barrier",
                "gather", "gather_object", "scatter", "scatter_object_list", "new_group")
_POINT_TO_POINT = ("send", "recv", "isend", "irecv")


def _ranks_text(ranks):
    return ", ".join(map(str, ranks))


def _rss(pid):
    """Resident memory of a process, e.g. '412.3 MiB (RSS)', read from /proc."""
    try:
        with open(f"/proc/{pid}/status") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration, TypeError):
        return "?"
    return f"{kib / 1024:.1f} MiB (RSS)"


class _RankState:
    """What a rank's server knows about the cell it runs and the collectives it made."""

    def __init__(self):
        self.count = 0           # default-group collectives run so far
        self.ranks = None        # ranks running the current cell when not all of them
        self.in_cell = False     # True while the cell's own code runs (SIGINT interrupts only then)
        self.interrupted_inside = False


def _serve(port):
    """A rank's loop: run each cell the notebook sends in this rank's namespace, until told to stop."""
    sock = socket.create_connection(("127.0.0.1", port))
    conn = Connection(sock.detach())
    state = _RankState()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    _count_collectives(state, world_size)

    def on_sigint(signum, frame):
        if state.in_cell:
            raise KeyboardInterrupt
    signal.signal(signal.SIGINT, on_sigint)
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    conn.send(("hello", rank, os.getpid(), str(device())))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            os._exit(0)
        if message[0] == "stop":
            return None
        if message[0] == "run":
            conn.send(_run(state, namespace, *message[1:]))
        elif message[0] == "get":
            conn.send(("answer", _look_up(namespace, message[1])))
        elif message[0] == "memory":
            conn.send(("answer", _memory()))


def _run(state, namespace, cell, source, payload, ranks):
    """Run one cell; the reply says how it ended, what the rank now holds, and its collective count."""
    status, inside = "ok", False
    state.ranks = None if len(ranks) == dist.get_world_size() else set(ranks)
    state.interrupted_inside = False
    try:
        _adopt(cloudpickle.loads(payload), namespace)
        state.in_cell = True
        value = run_cell_source(source, namespace)
        state.in_cell = False
        body = _travel(value)
    except BaseException as exc:  # noqa: BLE001 — reported to the notebook; the rank lives on
        state.in_cell = False
        status = "interrupted" if isinstance(exc, KeyboardInterrupt) else "error"
        inside = state.interrupted_inside
        body = _describe_exception(exc)
    state.ranks = None
    sys.stdout.flush()
    sys.stderr.flush()
    _flush_c_stdio()
    for fd in (1, 2):
        os.write(fd, (_MARK + str(cell) + "\n").encode())
    keys = sorted(k for k in namespace if not k.startswith("__"))
    return ("done", cell, status, body, keys, state.count, inside)


def _flush_c_stdio():
    """C-level output (printf in a library) still buffered in this process."""
    try:
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):
        pass


def _adopt(shipped, namespace):
    """Take the notebook's values this rank lacks; bind shipped functions to the rank's namespace.

    A notebook function travels with a copy of the globals it reads. Re-made with the rank's
    namespace as its globals, it sees the rank's own variables, as the cell's code does.
    """
    todo = [(k, v) for k, v in shipped.items() if k not in namespace]
    while todo:
        name, value = todo.pop()
        if name in namespace:
            continue
        if _shipped_function(value):
            todo.extend((k, v) for k, v in value.__globals__.items()
                        if not k.startswith("__") and k not in namespace and k != name)
            value = _rebind(value, namespace)
        namespace[name] = value


def _shipped_function(value):
    """A plain function that travelled by value (its globals are not a real module's)."""
    if not isinstance(value, types.FunctionType):
        return False
    module = sys.modules.get(value.__module__)
    return module is None or value.__globals__ is not vars(module)


def _rebind(fn, namespace):
    new = types.FunctionType(fn.__code__, namespace, fn.__name__, fn.__defaults__, fn.__closure__)
    new.__kwdefaults__, new.__qualname__, new.__doc__ = fn.__kwdefaults__, fn.__qualname__, fn.__doc__
    new.__dict__.update(fn.__dict__)
    return new


def _travel(value):
    """(pickled value, note): tensors to the CPU; what cannot leave the rank replaced by what can."""
    value = _to_cpu(value)
    if isinstance(value, torch.nn.parallel.DistributedDataParallel):
        return dumps(_cpu_state(value.module)), ("a DistributedDataParallel module cannot leave its rank: "
                                                 "its module's state_dict() came instead (tensors on the CPU)")
    if isinstance(value, torch.nn.Module) and any(t.device.type != "cpu" for t in value.state_dict().values()):
        return dumps(_cpu_state(value)), "a module on a GPU: its state_dict() came instead (tensors on the CPU)"
    try:
        return dumps(value), None
    except Exception as exc:  # noqa: BLE001
        why = f"{type(value).__name__} cannot leave its rank ({type(exc).__name__})"
        if callable(getattr(value, "state_dict", None)):
            try:
                return dumps(_cpu_state(value)), why + ": its state_dict() came instead (tensors on the CPU)"
            except Exception:  # noqa: BLE001
                pass
        return dumps(repr(value)), why + ": its repr() came instead"


def _cpu_state(obj):
    return {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in obj.state_dict().items()}


def _look_up(namespace, name):
    if name not in namespace:
        return False, None, None
    body, note = _travel(namespace[name])
    return True, body, note


def _memory():
    text = _rss(os.getpid())
    if torch.cuda.is_available() and dist.get_backend() == "nccl":
        text += f", {torch.cuda.memory_allocated() / 2**20:.1f} MiB CUDA allocated"
    return text


def _count_collectives(state, world_size):
    """Wrap torch.distributed's collectives in this rank: count them, check them against --ranks."""
    def wrap(name, fn, point_to_point):
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def counted(*args, **kwargs):
            try:
                arguments = signature.bind_partial(*args, **kwargs).arguments
            except TypeError:
                arguments = {}
            group = arguments.get("group")
            default = group is None or group is dist.GroupMember.WORLD
            if state.ranks is not None and default:
                _refuse(name, arguments, state.ranks, world_size, point_to_point)
            if default and not point_to_point:
                state.count += 1
            try:
                return fn(*args, **kwargs)
            except KeyboardInterrupt:
                state.interrupted_inside = True
                raise

        return counted

    c10d = dist.distributed_c10d
    for names, point_to_point in ((_COLLECTIVES, False), (_POINT_TO_POINT, True)):
        for name in names:
            fn = getattr(dist, name, None)
            if fn is not None and not getattr(fn, "_pool_counted", False):
                wrapped = wrap(name, fn, point_to_point)
                wrapped._pool_counted = True
                setattr(dist, name, wrapped)
                # dist.P2POp (used by batch_isend_irecv) accepts only distributed_c10d's own isend/irecv, by
                # identity: the wrapper must stand there too, or a ring built on P2POp fails in a pool cell
                if name in ("isend", "irecv") and getattr(c10d, name, None) is fn:
                    setattr(c10d, name, wrapped)


def _refuse(name, arguments, ranks, world_size, point_to_point):
    """A cell run with --ranks calls what needs a rank that is not running it: fail now, not hang."""
    idle = sorted(set(range(world_size)) - ranks)
    running = _ranks_text(sorted(ranks))
    if point_to_point:
        peer = arguments.get("dst", arguments.get("src"))
        if peer is None or peer in ranks:
            return
        raise RuntimeError(f"dist.{name} with rank {peer}, which is not running this cell (it runs on ranks "
                           f"{running} only, --ranks): it would wait forever.")
    raise RuntimeError(f"dist.{name} on the default group needs all {world_size} ranks, but this cell runs on "
                       f"ranks {running} only (--ranks): ranks {_ranks_text(idle)} would never join, so it would "
                       f"hang. Run it on every rank, or on a group of these ranks made with dist.new_group "
                       f"in a cell that every rank runs.")
