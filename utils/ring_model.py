"""The α–β–γ cost model of a ring all-reduce, plain or pipelined, worked out piece by piece.

Lesson 03's ring moves its tensor of M bytes in 2(N−1) steps of one chunk (M/N bytes) each; the
pipelined ring cuts every chunk into `pieces` equal pieces. The model:

- a message of b bytes occupies the sender's link for α + b·β, and each rank's link carries one
  message at a time (α is paid in series, once per message: the pessimistic reading, since
  messages in flight together can hide part of their latency);
- a rank adds one received piece at a time, b·γ seconds for b bytes, on hardware of its own
  (the model lets adding and sending overlap; on a CPU where both use the same cores they cannot);
- piece k of step g+1 can leave once piece k of step g has arrived and, in a reduce-scatter step
  (g < N−1), been added; the link sends pieces in order, step by step.

Every rank does the same thing at the same time, so one rank's timeline is the whole story: what
it receives from its left neighbour arrives when its own matching send ends.

    timeline = ring_timeline(n=4, nbytes=64e6, pieces=4, alpha=10e-6, beta=1 / 25e9, gamma=1 / 25e9)
    finish(timeline)        # seconds until the all-reduce is done
"""
from __future__ import annotations

from typing import NamedTuple


class Interval(NamedTuple):
    """One busy interval of a rank: `kind` 'send' (its link) or 'add' (its adder), for piece `piece` of step `step`."""
    kind: str
    step: int
    piece: int
    start: float
    end: float


def ring_timeline(n: int, nbytes: float, pieces: int, alpha: float, beta: float,
                  gamma: float) -> list[Interval]:
    """One rank's sends and adds, in time order, for a ring all-reduce of `nbytes` on `n` ranks.

    `pieces` = 1 is the plain ring (each step: send a whole chunk, then add it); more pieces is the
    pipelined ring. Chunks and pieces are taken as equal (nbytes / n / pieces bytes each).
    """
    if n < 2 or pieces < 1:
        raise ValueError("ring_timeline needs n >= 2 ranks and pieces >= 1")
    piece_bytes = nbytes / n / pieces
    ready = [0.0] * pieces         # when piece k of the current step may leave
    link_free = adder_free = 0.0
    timeline = []
    for step in range(2 * (n - 1)):
        arrived = []
        for k in range(pieces):    # the link sends this step's pieces one after another
            start = max(link_free, ready[k])
            link_free = start + alpha + piece_bytes * beta
            timeline.append(Interval("send", step, k, start, link_free))
            arrived.append(link_free)
        for k in range(pieces):
            if step < n - 1:       # reduce-scatter: add the piece before it may move on
                start = max(adder_free, arrived[k])
                adder_free = start + piece_bytes * gamma
                timeline.append(Interval("add", step, k, start, adder_free))
                ready[k] = adder_free
            else:                  # all-gather: forward it as it is
                ready[k] = arrived[k]
    return sorted(timeline, key=lambda interval: interval.start)


def finish(timeline: list[Interval]) -> float:
    """When the last interval of a timeline ends: the all-reduce's time in the model."""
    return max(interval.end for interval in timeline)
