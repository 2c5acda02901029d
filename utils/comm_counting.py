"""What one communication call moves, recorded in every active ``ByteCounter`` (utils/bytecount.py).

The wrappers ``count_bytes()`` installs (with utils/comm_calls.py's ``_patched``): a point-to-point call is counted
exactly, the size of the tensor handed over, after its peer is checked; a built-in collective nominally, the
per-rank volume of the textbook algorithm in ``NOMINAL_ALGORITHM``. Every record names the process group the
call went through. A wrapped call made inside another (``dist.send`` ends in its group's ``send``) is counted
once.
"""

from __future__ import annotations

import functools
import inspect
import threading

import torch
import torch.distributed as dist

from .comm_calls import POINT_TO_POINT

# For a built-in collective the count is nominal: the per-rank volume of this textbook algorithm.
NOMINAL_ALGORITHM = {
    "all_reduce": "ring: 2(N-1)/N x M sent and received",
    "reduce_scatter": "ring: (N-1)/N x M (M = the full input) sent and received",
    "all_gather": "ring: (N-1)/N x M (M = the full output) sent and received",
    "all_to_all": "direct: (N-1)/N x M sent and received",
    "broadcast": "direct: root sends M to each other rank; others receive M",
    "reduce": "direct: each non-root sends M; root receives (N-1) x M",
    "gather": "direct: each non-root sends M; root receives (N-1) x M",
    "scatter": "direct: root sends M to each other rank; others receive M",
    "barrier": "no payload",
}


def tensor_bytes(tensor) -> int:
    """Bytes of a tensor's elements: numel x element size (what a send of it puts on the wire)."""
    return tensor.numel() * tensor.element_size()


_active_counters: list = []  # the ByteCounters of the count_bytes() blocks now open
_inside = threading.local()  # guards against counting a call twice when one wrapped call makes another


def _peer(bound, key):
    """The peer rank of a point-to-point call: dst/src, or group_dst/group_src."""
    peer = bound.arguments.get(key)
    if peer is None:
        peer = bound.arguments.get("group_" + key)
    return peer


def _nominal_volume(name, bound):
    """(sent, received) nominal bytes of one built-in collective on this rank (see NOMINAL_ALGORITHM)."""
    args = bound.arguments
    n = dist.get_world_size(args.get("group"))
    me = dist.get_rank(args.get("group"))

    def size(key):
        value = args[key]
        return sum(map(tensor_bytes, value)) if isinstance(value, (list, tuple)) else tensor_bytes(value)

    if name == "all_reduce":
        m = size("tensor")
        return 2 * (n - 1) * m // n, 2 * (n - 1) * m // n
    if name.startswith("reduce_scatter"):
        m = size("input_list" if "input_list" in args else "input")
    elif name.startswith("all_gather") and name != "all_gather_object":
        m = size("input_tensor" if "input_tensor" in args else "tensor") * n
    elif name.startswith("all_to_all"):
        m = size("input" if "input" in args else "input_tensor_list")
    elif name in ("broadcast", "scatter", "reduce", "gather"):
        root = next((args[k] for k in ("src", "dst", "group_src", "group_dst") if args.get(k) is not None), 0)
        m = size("tensor")  # the tensor each rank contributes or ends up with
        if name in ("broadcast", "scatter"):
            return ((n - 1) * m, 0) if me == root else (0, m)
        return (0, (n - 1) * m) if me == root else (m, 0)
    else:
        return 0, 0  # barrier and the object collectives: no tensor payload we can size
    return (n - 1) * m // n, (n - 1) * m // n


def _group_ranks(group):
    """The global ranks of a process group (None: the default group), or None where they cannot be told."""
    try:
        return tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
    except (RuntimeError, ValueError, AttributeError):  # a backend object, or a group this rank is not in
        return None


