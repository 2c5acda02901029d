"""See the communication torch dispatches itself: the ``c10d`` operators, whoever calls them.

Every ``dist.<collective>`` ends in a ``c10d`` operator (``torch.ops.c10d.allreduce_``), and so does what torch
starts in C++, out of reach of a Python-level patch: plain ``DistributedDataParallel``'s reducer all-reduces its
gradient buckets there, and broadcasts rank 0's parameters when it is built. A dispatch mode
(``torch.utils._python_dispatch.TorchDispatchMode``) is shown every operator this thread dispatches, these too:

    with observe(record, skip=lambda: False):
        ddp_model(x).sum().backward()     # record("c10d.allreduce_", sent, received, group=(0, 1, 2, 3), ...)

Volumes are nominal, as utils.bytecount counts a built-in collective: what the textbook algorithm moves per rank
(all-reduce: ring 2(N−1)/N·M; all-gather and reduce-scatter: (N−1)/N·M of the full tensor; broadcast: the root
sends (N−1)·M, the others receive M); a ``send``/``recv_`` is exact. Operators not listed in VOLUMES are recorded
with no bytes. The mode is thread-local (a future's callback on a backend thread is not seen) and slows every
operator in the block, since each passes through Python.
"""
from __future__ import annotations

import contextlib

import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["observe", "VOLUMES"]


def _nbytes(value) -> int:
    """Bytes of a tensor, or of the tensors in a (nested) list of them."""
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return value.numel() * value.element_size()


# operator → (argument holding M, how M relates to it, algorithm): the per-rank nominal volume
VOLUMES = {
    "allreduce_": ("tensors", "all_reduce"),
    "allreduce_coalesced_": ("tensors", "all_reduce"),
    "_allgather_base_": ("output_tensor", "gather_like"),
    "allgather_": ("input_tensors", "gather_input"),
    "allgather_into_tensor_coalesced_": ("outputs", "gather_like"),
    "_reduce_scatter_base_": ("input_tensor", "gather_like"),
    "reduce_scatter_": ("input_tensors", "gather_like"),
    "reduce_scatter_tensor_coalesced_": ("inputs", "gather_like"),
    "alltoall_base_": ("input", "gather_like"),
    "broadcast_": ("tensors", "broadcast"),
    "send": ("tensors", "send"),
    "recv_": ("tensors", "recv"),
}


def _group_of(func, args):
    """The global ranks of the process group an operator was called on, or None."""
    for argument, value in zip(func._schema.arguments, args):
        if "ProcessGroup" in str(argument.type):
            try:
                return tuple(dist.get_process_group_ranks(dist.ProcessGroup.unbox(value)))
            except (RuntimeError, ValueError, AttributeError):
                return None
    return None


def volume(func, args, n: int, me: int) -> tuple[int, int, int | None]:
    """(sent, received, peer) of one ``c10d`` operator on this rank: nominal, except send/recv (exact)."""
    name = func._schema.name.split("::")[-1]
    if name not in VOLUMES:
        return 0, 0, None
    key, kind = VOLUMES[name]
    values = dict(zip((a.name for a in func._schema.arguments), args))
    m = _nbytes(values[key])
    if kind == "all_reduce":
        return 2 * (n - 1) * m // n, 2 * (n - 1) * m // n, None
    if kind == "gather_input":
        m *= n
    if kind in ("gather_like", "gather_input"):
        return (n - 1) * m // n, (n - 1) * m // n, None
    if kind == "broadcast":
        root = values.get("root_rank", 0)
        return ((n - 1) * m, 0, None) if me == root else (0, m, None)
    if kind == "send":
        return m, 0, values.get("dstRank")
    return 0, m, values.get("srcRank")


class _Mode(TorchDispatchMode):
    def __init__(self, record, skip):
        super().__init__()
        self.record, self.skip = record, skip

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d" and not self.skip():
            group = _group_of(func, args)
            n = len(group) if group is not None else dist.get_world_size()
            me = group.index(dist.get_rank()) if group is not None else dist.get_rank()
            sent, received, peer = volume(func, args, n, me)
            name = func._schema.name.split("::")[-1]
            self.record(f"c10d.{name}", sent, received, group=group, peer=peer, exact=name in ("send", "recv_"))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def observe(record, skip):
    """Call ``record(op, sent, received, group=, peer=, exact=)`` for each ``c10d`` operator dispatched in this
    thread inside the block, unless ``skip()`` is true then (a caller already counting it)."""
    with _Mode(record, skip):
        yield
