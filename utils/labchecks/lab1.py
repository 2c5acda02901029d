"""Lab 1's checks (labs/lab1_collectives.ipynb): collectives from send and recv, and their cost model.

Each check prints one ✓ line per world size or raises a `LabCheckFailure` that says what to fix:
  check_reduce_scatter(reduce_scatter)        reduce_scatter(tensor) -> this rank's chunk of the sum
  check_all_gather(all_gather)                all_gather(chunk, length) -> the full tensor
  check_halving_doubling(all_reduce)          all_reduce(tensor) -> the sum, by recursive halving-doubling
  check_cost_model(ring_time, halving_doubling_time, crossover_bytes)
A wrong answer names the rank, the chunk, the elements and expected vs got; wrong traffic names the rank and
the bytes or messages, expected vs measured. Chunks follow `tensor.tensor_split(N)`: chunk r goes to rank r;
the first L % N chunks have one more element.

The checks launch with backend "auto": gloo on CPUs, NCCL with one GPU per rank. The inputs they hand to the
student's function live on the rank's device (`utils.device()`); results are compared on the CPU.
"""
from __future__ import annotations

import itertools
import math

import torch
import torch.distributed as dist

from .. import bytecount, launching
from ..checks import check
from .harness import (TIMEOUT, LabCheckFailure, compare_result, describe_mismatch, report,
                      run_on_ranks)

WORLD_SIZES = (2, 3, 4)
DTYPES = (torch.float32, torch.int64)



def power_of_two_below(n: int) -> tuple[int, int]:
    """(p, log2 p) for p the largest power of two ≤ n: the ranks halving-doubling runs on."""
    p = 1 << (n.bit_length() - 1)
    return p, p.bit_length() - 1


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
            bad = [_diagnose(kind, got, expected, total, inputs[rank], bounds, rank, label)]
        problems += bad
    return problems, summaries


def _diagnose(kind, got, expected, total, own_input, bounds, rank, label):
    """Explain a wrong result as precisely as possible."""
    n = len(bounds)
    start, stop = bounds[rank]
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
        lengths = (n, 2 * n + 1, 24, 24 * 7 + n - 1, 240)  # 1 element per chunk, uneven, even
    return [(length, dtype, seed + i) for i, length in enumerate(lengths) for dtype in dtypes]


# ------------------------------------------------------------------ byte counts each algorithm must hit

def _check_bytes(what, n, cases, per_rank, expected_fn):
    """Compare measured per-rank bytes (and messages) with expected_fn(rank, n, nbytes).

    Only lengths that every chunking divides evenly are checked (a multiple of N and of the largest power
    of two ≤ N): there the formulas are exact whichever way a correct solution splits uneven lengths.
    """
    p, _ = power_of_two_below(n)
    problems = []
    for index, (length, dtype, _) in enumerate(cases):
        if length % math.lcm(n, p) != 0:
            continue
        nbytes = length * torch.tensor([], dtype=dtype).element_size()
        for rank, summaries in enumerate(per_rank):
            s = summaries[index]
            want = expected_fn(rank, n, nbytes)
            for key in ("sent", "received"):
                if s[key] != want[key]:
                    problems.append(
                        f"rank {rank}, length {length} (M = {nbytes} bytes): {key} {s[key]} bytes, "
                        f"expected {want[key]} ({want['why']})")
            if "max_messages" in want and s["messages_sent"] > want["max_messages"]:
                problems.append(
                    f"rank {rank}, length {length}: sent {s['messages_sent']} messages, at most "
                    f"{want['max_messages']} expected ({want['why_messages']})")
    return problems


def scatter_gather_bytes(rank, n, nbytes):
    share = (n - 1) * nbytes // n
    return dict(sent=share, received=share, why="(N-1)/N × M: each rank passes on N-1 chunks of M/N")


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
                    why=f"M from the even partner + 2(p-1)/p × M with p = {p} + M back",
                    why_messages=f"2·log2({p}) exchanges + 1 to return the sum")
    return dict(sent=core, received=core, max_messages=2 * steps,
                why=f"2(p-1)/p × M with p = {p}",
                why_messages=f"2·log2({p}): recursive halving-doubling, not a ring")


# ------------------------------------------------------------------ lab 1's checks

def _check_collective(kind, fn, what, world_sizes, lengths, dtypes, timeout, expected_bytes, bytes_claim,
                      seed=0):
    for n in world_sizes:
        hint = ""
        if kind == "all_reduce" and n & (n - 1):
            hint = f"N={n} is not a power of two: follow the lab's rule for the extra ranks (fold, hand back)"
        cases = _cases(n, lengths, dtypes, seed)
        try:
            results = run_on_ranks(_run_cases, kind, fn, cases, world_size=n, what=what, timeout=timeout)
        except LabCheckFailure as failure:
            if not hint or "not implemented yet" in str(failure) or "built-in collective" in str(failure):
                raise
            first, _, rest = str(failure).partition("\n")
            raise LabCheckFailure(first + "\n  " + hint + ("\n" + rest if rest else "")) from None
        # interleave the ranks' problems, so the first lines show how the ranks differ
        per_rank = [rank_problems for rank_problems, _ in results]
        problems = [p for row in itertools.zip_longest(*per_rank) for p in row if p is not None]
        report(what, n, problems, note=hint)
        report(what, n, _check_bytes(what, n, cases, [s for _, s in results], expected_bytes))
        lengths_text = ", ".join(str(length) for length in dict.fromkeys(c[0] for c in cases))
        dtypes_text = "/".join(str(d).replace("torch.", "") for d in dtypes)
        check(True, f"{what} at N={n}: exact on every rank for lengths {lengths_text} ({dtypes_text}); "
                    f"{bytes_claim}")


