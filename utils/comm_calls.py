"""torch's communication calls, where user code finds them, and how to replace them for a ``with`` block.

utils/bytecount.py's two context managers are built on this: ``count_bytes()`` installs counting wrappers
(utils/comm_counting.py), ``forbid_collectives()`` raising ones. A call is replaced where user code finds it —
``dist.<name>`` (and the same name in distributed_c10d), a process-group class's method, an operator under
``torch.ops`` — for the duration of the block, and whatever was there before is restored, so the two context
managers nest in any order.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch._C import _distributed_c10d as _c10d_classes

# The calls whose bytes are exact: the tensor handed over is what travels.
POINT_TO_POINT = ("send", "recv", "isend", "irecv")

# Built-in collectives. Names missing from the installed torch are skipped.
COLLECTIVES = (
    "all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "all_gather_single",
    "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all", "all_to_all_single",
    "gather", "scatter", "barrier", "all_reduce_coalesced", "all_gather_coalesced",
    "broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list",
)

# The modules whose attributes user code reaches the calls through (``dist.send``, ``c10d.send``).
_MODULES = (dist, c10d)

# The same calls as methods of a process group (``dist.group.WORLD.allreduce([t])``) and of its backends
# (``group._get_backend(device).allreduce([t])``): every ``dist.<call>`` ends in one of them.
GROUP_POINT_TO_POINT = ("send", "recv", "recv_anysource")
GROUP_COLLECTIVES = (
    "allreduce", "allreduce_coalesced", "allgather", "allgather_coalesced", "allgather_into_tensor_coalesced",
    "_allgather_base", "all_gather_single", "all_gather_single_coalesced", "reduce_scatter",
    "reduce_scatter_single", "reduce_scatter_single_coalesced", "reduce_scatter_tensor_coalesced",
    "_reduce_scatter_base", "alltoall", "alltoall_base", "all_to_all_single", "broadcast", "reduce", "gather",
    "scatter", "barrier", "monitored_barrier",
)

# Operator namespaces through which communication can be called directly (``torch.ops.c10d.allreduce_``);
# the functional collectives (torch.distributed._functional_collectives) call ``_c10d_functional``'s.
# Inside forbid_collectives() every operator there raises, except these two, which move nothing.
OP_NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd")
NOT_COMMUNICATION = ("check_for_nan", "wait_tensor")


def _module_targets(names):
    """(holder, name, label) for ``dist.<name>`` and ``distributed_c10d.<name>``, where they exist."""
    return [(module, name, f"dist.{name}") for name in names for module in _MODULES
            if getattr(module, name, None) is not None]


def _group_classes():
    """ProcessGroup, Backend and every subclass of them (ProcessGroupGloo, ProcessGroupNCCL, ...)."""
    found, todo = [], [_c10d_classes.ProcessGroup, _c10d_classes.Backend]
    while todo:
        cls = todo.pop()
        if cls not in found:
            found.append(cls)
            todo += cls.__subclasses__()
    return found


def _method_targets(names):
    """(class, name, label) for every process-group class that defines one of `names` itself."""
    return [(cls, name, f"{cls.__name__}.{name}") for cls in _group_classes() for name in names
            if name in vars(cls)]


def _op_targets():
    """(namespace, op, label) for every communication operator under OP_NAMESPACES."""
    ops = set()
    for qualified in getattr(torch._C, "_dispatch_get_all_op_names", list)():  # a private API: may go
        namespace, _, op = qualified.partition("::")
        op = op.split(".")[0]
        if namespace in OP_NAMESPACES and op not in NOT_COMMUNICATION:
            ops.add((namespace, op))
    return [(getattr(torch.ops, namespace), op, f"torch.ops.{namespace}.{op}") for namespace, op in sorted(ops)]


@contextlib.contextmanager
def _patched(targets, make_wrapper):
    """Install make_wrapper(label, name, original) at every (holder, name, label) of `targets`."""
    saved = []
    # One wrapper per function, installed under every holder of it: ``dist.P2POp`` and
    # ``dist.batch_isend_irecv`` check ``op`` against distributed_c10d's own ``isend``/``irecv`` by identity.
    wrappers = {}
    try:
        for holder, name, label in targets:
            original = vars(holder)[name] if isinstance(holder, type) else getattr(holder, name)
            saved.append((holder, name, original))
            if id(original) not in wrappers:
                wrappers[id(original)] = make_wrapper(label, name, original)
            setattr(holder, name, wrappers[id(original)])
        yield
    finally:
        for holder, name, original in reversed(saved):
            setattr(holder, name, original)
