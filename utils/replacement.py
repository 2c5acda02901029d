"""Replace one dead rank while the others keep their state: the rank's side of `launch(..., replace=N)`.

In data parallelism every replica holds the whole training state, so a new process that takes a dead rank's
place can be filled over the network by a survivor instead of from storage (the idea behind torchft and
in-memory checkpoints). The launcher starts the new process (utils/launching.py); here is what the ranks need:

    generation()                  0 in a launch's first ranks; n in the n-th replacement process
    group(generation, timeout)    a fresh gloo group of all ranks, on its own part of the launch's store:
                                  .all_reduce(t), .broadcast(t, root), and .tear_down() once it is broken

A group cannot take in a new process, so after a death every rank forms the group of the next generation: the
survivors when their collective fails, the newcomer at once. Each generation's group finds its peers under its
own key prefix in the store ("generation1/…"), so nothing written for the dead group is read again.
"""
from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as dist

from . import compat
from .rank_process import GENERATION

_kept = []  # groups abandoned where tearing them down can hang (utils/compat.py): never destroyed


def generation() -> int:
    """How many times this rank's process was replaced before it (0 for a launch's first ranks)."""
    return int(os.environ.get(GENERATION, "0"))


class Group:
    """A gloo group of every rank for one generation, with the two collectives recovery needs."""

    def __init__(self, generation: int, timeout: float):
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=timedelta(seconds=timeout))
        self.generation = generation
        self.rank, self.size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        self._pg = dist.ProcessGroupGloo(dist.PrefixStore(f"generation{generation}/", store), self.rank,
                                         self.size, timedelta(seconds=timeout))

    def all_reduce(self, tensor):
        """Sum `tensor` over every rank, in place (raises RuntimeError when a peer is gone or times out)."""
        self._pg.allreduce([tensor]).wait()

    def broadcast(self, tensor, root: int):
        """Copy rank `root`'s `tensor` into every rank's, in place."""
        options = dist.BroadcastOptions()
        options.rootRank = root
        self._pg.broadcast([tensor], options).wait()

    def tear_down(self):
        """End this group after a failure: its connections close, so a survivor still waiting in it fails too.

        Not every survivor sees a death: in a ring, a rank that waits for a *living* neighbour keeps waiting
        until that neighbour closes its connection. Where destroying a gloo group can hang (before torch 2.8),
        the group is kept instead and such a survivor waits for the group's timeout.
        """
        if self._pg is None:
            return
        if compat.GLOO_DESTROY_CAN_HANG:
            _kept.append(self._pg)
        elif hasattr(self._pg, "shutdown"):
            self._pg.shutdown()
        self._pg = None               # the last reference: the destructor closes the connections


def group(generation: int, timeout: float = 30.0) -> Group:
    """A new gloo group of every rank of this launch, for generation `generation`; returns once all joined.

    `timeout` (seconds) bounds both the wait for the others to join and every collective on the group.
    """
    if "MASTER_PORT" not in os.environ or "RANK" not in os.environ:
        raise RuntimeError("replacement.group() runs inside a rank that utils.launch(..., replace=N) started.")
    return Group(generation, timeout)
