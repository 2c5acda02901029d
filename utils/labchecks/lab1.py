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

The traffic rules (ring peers and bytes, halving-doubling's fold rule) are in lab1_traffic.py, whose
`traffic_problems` applies them to one case; the grader's verdicts call it too.
The cost model's check (part 4) is in lab1_cost.py, the chunk and position helpers in lab1_chunks.py; this
module re-exports both.

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
from .harness import (TIMEOUT, LabCheckFailure, compare_result, describe_mismatch, report,  # noqa: F401
                      run_on_ranks)
from .lab1_chunks import chunk_bounds, positions, power_of_two_below, rank_input  # noqa: F401
from .lab1_cost import (COST_CASES, COST_WORLD_SIZES, EXPECTED_CROSSOVER, EXPECTED_TIMES,  # noqa: F401
                        NEVER_SLOWER_BYTES, accept_crossover, accept_time, check_cost_model)
from .lab1_traffic import (_check_traffic, halving_doubling_bytes, halving_doubling_peers,  # noqa: F401
                           halving_doubling_total_bytes, ring_bytes, ring_peers, scatter_gather_bytes,
                           traffic_problems)

WORLD_SIZES = (2, 3, 4)
# N = 6 is the smallest N with two folded pairs: a position -> rank mapping that is wrong but happens to be
# right while only one pair folds (N = 3, 5) fails there.
HALVING_DOUBLING_WORLD_SIZES = (2, 3, 4, 6)
DTYPES = (torch.float32, torch.int64)


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


