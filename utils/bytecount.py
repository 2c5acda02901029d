"""Byte accounting for torch.distributed: count what each rank sends and receives.

Two context managers, both active only in the process (rank) that enters them:

- ``count_bytes()`` wraps the point-to-point calls (send, recv, isend, irecv — also when
  ``dist.batch_isend_irecv`` makes them) and the built-in collectives. Point-to-point bytes are exact: the
  size of the tensor handed to the call, on whatever device it lives. The counter cannot see inside
  a built-in collective, so for those it records a *nominal* volume: what the textbook algorithm named in
  ``NOMINAL_ALGORITHM`` moves per rank. The two are kept apart (``sent`` vs ``nominal_sent``).
  A point-to-point call naming a rank that does not exist raises a ``ValueError`` that says so (gloo
  itself may hang or crash on one).
- ``forbid_collectives()`` makes every built-in collective raise ``CollectiveForbiddenError``, so code run
  inside it provably communicates through point-to-point calls only.

Typical use inside a function run on every rank by ``utils.launch``::

    with bytecount.count_bytes() as counter, bytecount.forbid_collectives():
        my_all_reduce(tensor)
    return counter.summary()        # a plain dict, cheap to send back to the notebook
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import threading
from collections import defaultdict

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

# The calls whose bytes are exact: the tensor handed over is what travels.
POINT_TO_POINT = ("send", "recv", "isend", "irecv")

# Built-in collectives. Names missing from the installed torch are skipped.
COLLECTIVES = (
    "all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "all_gather_single",
    "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all", "all_to_all_single",
    "gather", "scatter", "barrier", "all_reduce_coalesced", "all_gather_coalesced",
    "broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list",
)

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

# The modules whose attributes user code reaches the calls through (``dist.send``, ``c10d.send``).
_MODULES = (dist, c10d)


def tensor_bytes(tensor) -> int:
    """Bytes of a tensor's elements: numel x element size (what a send of it puts on the wire)."""
    return tensor.numel() * tensor.element_size()


class CollectiveForbiddenError(RuntimeError):
    """Raised when a built-in collective is called inside ``forbid_collectives()``."""


class ByteCounter:
    """Per-rank record of communication calls. Fill it with ``count_bytes()``; read it with ``summary()``."""

    def __init__(self):
        self.records = []  # one dict per call: op, peer, sent, received, nominal

    def add(self, op, sent=0, received=0, peer=None, nominal=False):
        self.records.append(dict(op=op, peer=peer, sent=int(sent), received=int(received), nominal=nominal))

    def _total(self, key, nominal):
        return sum(r[key] for r in self.records if r["nominal"] == nominal)

    @property
    def sent(self) -> int:
        """Exact bytes handed to send/isend."""
        return self._total("sent", False)

    @property
    def received(self) -> int:
        """Exact bytes received through recv/irecv."""
        return self._total("received", False)

    @property
    def nominal_sent(self) -> int:
        """Nominal bytes sent by built-in collectives (see NOMINAL_ALGORITHM)."""
        return self._total("sent", True)

    @property
    def nominal_received(self) -> int:
        """Nominal bytes received by built-in collectives (see NOMINAL_ALGORITHM)."""
        return self._total("received", True)

    @property
    def messages_sent(self) -> int:
        """Number of send/isend calls: each one pays the per-message latency alpha."""
        return sum(1 for r in self.records if r["op"] in ("send", "isend"))

    @property
    def messages_received(self) -> int:
        """Number of recv/irecv calls."""
        return sum(1 for r in self.records if r["op"] in ("recv", "irecv"))

    def reset(self):
        """Forget everything recorded so far."""
        self.records.clear()

    def summary(self) -> dict:
        """A plain dict (picklable, printable) of totals, per-op and per-peer breakdowns."""
        by_op = defaultdict(lambda: dict(calls=0, sent=0, received=0))
        by_peer = defaultdict(lambda: dict(sent=0, received=0))
        for r in self.records:
            entry = by_op[r["op"]]
            entry["calls"] += 1
            entry["sent"] += r["sent"]
            entry["received"] += r["received"]
            if r["peer"] is not None and not r["nominal"]:
                by_peer[r["peer"]]["sent"] += r["sent"]
                by_peer[r["peer"]]["received"] += r["received"]
        return dict(
            sent=self.sent, received=self.received,
            nominal_sent=self.nominal_sent, nominal_received=self.nominal_received,
            messages_sent=self.messages_sent, messages_received=self.messages_received,
            by_op=dict(by_op), by_peer=dict(sorted(by_peer.items())),
        )