def check_reduce_scatter(reduce_scatter, world_sizes=WORLD_SIZES, lengths=None, dtypes=DTYPES,
                         timeout=TIMEOUT, seed=0):
    """reduce_scatter(tensor) must return chunk r of the sum on rank r, sending (N-1)/N × M per rank."""
    _check_collective("reduce_scatter", reduce_scatter, "reduce_scatter", world_sizes, lengths, dtypes,
                      timeout, scatter_gather_bytes, "sends and receives (N-1)/N × M per rank", seed)


def check_all_gather(all_gather, world_sizes=WORLD_SIZES, lengths=None, dtypes=DTYPES, timeout=TIMEOUT,
                     seed=0):
    """all_gather(chunk, length) must return the full tensor on every rank, moving (N-1)/N × M per rank."""
    _check_collective("all_gather", all_gather, "all_gather", world_sizes, lengths, dtypes, timeout,
                      scatter_gather_bytes, "sends and receives (N-1)/N × M per rank", seed)


def check_halving_doubling(all_reduce, world_sizes=WORLD_SIZES, lengths=None, dtypes=DTYPES,
                           timeout=TIMEOUT, seed=0, name="all_reduce_halving_doubling"):
    """all_reduce(tensor) must return the sum on every rank with halving-doubling's bytes and messages."""
    _check_collective("all_reduce", all_reduce, name, world_sizes, lengths, dtypes, timeout,
                      halving_doubling_bytes, "bytes and messages of halving-doubling", seed)


# ------------------------------------------------------------------ the α-β cost model

def reference_ring_time(n, nbytes, alpha, beta):
    return 2 * (n - 1) * (alpha + nbytes / n * beta)


def reference_halving_doubling_time(n, nbytes, alpha, beta):
    p, steps = power_of_two_below(n)
    time = 2 * steps * alpha + 2 * (p - 1) / p * nbytes * beta
    if n > p:
        time += 2 * (alpha + nbytes * beta)  # fold in and hand back: a whole tensor each way
    return time


def reference_crossover(n, alpha, beta):
    p, steps = power_of_two_below(n)
    fold = 1 if n > p else 0
    latency_saved = 2 * (n - 1) - 2 * steps - 2 * fold                 # in units of α
    bandwidth_lost = 2 * (p - 1) / p + 2 * fold - 2 * (n - 1) / n        # in units of β × M
    if bandwidth_lost <= 1e-12:
        return math.inf if latency_saved >= 0 else 0.0
    return max(0.0, latency_saved * alpha / (bandwidth_lost * beta))


COST_WORLD_SIZES = (2, 3, 4, 5, 6, 7, 8, 12, 1000, 1024)
COST_CASES = [(n, nbytes, 5e-6, 1 / 100e9) for n in COST_WORLD_SIZES
              for nbytes in (1e3, 1e6, 25 * 2**20, 1e9)] + [(4, 64 * 2**20, 50e-6, 1 / 2e9)]


def accept_time(got, want) -> bool:
    """Is `got` an acceptable answer where `want` seconds are expected? (The grader uses this rule too.)"""
    return _close(got, want)


def accept_crossover(got, want) -> bool:
    """Is `got` an acceptable crossover_bytes where `want` bytes are expected? (The grader uses this rule too.)"""
    return _close(got, want)


def _close(got, want):
    """Equal, or both finite numbers equal to 1e-9 relative."""
    if got == want:
        return True
    return isinstance(got, (int, float)) and math.isfinite(want) and math.isclose(got, want, rel_tol=1e-9,
                                                                                   abs_tol=1e-15)


def check_cost_model(ring_time, halving_doubling_time, crossover_bytes, cases=None):
    """The three cost functions against the α-β model (α per message, β seconds per byte)."""
    cases = COST_CASES if cases is None else cases
    for fn, reference, hint in [
        (ring_time, reference_ring_time, "2(N-1) steps, each α + (M/N)·β"),
        (halving_doubling_time, reference_halving_doubling_time,
         "log2 p halving + log2 p doubling steps, plus the fold and the hand-back when N is not a power "
         "of two"),
    ]:
        for n, nbytes, alpha, beta in cases:
            try:
                got = fn(n, nbytes, alpha, beta)
            except NotImplementedError:
                raise LabCheckFailure(f"✗ {fn.__name__} is not implemented yet: replace "
                                      "`raise NotImplementedError()` with your formula.") from None
            want = reference(n, nbytes, alpha, beta)
            if not accept_time(got, want):
                raise LabCheckFailure(
                    f"✗ {fn.__name__}(n={n}, nbytes={nbytes:g}, alpha={alpha:g}, beta={beta:g}) = {got!r}, "
                    f"expected {want:.6g} s ({hint})")
        check(True, f"{fn.__name__} matches the α-β model on {len(cases)} cases")
    for n in COST_WORLD_SIZES:
        alpha, beta = 5e-6, 1 / 100e9
        try:
            got = crossover_bytes(n, alpha, beta)
        except NotImplementedError:
            raise LabCheckFailure("✗ crossover_bytes is not implemented yet: replace "
                                  "`raise NotImplementedError()` with your formula.") from None
        want = reference_crossover(n, alpha, beta)
        if not accept_crossover(got, want):
            raise LabCheckFailure(
                f"✗ crossover_bytes(n={n}, alpha={alpha:g}, beta={beta:g}) = {got!r}, expected {want!r} "
                "(the largest M for which halving-doubling is at least as fast as the ring; math.inf if it "
                "never loses, 0.0 if it never wins)")
    check(True, "crossover_bytes matches the α-β model for N = 2 … 1024")
