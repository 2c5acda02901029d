"""Byte accounting for torch.distributed: count what each rank sends and receives.

Two context managers, both active only in the process (rank) that enters them:

- ``count_bytes()`` wraps the point-to-point calls (send, recv, isend, irecv — also when
  ``dist.batch_isend_irecv`` makes them) and the built-in collectives. Point-to-point bytes are exact: the
  size of the tensor handed to the call, on whatever device it lives. The counter cannot see inside
  a built-in collective, so for those it records a *nominal* volume: what the textbook algorithm named in
  ``NOMINAL_ALGORITHM`` moves per rank. The two are kept apart (``sent`` vs ``nominal_sent``).
  A process group's own ``send``/``recv`` methods (what every ``dist.send`` ends in) are counted too, so a
  call that reaches them another way (``dist.group.WORLD.send(...)``, or a ``send`` imported before the
  block) is not missed. A point-to-point call naming a rank that does not exist, or the calling rank
  itself, raises a ``ValueError`` that says so (gloo itself may hang, crash, or report "Pair is not
  connected"), and so does one handed a non-contiguous tensor (gloo refuses it; NCCL moves the wrong bytes).
- ``forbid_collectives()`` makes every built-in collective raise ``CollectiveForbiddenError``, however it is
  reached: ``dist.<name>``, a name imported before the block (``from torch.distributed import all_reduce``),
  the methods of a process group and of its backends (``dist.group.WORLD.allreduce([t])``), and the
  operators under ``torch.ops.c10d`` and ``torch.ops._c10d_functional`` (the functional collectives; their
  point-to-point operators too, which the counter cannot see). Code run inside it provably communicates
  through the counted point-to-point calls only — short of deliberate tampering with this module.

Every record names the process group it went through (``group``: the tuple of its global ranks), so
``summary()["by_group"]`` tells, e.g., HSDP's all-reduce across "nodes" from its all-gathers inside one.

What the Python-level patches cannot see: communication that torch starts in C++ — plain
``DistributedDataParallel``'s reducer (its gradient all-reduce) and its parameter broadcast at construction.
``count_bytes(cpp_calls=True)`` counts those too: a dispatch mode (``torch.utils._python_dispatch``) sees every
``c10d`` operator this thread dispatches, and records the ones no patched Python call is already counting —
nominal volumes again, under the operator's name (``c10d.allreduce_``). It slows every operator in the block
(each passes through Python), so count a few steps, not a timed run. The mode is thread-local: a collective
that a DDP communication hook starts in a future's callback (on a backend thread) is counted by the Python
patches instead, as any ``dist.<name>`` call.

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

# Record names of the calls that put one message on the wire, or take one off it.
_SENDS = ("send", "isend", "group.send", "c10d.send")
_RECEIVES = ("recv", "irecv", "group.recv", "group.recv_anysource", "c10d.recv_")


def tensor_bytes(tensor) -> int:
    """Bytes of a tensor's elements: numel x element size (what a send of it puts on the wire)."""
    return tensor.numel() * tensor.element_size()


class CollectiveForbiddenError(RuntimeError):
    """Raised when a built-in collective is called inside ``forbid_collectives()``."""


class ByteCounter:
    """Per-rank record of communication calls. Fill it with ``count_bytes()``; read it with ``summary()``."""

    def __init__(self):
        self.records = []  # one dict per call: op, peer, sent, received, nominal, asynchronous, group

    def add(self, op, sent=0, received=0, peer=None, nominal=False, asynchronous=False, group=None):
        """Record one call. `asynchronous`: a collective called with async_op=True (it returned at once);
        `group`: the global ranks of the process group it went through (None: not known)."""
        self.records.append(dict(op=op, peer=peer, sent=int(sent), received=int(received), nominal=nominal,
                                 asynchronous=asynchronous, group=None if group is None else tuple(group)))

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
        return sum(1 for r in self.records if r["op"] in _SENDS)

    @property
    def messages_received(self) -> int:
        """Number of recv/irecv calls."""
        return sum(1 for r in self.records if r["op"] in _RECEIVES)

    def reset(self):
        """Forget everything recorded so far."""
        self.records.clear()

    def summary(self) -> dict:
        """A plain dict (picklable, printable) of totals, per-op, per-peer and per-group breakdowns.

        ``by_group`` maps a group's global ranks (a tuple) to its calls and its exact and nominal bytes.
        """
        by_op = defaultdict(lambda: dict(calls=0, sent=0, received=0))
        by_peer = defaultdict(lambda: dict(sent=0, received=0))
        by_group = defaultdict(lambda: dict(calls=0, sent=0, received=0, nominal_sent=0, nominal_received=0))
        for r in self.records:
            group = by_group[r["group"]]
            group["calls"] += 1
            prefix = "nominal_" if r["nominal"] else ""
            group[prefix + "sent"] += r["sent"]
            group[prefix + "received"] += r["received"]
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
            by_group=dict(sorted(by_group.items(), key=lambda item: (item[0] is None, item[0] or ()))),
        )