# ---------------------------------------------------------------------------------------------------------
# Patching machinery: replace ``dist.<name>`` (and the same name in distributed_c10d) for the duration of a
# ``with`` block, restoring whatever was there before, so the two context managers nest in any order.

_active_counters: list[ByteCounter] = []
_inside = threading.local()  # guards against counting a call twice when one wrapped call makes another


@contextlib.contextmanager
def _patched(names, make_wrapper):
    saved = []
    # One wrapper per function, installed under every module that holds it: ``dist.P2POp`` and
    # ``dist.batch_isend_irecv`` check ``op`` against distributed_c10d's own ``isend``/``irecv`` by identity.
    wrappers = {}
    try:
        for name in names:
            for module in _MODULES:
                original = getattr(module, name, None)
                if original is None:
                    continue
                saved.append((module, name, original))
                if (name, id(original)) not in wrappers:
                    wrappers[name, id(original)] = make_wrapper(name, original)
                setattr(module, name, wrappers[name, id(original)])
        yield
    finally:
        for module, name, original in reversed(saved):
            setattr(module, name, original)


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


def _existing_peer(name, bound, key):
    """The peer of a point-to-point call (None: any source); a ValueError if no such rank exists.

    gloo may crash or hang on a peer outside the group, so the mistake is named before the call.
    """
    peer = _peer(bound, key)
    if peer is None:
        return None
    # dst/src are global ranks; group_dst/group_src count within the group
    size = dist.get_world_size(None if bound.arguments.get(key) is not None else bound.arguments.get("group"))
    if not 0 <= peer < size:
        raise ValueError(f"dist.{name} with {key}={peer}: there is no rank {peer}, the ranks are "
                         f"0 … {size - 1}. Check how the peer rank is computed (a missing % N?).")
    return peer


def _counting_wrapper(name, original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        if getattr(_inside, "depth", 0) or not _active_counters:
            return original(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        sending = name in ("send", "isend")
        if name in POINT_TO_POINT:
            peer = _existing_peer(name, bound, "dst" if sending else "src")
        _inside.depth = 1
        try:
            result = original(*args, **kwargs)
        finally:
            _inside.depth = 0
        if name in POINT_TO_POINT:
            nbytes = tensor_bytes(bound.arguments["tensor"])
            if name == "recv" and peer is None:
                peer = result  # recv from any source returns the sender's rank
            for counter in _active_counters:
                counter.add(name, sent=nbytes if sending else 0, received=0 if sending else nbytes, peer=peer)
        else:
            sent, received = _nominal_volume(name, bound)
            for counter in _active_counters:
                counter.add(name, sent=sent, received=received, nominal=True)
        return result

    return wrapper


@contextlib.contextmanager
def count_bytes():
    """Count bytes this rank sends and receives inside the block; yields a ``ByteCounter``.

    Point-to-point counts are exact; built-in collectives are counted as nominal (see NOMINAL_ALGORITHM).
    A byte is counted when the call is made (for isend/irecv: when posted, not when completed).
    """
    counter = ByteCounter()
    _active_counters.append(counter)
    try:
        with _patched(POINT_TO_POINT + COLLECTIVES, _counting_wrapper):
            yield counter
    finally:
        _active_counters.remove(counter)


def _forbidding_wrapper(name, original):
    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        raise CollectiveForbiddenError(
            f"dist.{name} was called inside forbid_collectives(): "
            "this code must communicate with send/recv/isend/irecv only"
        )

    return wrapper


@contextlib.contextmanager
def forbid_collectives():
    """Make every built-in collective raise ``CollectiveForbiddenError`` inside the block.

    Covers ``dist.<collective>``, ``torch.distributed.distributed_c10d.<collective>`` and the
    ``utils.collectives`` shims (if loaded). Point-to-point calls keep working.
    """
    shims = sys.modules.get("utils.collectives")
    shim_names = [n for n in ("all_gather_single", "reduce_scatter_single") if shims and hasattr(shims, n)]
    saved = [(n, getattr(shims, n)) for n in shim_names]
    try:
        for n in shim_names:
            setattr(shims, n, _forbidding_wrapper(n, getattr(shims, n)))
        with _patched(COLLECTIVES, _forbidding_wrapper):
            yield
    finally:
        for n, original in saved:
            setattr(shims, n, original)
