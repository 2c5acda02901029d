"""Lab 1's checks (labs/lab1_collectives.ipynb): collectives from send and recv, and their cost model.

Each check prints one ✓ line per world size, saying what it verified, or raises a `LabCheckFailure` that
says what to fix:
  check_reduce_scatter(reduce_scatter)        reduce_scatter(tensor) -> this rank's chunk of the sum
  check_all_gather(all_gather)                all_gather(chunk, length) -> the full tensor
  check_halving_doubling(all_reduce)          all_reduce(tensor) -> the sum, by recursive halving-doubling
  check_cost_model(ring_time, halving_doubling_time, crossover_bytes)
A wrong answer names the rank, the chunk, the elements and expected vs got; wrong traffic names the rank and
the bytes, messages or peers, expected vs measured. Chunks follow `tensor.tensor_split(N)`: chunk r goes to
rank r; the first L % N chunks have one more element. A returned tensor may be the input itself or a view of
it: each rank gets its own copy of the input, and the checks only read what comes back.

The traffic rules (the grader shares them):
  - reduce-scatter and all-gather run around a ring (`ring_peers`): rank r sends only to r+1 and receives only
    from r-1 (mod N), in at most N-1 messages, and moves exactly M minus one chunk each way at every length
    (`ring_bytes`; (N-1)/N × M when N divides the length, `scatter_gather_bytes`);
  - halving-doubling follows the lab's fold rule: partners (`halving_doubling_peers`), messages, and bytes
    (`halving_doubling_bytes` per rank where N and p divide the length, `halving_doubling_total_bytes` for all
    ranks together at every length).
  `traffic_problems` applies them to one case; the grader's verdicts call it too.

The checks launch with backend "auto": gloo on CPUs, NCCL with one GPU per rank. The inputs they hand to the
student's function live on the rank's device (`utils.device()`); results are compared on the CPU.
"""
from __future__ import annotations

import itertools
import math
import numbers

import torch
import torch.distributed as dist

from .. import bytecount, launching
from ..checks import check
from .harness import (TIMEOUT, LabCheckFailure, compare_result, describe_mismatch, report,
                      run_on_ranks)

WORLD_SIZES = (2, 3, 4)
# N = 6 is the smallest N with two folded pairs: a position -> rank mapping that is wrong but happens to be
# right while only one pair folds (N = 3, 5) fails there.
HALVING_DOUBLING_WORLD_SIZES = (2, 3, 4, 6)
DTYPES = (torch.float32, torch.int64)


def power_of_two_below(n: int) -> tuple[int, int]:
    """(p, log2 p) for p the largest power of two ≤ n: the ranks halving-doubling runs on."""
    p = 1 << (n.bit_length() - 1)
    return p, p.bit_length() - 1


def positions(n: int) -> list[int]:
    """The p ranks that run halving-doubling, in position order: position q is rank 2q+1 for q < extra,
    else rank q + extra (extra = n - p)."""
    p, _ = power_of_two_below(n)
    extra = n - p
    return [2 * q + 1 if q < extra else q + extra for q in range(p)]


