"""Lab 1's traffic rules: which peers, how many messages and how many bytes each algorithm must move per rank.

Shared by lab 1's checks (lab1.py) and the grader's verdicts: `traffic_problems` applies them to one case.
  - reduce-scatter and all-gather run around a ring (`ring_peers`): rank r sends only to r+1 and receives only
    from r-1 (mod N), in at most N-1 messages, and moves exactly M minus one chunk each way at every length
    (`ring_bytes`; (N-1)/N × M when N divides the length, `scatter_gather_bytes`);
  - halving-doubling follows the lab's fold rule: partners (`halving_doubling_peers`), messages, and bytes
    (`halving_doubling_bytes` per rank where N and p divide the length, `halving_doubling_total_bytes` for all
    ranks together at every length).
"""
from __future__ import annotations

import itertools
import math

import torch

from .lab1_chunks import chunk_bounds, positions, power_of_two_below

def traffic_problems(kind, n, length, itemsize, summaries):
    """(volume lines, {key: peer line}) for one case: every rank's measured traffic against the algorithm's.

    kind: "reduce_scatter", "all_gather" or "all_reduce" (halving-doubling); summaries: per rank, a
    `bytecount` summary (sent, received, messages_sent, by_peer). Checked at every length, chunks empty or
    not: each rank's peers; its messages against the algorithm's cap; the ring's bytes per rank exactly
    (`ring_bytes`); halving-doubling's bytes per rank where N and p divide the length
    (`halving_doubling_bytes`) and, at every length, the bytes of all ranks together
    (`halving_doubling_total_bytes`, the same for any split of the ranges). Padding a chunk or sending a
    range twice therefore fails at some length, and so does cutting a message into pieces.
    """
    nbytes = length * itemsize
    peers_of = halving_doubling_peers if kind == "all_reduce" else ring_peers
    volume, peers = [], {}
    for rank, s in enumerate(summaries):
        for key, line in _peer_problems(rank, length, s, *peers_of(rank, n)):
            peers.setdefault(key, line)
        if kind == "all_reduce":
            want = halving_doubling_bytes(rank, n, nbytes)
            p, _ = power_of_two_below(n)
            if length % math.lcm(n, p):  # uneven ranges: the per-rank split is the solution's own choice
                want = {k: v for k, v in want.items() if k not in ("sent", "received")}
        else:
            want = ring_bytes(kind, rank, n, length, itemsize)
        for key in ("sent", "received"):
            if key in want and s[key] != want[key]:
                volume.append(f"rank {rank}, length {length} (M = {nbytes} bytes): {key} {s[key]} bytes, "
                              f"expected {want[key]} ({want['why']})")
        if s["messages_sent"] > want["max_messages"]:
            volume.append(f"rank {rank}, length {length}: sent {s['messages_sent']} messages, at most "
                          f"{want['max_messages']} expected ({want['why_messages']})")
    if kind == "all_reduce":
        total = halving_doubling_total_bytes(n, nbytes)
        for key in ("sent", "received"):
            measured = [s[key] for s in summaries]
            if sum(measured) != total:
                volume.append(f"length {length} (M = {nbytes} bytes): all ranks together {key} {sum(measured)} "
                              f"bytes (per rank {measured}), expected {total} ({total // nbytes} × M: each "
                              "pair moves exactly the range it shares, once; no padding, nothing twice)")
    return volume, peers


def _check_traffic(kind, n, cases, per_rank):
    """Every rank's measured traffic in every case against the algorithm's (traffic_problems). A wrong peer
    is reported once per rank and peer (the first length it happened at); volume and peer lines alternate,
    so the first lines show both kinds."""
    volume, peers = [], {}
    for index, (length, dtype, _) in enumerate(cases):
        itemsize = torch.tensor([], dtype=dtype).element_size()
        lines, found = traffic_problems(kind, n, length, itemsize, [s[index] for s in per_rank])
        volume += lines
        for key, line in found.items():
            peers.setdefault(key, line)
    pairs = itertools.zip_longest(volume, peers.values())
    return [line for pair in pairs for line in pair if line is not None]


def _peer_problems(rank, length, summary, sends_to, receives_from, why):
    """((rank, direction, peer), line) for each peer this rank sent bytes to, or received bytes from,
    outside the algorithm's peers."""
    problems = []
    for peer, moved in summary["by_peer"].items():
        if moved["sent"] and peer not in sends_to:
            problems.append(((rank, "to", peer),
                             f"rank {rank}, length {length}: sent {moved['sent']} bytes to rank {peer}; {why}"))
        if moved["received"] and peer not in receives_from:
            problems.append(((rank, "from", peer),
                             f"rank {rank}, length {length}: received {moved['received']} bytes from rank "
                             f"{peer}; {why}"))
    unnamed = summary["received"] - sum(moved["received"] for moved in summary["by_peer"].values())
    if unnamed:
        problems.append(((rank, "from", None),
                         f"rank {rank}, length {length}: received {unnamed} bytes from an unnamed source (a "
                         f"receive without src); {why}"))
    return problems