def _check_peer(label, key, peer, size, me, sending):
    """Refuse a peer that is no rank of the group, or the calling rank itself, before the backend sees it.

    gloo may crash or hang on a peer outside the group, and fails with "Pair is not connected" on itself.
    """
    if not 0 <= peer < size:
        raise ValueError(f"{label} with {key}={peer}: there is no rank {peer}, the ranks are "
                         f"0 … {size - 1}. Check how the peer rank is computed (a missing % N?).")
    if peer == me:
        raise ValueError(f"{label} with {key}={peer}: rank {me} {'sent to' if sending else 'received from'} "
                         "itself (gloo cannot: 'Pair is not connected'). Check how the peer rank is computed: "
                         "is a position among some of the ranks used as a rank?")


def _refuse_gaps(name, tensor):
    """Refuse a non-contiguous tensor as every backend should: gloo does, NCCL only warns and moves numel elements
    from the view's first one on (the wrong bytes, without an error)."""
    if isinstance(tensor, torch.Tensor) and not tensor.is_contiguous():
        raise ValueError(f"dist.{name} of a non-contiguous tensor (shape {tuple(tensor.shape)}, stride "
                         f"{tensor.stride()}): gloo refuses it and NCCL moves the wrong bytes without an error. "
                         "Send and receive contiguous tensors (.contiguous(); slices of a 1-D tensor are).")


def _existing_peer(name, bound, key):
    """The peer of a point-to-point call (None: any source), checked by `_check_peer`."""
    peer = _peer(bound, key)
    if peer is None:
        return None
    # dst/src are global ranks; group_dst/group_src count within the group
    group = None if bound.arguments.get(key) is not None else bound.arguments.get("group")
    _check_peer(f"dist.{name}", key, peer, dist.get_world_size(group), dist.get_rank(group),
                sending=name in ("send", "isend"))
    return peer


def _counting_wrapper(label, name, original):
    """Count ``dist.<name>``: point-to-point bytes exactly (its peer checked first), a collective's nominally."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        if getattr(_inside, "depth", 0) or not _active_counters:
            return original(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        sending = name in ("send", "isend")
        if name in POINT_TO_POINT:
            _refuse_gaps(name, bound.arguments["tensor"])
            peer = _existing_peer(name, bound, "dst" if sending else "src")
        _inside.depth = 1
        try:
            result = original(*args, **kwargs)
        finally:
            _inside.depth = 0
        group = _group_ranks(bound.arguments.get("group"))
        if name in POINT_TO_POINT:
            nbytes = tensor_bytes(bound.arguments["tensor"])
            if name == "recv" and peer is None:
                peer = result  # recv from any source returns the sender's rank
            for counter in _active_counters:
                counter.add(name, sent=nbytes if sending else 0, received=0 if sending else nbytes, peer=peer,
                            group=group)
        else:
            sent, received = _nominal_volume(name, bound)
            asynchronous = bool(bound.arguments.get("async_op", False))
            for counter in _active_counters:
                counter.add(name, sent=sent, received=received, nominal=True, asynchronous=asynchronous,
                            group=group)
        return result

    return wrapper


def _group_counting_wrapper(label, name, original):
    """Count a process group's send/recv called directly (not from inside a counted ``dist.<call>``)."""
    sending = name == "send"

    @functools.wraps(original)
    def wrapper(group, tensors, *args, **kwargs):
        if getattr(_inside, "depth", 0) or not _active_counters:
            return original(group, tensors, *args, **kwargs)
        peer = None
        if name != "recv_anysource":
            key = "dstRank" if sending else "srcRank"
            peer = args[0] if args else kwargs[key]
            _check_peer(label, key, peer, group.size(), group.rank(), sending)
        _inside.depth = 1
        try:
            result = original(group, tensors, *args, **kwargs)
        finally:
            _inside.depth = 0
        nbytes = sum(map(tensor_bytes, tensors))
        ranks = _group_ranks(group)
        for counter in _active_counters:
            counter.add(f"group.{name}", sent=nbytes if sending else 0, received=0 if sending else nbytes,
                        peer=peer, group=ranks)
        return result

    return wrapper