def chunk_bounds(length: int, n: int) -> list[tuple[int, int]]:
    """[(start, stop)] of the n chunks of `tensor.tensor_split(n)` for a tensor of `length` elements."""
    base, extra = divmod(length, n)
    bounds, start = [], 0
    for r in range(n):
        stop = start + base + (1 if r < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def rank_input(length: int, dtype, seed: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s input for one case: small integers (exact sums in any order), stored as `dtype`."""
    generator = torch.Generator().manual_seed(1000003 * seed + 7919 * rank + length)
    return torch.randint(-8, 9, (length,), generator=generator).to(dtype)


def _run_cases(kind, fn, cases):
    """Run the student's `fn` on this rank for every case; return (problems, byte summaries)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    device = launching.device()  # cuda:<rank> under NCCL, else the CPU
    problems, summaries = [], []
    for length, dtype, seed in cases:
        inputs = [rank_input(length, dtype, seed, r) for r in range(n)]  # every rank can build everyone's
        total = torch.stack(inputs).sum(0).to(dtype)
        bounds = chunk_bounds(length, n)
        start, stop = bounds[rank]
        label = f"length {length}, {str(dtype).replace('torch.', '')}"
        if kind == "reduce_scatter":
            argument = (inputs[rank].to(device, copy=True),)
            expected = total[start:stop]
        elif kind == "all_gather":
            argument = (total[start:stop].to(device, copy=True), length)  # chunk r of a known tensor
            expected = total
        else:
            argument = (inputs[rank].to(device, copy=True),)
            expected = total
        with bytecount.count_bytes() as counter, bytecount.forbid_collectives():
            got = fn(*argument)
        summaries.append(counter.summary())
        if isinstance(got, torch.Tensor):
            got = got.detach().cpu()  # compare on the CPU, whatever device the ranks use
        bad = compare_result(got, expected, rank, label)
        if not bad and not torch.equal(got, expected):
            bad = [diagnose(kind, got, total, inputs[rank], bounds, rank, label)]
        problems += bad
    return problems, summaries


def diagnose(kind, got, total, own_input, bounds, rank, label):
    """One line explaining how rank `rank`'s result `got` (a tensor of the right dtype and shape, but wrong)
    differs: `total` is the sum of every rank's input, `own_input` this rank's input, `bounds` the chunks
    (chunk_bounds). kind: "reduce_scatter", "all_gather", anything else is an all-reduce. Plain tensors in,
    one line out: the lab's checks and the grader's verdicts both word a wrong result with it."""
    n = len(bounds)
    start, stop = bounds[rank]
    expected = total[start:stop] if kind == "reduce_scatter" else total
    if kind == "reduce_scatter":
        where = f"chunk {rank} = elements {start}:{stop} of the sum"
        for other, (a, b) in enumerate(bounds):
            if other != rank and b - a == stop - start and torch.equal(got, total[a:b]):
                return (f"rank {rank}, {label}: returned chunk {other} of the sum, expected {where}: "
                        "off by one chunk? Rank r must end with chunk r.")
        if torch.equal(got, own_input[start:stop]):
            return f"rank {rank}, {label}: returned its own input for {where}: nothing was added"
        return f"rank {rank}, {label}: wrong values for {where}: {describe_mismatch(got, expected, start)}"
    detail = describe_mismatch(got, expected, 0, bounds)
    if kind == "all_gather":
        return f"rank {rank}, {label}: wrong gathered tensor (chunk j must come from rank j): {detail}"
    return f"rank {rank}, {label}: wrong sum: {detail} (chunks as in tensor_split({n}))"


def _cases(world_size, lengths, dtypes, seed=0):
    if lengths is None:
        n = world_size
        # 1 element per chunk, uneven, even; then empty chunks (1 and N-1 elements), last so that the first
        # lines of a failure show a typical mistake at lengths with every chunk filled
        lengths = tuple(dict.fromkeys((n, 2 * n + 1, 24, 24 * 7 + n - 1, 240, 1, n - 1)))
    return [(length, dtype, seed + i) for i, length in enumerate(lengths) for dtype in dtypes]


# ------------------------------------------------------------------ the traffic each algorithm must have

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


# ------------------------------------------------------------------ lab 1's checks

RING_CLAIM = ("rank r sends only to rank r+1 and receives only from rank r-1, in at most N-1 messages; bytes "
              "exact at every length (M minus one chunk each way: (N-1)/N × M at lengths {lengths})")
HALVING_DOUBLING_CLAIM = ("partners by the fold rule; messages as in the lab's table at every length; bytes per "
                          "rank as in the table at lengths {lengths}, all ranks' bytes together at every length")


def _fold_hint(n):
    """What the fold rule means at this N (shown with a failure at an N that is not a power of two)."""
    p, _ = power_of_two_below(n)
    extra = n - p
    pairs = ", ".join(f"({r}, {r + 1})" for r in range(0, 2 * extra, 2))
    return (f"N={n} is not a power of two (p = {p}, extra = {extra}): the rank pairs {pairs} fold (the even "
            f"rank hands its tensor to the odd one), then the ranks {positions(n)} run halving-doubling, the "
            "q-th of them at position q. A partner is the rank at position (yours XOR d): never use a "
            "position as a rank number.")


def _check_collective(kind, fn, what, world_sizes, lengths, dtypes, timeout, seed, claim):
    """Run `fn` on each world size; check every rank's result, then its traffic (traffic_problems)."""
    for n in world_sizes:
        p, _ = power_of_two_below(n)
        hint = _fold_hint(n) if kind == "all_reduce" and n != p else ""
        bytes_divisor = math.lcm(n, p) if kind == "all_reduce" else n
        cases = _cases(n, lengths, dtypes, seed)
        try:
            results = run_on_ranks(_run_cases, kind, fn, cases, world_size=n, what=what, timeout=timeout)
        except LabCheckFailure as failure:
            if not hint or "not implemented yet" in str(failure) or "which the checks forbid" in str(failure):
                raise
            first, _, rest = str(failure).partition("\n")
            raise LabCheckFailure(first + "\n  " + hint + ("\n" + rest if rest else "")) from None
        # interleave the ranks' problems, so the first lines show how the ranks differ
        per_rank = [rank_problems for rank_problems, _ in results]
        problems = [p for row in itertools.zip_longest(*per_rank) for p in row if p is not None]
        report(what, n, problems, note=hint)
        report(what, n, _check_traffic(kind, n, cases, [s for _, s in results]), note=hint)
        lengths_in = list(dict.fromkeys(c[0] for c in cases))
        counted = ", ".join(str(length) for length in lengths_in if length % bytes_divisor == 0) or "none"
        dtypes_text = "/".join(str(d).replace("torch.", "") for d in dtypes)
        check(True, f"{what} at N={n}: exact on every rank for lengths {', '.join(map(str, lengths_in))} "
                    f"({dtypes_text}); {claim.format(lengths=counted)}")


def check_reduce_scatter(reduce_scatter, world_sizes=WORLD_SIZES, lengths=None, dtypes=DTYPES,
                         timeout=TIMEOUT, seed=0):
    """reduce_scatter(tensor) must return chunk r of the sum on rank r, around a ring, (N-1)/N × M per rank."""
    _check_collective("reduce_scatter", reduce_scatter, "reduce_scatter", world_sizes, lengths, dtypes,
                      timeout, seed, RING_CLAIM)


def check_all_gather(all_gather, world_sizes=WORLD_SIZES, lengths=None, dtypes=DTYPES, timeout=TIMEOUT,
                     seed=0):
    """all_gather(chunk, length) must return the full tensor on every rank, around a ring, (N-1)/N × M per rank."""
    _check_collective("all_gather", all_gather, "all_gather", world_sizes, lengths, dtypes, timeout, seed,
                      RING_CLAIM)


def check_halving_doubling(all_reduce, world_sizes=HALVING_DOUBLING_WORLD_SIZES, lengths=None, dtypes=DTYPES,
                           timeout=TIMEOUT, seed=0, name="all_reduce_halving_doubling"):
    """all_reduce(tensor) must return the sum on every rank with halving-doubling's partners, bytes, messages."""
    _check_collective("all_reduce", all_reduce, name, world_sizes, lengths, dtypes, timeout, seed,
                      HALVING_DOUBLING_CLAIM)


# ------------------------------------------------------------------ the α-β cost model

# The checks hold the expected values of the lab's fixed cases, not the formulas (they are the exercise): the
# course's private reference module (left out of the student distribution) generated EXPECTED_TIMES and
# EXPECTED_CROSSOVER below, and the course's tests keep them in step with it. This module never imports
# that one (it imports this one): other cases need their expected values passed in (check_cost_model's
# `expected`).
COST_WORLD_SIZES = (2, 3, 4, 5, 6, 7, 8, 12, 1000, 1024)
COST_CASES = [(n, nbytes, 5e-6, 1 / 100e9) for n in COST_WORLD_SIZES
              for nbytes in (1e3, 1e6, 25 * 2**20, 1e9)] + [(4, 64 * 2**20, 50e-6, 1 / 2e9)] + \
    [(16, 4e3, 2e-6, 1 / 25e9)]   # a power of two where the slopes' round-off comes out negative

# A crossover at or beyond this many bytes (1 PB, far beyond any message) means "never slower": math.inf is
# the exact answer there, and a formula that subtracts two equal bandwidth terms may leave a huge finite one.
NEVER_SLOWER_BYTES = 1e15

# BEGIN GENERATED TABLES
EXPECTED_TIMES = {  # (n, nbytes, alpha, beta): (ring_time, halving_doubling_time)
    (2, 1000.0, 5e-06, 1e-11): (1.001e-05, 1.001e-05),
    (2, 1000000.0, 5e-06, 1e-11): (1.9999999999999998e-05, 1.9999999999999998e-05),
    (2, 26214400, 5e-06, 1e-11): (0.000272144, 0.000272144),
    (2, 1000000000.0, 5e-06, 1e-11): (0.01001, 0.01001),
    (3, 1000.0, 5e-06, 1e-11): (2.0013333333333334e-05, 2.0030000000000003e-05),
    (3, 1000000.0, 5e-06, 1e-11): (3.3333333333333335e-05, 4.9999999999999996e-05),
    (3, 26214400, 5e-06, 1e-11): (0.0003695253333333333, 0.0008064319999999999),
    (3, 1000000000.0, 5e-06, 1e-11): (0.013353333333333332, 0.030019999999999998),
    (4, 1000.0, 5e-06, 1e-11): (3.0015000000000003e-05, 2.0015e-05),
    (4, 1000000.0, 5e-06, 1e-11): (4.5e-05, 3.5e-05),
    (4, 26214400, 5e-06, 1e-11): (0.0004232159999999999, 0.000413216),
    (4, 1000000000.0, 5e-06, 1e-11): (0.015029999999999998, 0.015019999999999999),
    (5, 1000.0, 5e-06, 1e-11): (4.0016000000000004e-05, 3.0035e-05),
    (5, 1000000.0, 5e-06, 1e-11): (5.6000000000000006e-05, 6.5e-05),
    (5, 26214400, 5e-06, 1e-11): (0.00045943039999999996, 0.000947504),
    (5, 1000000000.0, 5e-06, 1e-11): (0.01604, 0.03503),
    (6, 1000.0, 5e-06, 1e-11): (5.001666666666667e-05, 3.0035e-05),
    (6, 1000000.0, 5e-06, 1e-11): (6.666666666666667e-05, 6.5e-05),
    (6, 26214400, 5e-06, 1e-11): (0.00048690666666666664, 0.000947504),
    (6, 1000000000.0, 5e-06, 1e-11): (0.016716666666666664, 0.03503),
    (7, 1000.0, 5e-06, 1e-11): (6.001714285714287e-05, 3.0035e-05),
    (7, 1000000.0, 5e-06, 1e-11): (7.714285714285715e-05, 6.5e-05),
    (7, 26214400, 5e-06, 1e-11): (0.0005093897142857143, 0.000947504),
    (7, 1000000000.0, 5e-06, 1e-11): (0.017202857142857145, 0.03503),
    (8, 1000.0, 5e-06, 1e-11): (7.001750000000001e-05, 3.0017500000000005e-05),
    (8, 1000000.0, 5e-06, 1e-11): (8.75e-05, 4.75e-05),
    (8, 26214400, 5e-06, 1e-11): (0.000528752, 0.000488752),
    (8, 1000000000.0, 5e-06, 1e-11): (0.017570000000000002, 0.017529999999999997),
    (12, 1000.0, 5e-06, 1e-11): (0.00011001833333333335, 4.0037500000000004e-05),
    (12, 1000000.0, 5e-06, 1e-11): (0.00012833333333333335, 7.75e-05),
    (12, 26214400, 5e-06, 1e-11): (0.0005905973333333333, 0.0010230399999999998),
    (12, 1000000000.0, 5e-06, 1e-11): (0.018443333333333332, 0.03754),
    (1000, 1000.0, 5e-06, 1e-11): (0.00999001998, 0.0001000399609375),
    (1000, 1000000.0, 5e-06, 1e-11): (0.01000998, 0.0001399609375),
    (1000, 26214400, 5e-06, 1e-11): (0.010513763712000001, 0.001147552),
    (1000, 1000000000.0, 5e-06, 1e-11): (0.029969999999999997, 0.0400609375),
    (1024, 1000.0, 5e-06, 1e-11): (0.010230019980468751, 0.00010001998046875),
    (1024, 1000000.0, 5e-06, 1e-11): (0.01024998046875, 0.00011998046875),
    (1024, 26214400, 5e-06, 1e-11): (0.010753776, 0.000623776),
    (1024, 1000000000.0, 5e-06, 1e-11): (0.030210468750000004, 0.020080468749999997),
    (4, 67108864, 5e-05, 5e-10): (0.050631648, 0.050531648000000005),
    (16, 4000.0, 2e-06, 4e-11): (6.0299999999999995e-05, 1.63e-05),
}
EXPECTED_CROSSOVER = {  # (n, alpha, beta): crossover_bytes
    (2, 5e-06, 1e-11): math.inf,
    (3, 5e-06, 1e-11): 0.0,
    (4, 5e-06, 1e-11): math.inf,
    (5, 5e-06, 1e-11): 526315.7894736843,
    (6, 5e-06, 1e-11): 1090909.090909091,
    (7, 5e-06, 1e-11): 1680000.0000000002,
    (8, 5e-06, 1e-11): math.inf,
    (12, 5e-06, 1e-11): 3652173.913043479,
    (1000, 5e-06, 1e-11): 494971769.96825105,
    (1024, 5e-06, 1e-11): math.inf,
    (4, 5e-05, 5e-10): math.inf,
    (16, 2e-06, 4e-11): math.inf,
}
# END GENERATED TABLES


def _expected(kind, key, expected=None):
    """The expected value of one case: `kind` "ring_time", "halving_doubling_time" or "crossover_bytes".
    The stored tables answer the lab's own cases; `expected(kind, key)`, when given, any other."""
    if kind == "crossover_bytes":
        if key in EXPECTED_CROSSOVER:
            return EXPECTED_CROSSOVER[key]
    elif key in EXPECTED_TIMES:
        return EXPECTED_TIMES[key][0 if kind == "ring_time" else 1]
    if expected is None:
        raise LabCheckFailure(f"✗ no stored expected value for {kind}{key}: these checks know the lab's own "
                              "cases only")
    return expected(kind, key)


def _number(value):
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def accept_time(got, want) -> bool:
    """Is `got` an acceptable answer where `want` seconds are expected? (The grader uses this rule too.)

    A number within 1e-9 relative of `want`: the same formula written in another order agrees to ~1e-15.
    """
    return _number(got) and math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-15)


def accept_crossover(got, want) -> bool:
    """Is `got` an acceptable crossover_bytes where `want` bytes are expected? (The grader uses this rule too.)

    Where halving-doubling is never slower (`want` is math.inf, or at least NEVER_SLOWER_BYTES): math.inf
    or any number ≥ NEVER_SLOWER_BYTES. Elsewhere: within 1 byte of `want` (whole bytes, rounded any way,
    pass) or 1e-4 relative, whichever is larger (a crossover solved from differences of the two cost functions
    loses digits to cancellation: 1.5e-8 relative at N = 1000 on the lab's link, up to about 1e-5 at N in the
    thousands on others; a wrong formula is off by far more).
    """
    if not _number(got):
        return False
    if want >= NEVER_SLOWER_BYTES:
        return got >= NEVER_SLOWER_BYTES
    return abs(got - want) <= max(1.0, 1e-4 * want)


def _answer(name, fn, **arguments):
    """(how the call reads, fn(**arguments)), or the LabCheckFailure that says what to do instead."""
    call = f"{name}({', '.join(f'{k}={v:g}' for k, v in arguments.items())})"
    try:
        got = fn(*arguments.values())
    except NotImplementedError:
        raise LabCheckFailure(f"✗ {name} is not implemented yet: replace "
                              "`raise NotImplementedError()` with your formula.") from None
    if not _number(got):
        raise LabCheckFailure(f"✗ {call} returned {type(got).__name__} {got!r}: return a number (a Python "
                              "float or int)")
    return call, got


def check_cost_model(ring_time, halving_doubling_time, crossover_bytes, cases=None, expected=None):
    """The three cost functions against the α-β model (α per message, β seconds per byte).

    The times are checked on `cases` (n, nbytes, alpha, beta), crossover_bytes on every (n, alpha, beta) in them.
    Cases beyond the lab's own need `expected(kind, key)` for their expected values (the tests pass the
    reference formulas' `lab1_expected`).
    """
    cases = COST_CASES if cases is None else cases
    for name, fn, hint in [
        ("ring_time", ring_time, "2(N-1) steps, each α + (M/N)·β"),
        ("halving_doubling_time", halving_doubling_time,
         "log2 p halving + log2 p doubling steps, plus the fold and the hand-back when N is not a power "
         "of two"),
    ]:
        for n, nbytes, alpha, beta in cases:
            call, got = _answer(name, fn, n=n, nbytes=nbytes, alpha=alpha, beta=beta)
            want = _expected(name, (n, nbytes, alpha, beta), expected)
            if not accept_time(got, want):
                raise LabCheckFailure(f"✗ {call} = {got!r}, expected {want:.6g} s ({hint})")
        check(True, f"{name} matches the α-β model on {len(cases)} cases")
    crossover_cases = list(dict.fromkeys((n, alpha, beta) for n, _, alpha, beta in cases))
    for n, alpha, beta in crossover_cases:
        call, got = _answer("crossover_bytes", crossover_bytes, n=n, alpha=alpha, beta=beta)
        want = _expected("crossover_bytes", (n, alpha, beta), expected)
        if accept_crossover(got, want):
            continue
        if want == math.inf:
            expected = (f"math.inf: N={n} is a power of two, so both algorithms have the same bandwidth term "
                        "(their difference is 0 up to round-off: compare it with a tolerance, not with 0) and "
                        "halving-doubling sends fewer messages, so it is never slower (any value ≥ 1e15 "
                        "passes too)")
        elif want == 0:
            expected = (f"0.0: at N={n} halving-doubling saves no latency to pay for its larger bandwidth "
                        "term, so it is slower for every message size > 0")
        else:
            expected = (f"{want:.10g} bytes, within 1 byte or 1e-4 relative (the largest M for which "
                        "halving-doubling is at least as fast as the ring)")
        raise LabCheckFailure(f"✗ {call} = {got!r}, expected {expected}")
    distinct = list(dict.fromkeys(n for n, _, _ in crossover_cases))
    sizes = ", ".join(str(n) for n in distinct)
    twice = "; some N on two different links" if len(distinct) < len(crossover_cases) else ""
    check(True, f"crossover_bytes matches the α-β model on {len(crossover_cases)} (N, α, β) cases "
                f"(N = {sizes}{twice}): "
                "within 1 byte or 1e-4 relative, or ≥ 1e15 where the answer is math.inf")