# ---------------------------------------------------------------------------------------------------------
# Patching machinery: replace a call where user code finds it — ``dist.<name>`` (and the same name in
# distributed_c10d), a process-group class's method, an operator under ``torch.ops`` — for the duration of a
# ``with`` block, restoring whatever was there before, so the two context managers nest in any order.

_active_counters: list[ByteCounter] = []
_inside = threading.local()  # guards against counting a call twice when one wrapped call makes another


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


@contextlib.contextmanager
def count_bytes(cpp_calls: bool = False):
    """Count bytes this rank sends and receives inside the block; yields a ``ByteCounter``.

    Point-to-point counts are exact; built-in collectives called as ``dist.<name>`` are counted as nominal
    (see NOMINAL_ALGORITHM); a process group's send/recv methods called directly are counted as
    ``group.send``/``group.recv`` (peer: the rank within that group).
    A byte is counted when the call is made (for isend/irecv: when posted, not when completed).
    `cpp_calls`: also count the communication torch starts in C++ (plain DDP's all-reduce): see the
    module's docstring. Off by default: it makes every operator in the block slower.
    """
    counter = ByteCounter()
    _active_counters.append(counter)
    try:
        with _patched(_module_targets(POINT_TO_POINT + COLLECTIVES), _counting_wrapper), \
                _patched(_method_targets(GROUP_POINT_TO_POINT), _group_counting_wrapper), \
                (_cpp_calls_mode(counter) if cpp_calls else contextlib.nullcontext()):
            yield counter
    finally:
        _active_counters.remove(counter)


def _cpp_calls_mode(counter):
    """Count into `counter` the ``c10d`` operators this thread dispatches outside a counted Python call."""
    from . import dispatched_comms

    def record(op, sent, received, group, peer, exact):
        counter.add(op, sent=sent, received=received, peer=peer, nominal=not exact, group=group)

    return dispatched_comms.observe(record, skip=lambda: getattr(_inside, "depth", 0))


def _forbidding_wrapper(label, name, original):
    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        raise CollectiveForbiddenError(
            f"{label} was called inside forbid_collectives(): "
            "this code must communicate with send/recv/isend/irecv only"
        )

    return wrapper


@contextlib.contextmanager
def forbid_collectives():
    """Make every built-in collective raise ``CollectiveForbiddenError`` inside the block.

    Covers ``dist.<collective>``, ``torch.distributed.distributed_c10d.<collective>``, the ``utils.compat``
    shims (if loaded), the collective methods of every process-group and backend class (which also catches
    a collective imported by name before the block), and the operators under OP_NAMESPACES.
    ``dist.send``/``recv``/``isend``/``irecv`` and a process group's ``send``/``recv`` keep working.
    """
    shims = sys.modules.get("utils.compat")
    shim_names = [n for n in ("all_gather_single", "reduce_scatter_single") if shims and hasattr(shims, n)]
    saved = [(n, getattr(shims, n)) for n in shim_names]
    try:
        for n in shim_names:
            setattr(shims, n, _forbidding_wrapper(f"utils.compat.{n}", n, getattr(shims, n)))
        with _patched(_module_targets(COLLECTIVES), _forbidding_wrapper), \
                _patched(_method_targets(GROUP_COLLECTIVES), _forbidding_wrapper), \
                _patched(_op_targets(), _forbidding_wrapper):
            yield
    finally:
        for n, original in saved:
            setattr(shims, n, original)