def ring_peers(rank: int, n: int):
    """({ranks `rank` sends to}, {ranks it receives from}, why) around a ring: right and left neighbour."""
    right, left = (rank + 1) % n, (rank - 1) % n
    return {right}, {left}, (f"around a ring rank {rank} sends only to rank {right} (r+1) and receives only "
                             f"from rank {left} (r-1)")


def halving_doubling_peers(rank: int, n: int):
    """({ranks `rank` sends to}, {ranks it receives from}, why) in halving-doubling with the lab's fold rule."""
    p, steps = power_of_two_below(n)
    extra = n - p
    if rank < 2 * extra and rank % 2 == 0:
        return {rank + 1}, {rank + 1}, f"rank {rank} is folded: it exchanges only with rank {rank + 1}"
    at = positions(n)
    me = at.index(rank)
    distances = [p >> k for k in range(1, steps + 1)]  # p/2, ..., 1
    partners = {at[me ^ d] for d in distances}
    why = (f"rank {rank} is at position {me} of the ranks {at} that run halving-doubling, so its partners are "
           f"the ranks at positions {me} XOR {', '.join(map(str, distances))}: {sorted(partners)}")
    if rank < 2 * extra:
        partners.add(rank - 1)
        why += f", and rank {rank - 1}, whose tensor it folds in and to which it hands the sum back"
    return partners, partners, why


def scatter_gather_bytes(rank, n, nbytes):
    """Bytes rank `rank` of `n` sends and receives in a ring reduce-scatter or all-gather of `nbytes` (M) when
    N divides the length."""
    share = (n - 1) * nbytes // n
    return dict(sent=share, received=share, why="(N-1)/N × M: each rank passes on N-1 chunks of M/N")


def ring_bytes(kind: str, rank: int, n: int, length: int, itemsize: int) -> dict:
    """Bytes and messages rank `rank` of `n` moves in a ring reduce-scatter or all-gather (`kind`) of a tensor
    of `length` elements of `itemsize` bytes, at any length (chunks of tensor_split(n), empty below n).

    Around a ring every chunk crosses every link but one, once: in a reduce-scatter chunk c starts at rank
    c+1 and ends at rank c, so rank r sends every chunk but its own and receives every chunk but chunk r-1;
    in an all-gather chunk c starts at rank c, so rank r sends every chunk but chunk r+1 and receives every
    chunk but its own. When N divides the length both are (N-1)/N × M (`scatter_gather_bytes`).
    """
    sizes = [(b - a) * itemsize for a, b in chunk_bounds(length, n)]
    nbytes = length * itemsize
    if kind == "reduce_scatter":
        sent, received = nbytes - sizes[rank], nbytes - sizes[(rank - 1) % n]
        why = (f"M minus chunk {rank} out, M minus chunk {(rank - 1) % n} in: around the ring every chunk "
               "passes every rank but the one that keeps it, once, at its own size")
    else:
        sent, received = nbytes - sizes[(rank + 1) % n], nbytes - sizes[rank]
        why = (f"M minus chunk {(rank + 1) % n} out, M minus chunk {rank} in: around the ring every chunk "
               "reaches every rank once, at its own size")
    return dict(sent=sent, received=received, why=why, max_messages=n - 1,
                why_messages="N-1 steps around the ring, one chunk per step")


def halving_doubling_total_bytes(n: int, nbytes: int) -> int:
    """Bytes all `n` ranks together send (and receive) in halving-doubling with the fold rule, at any length.

    Each halving or doubling step, every pair moves exactly the range it shares (however it is split), so
    the p ranks move (p-1) × M in the halving and again in the doubling; each folded pair moves M each way.
    """
    p, _ = power_of_two_below(n)
    return 2 * (p - 1) * nbytes + 2 * (n - p) * nbytes


def halving_doubling_bytes(rank: int, n: int, nbytes: int) -> dict:
    """Bytes and messages rank `rank` of `n` moves in recursive halving-doubling with the lab's fold rule.

    p = largest power of two ≤ n, extra = n - p. Ranks 0 … 2·extra-1 pair up: the even rank sends its
    tensor to the odd one (M) and later receives the sum back (M); the p remaining ranks do halving
    (reduce-scatter, log2 p steps) and doubling (all-gather, log2 p steps), moving 2(p-1)/p × M.
    """
    p, steps = power_of_two_below(n)
    extra = n - p
    core = 2 * (p - 1) * nbytes // p
    if rank < 2 * extra and rank % 2 == 0:
        return dict(sent=nbytes, received=nbytes, max_messages=1, why="folded rank: M out, M back",
                    why_messages="one send of the whole tensor to its odd partner")
    if rank < 2 * extra:
        return dict(sent=core + nbytes, received=core + nbytes, max_messages=2 * steps + 1,
                    why=f"2(p-1)/p × M with p = {p}, plus M: the even partner's tensor in, the sum back out",
                    why_messages=f"2·log2({p}) exchanges + 1 to return the sum")
    return dict(sent=core, received=core, max_messages=2 * steps,
                why=f"2(p-1)/p × M with p = {p}",
                why_messages=f"2·log2({p}): recursive halving-doubling, not a ring")

