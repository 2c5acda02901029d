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

Behind them: utils/comm_calls.py (the calls, where they are found, how they are replaced for a block) and
utils/comm_counting.py (what one call moves, and the checks on its peer).
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections import defaultdict

# The call names, NOMINAL_ALGORITHM, tensor_bytes and _module_targets are imported from here too.
from .comm_calls import (COLLECTIVES, GROUP_COLLECTIVES, GROUP_POINT_TO_POINT, NOT_COMMUNICATION,  # noqa: F401
                         OP_NAMESPACES, POINT_TO_POINT, _method_targets, _module_targets, _op_targets, _patched)
from .comm_counting import (NOMINAL_ALGORITHM, _active_counters, _counting_wrapper,  # noqa: F401
                            _group_counting_wrapper, _inside, tensor_bytes)

# Record names of the calls that put one message on the wire, or take one off it.
_SENDS = ("send", "isend", "group.send", "c10d.send")
_RECEIVES = ("recv", "irecv", "group.recv", "group.recv_anysource", "c10d.recv_")


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
        """The sum of `key` over the exact records (nominal=False) or the nominal ones."""
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
    """A stand-in for `original` that raises ``CollectiveForbiddenError`` naming `label`."""
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
