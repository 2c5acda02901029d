"""Paired timing comparisons: a schedule that balances order, and a paired test that removes the load.

Two versions timed moments apart in the same visit share that moment's load, so their difference within a visit
is free of the slow changes of a shared machine. Two things can still tilt it: the place a version takes inside a
visit, and what ran just before it. `sweep_schedule` removes both by design: every visit runs its versions in one of
the n! orders, and each size's visits use every order equally often (seeded shuffle). Over n! orders each version
takes every place equally often and follows every other version equally often, and none ever follows itself.

An A/A check needs a second copy of one version. Timed inside the same visit it would break that balance (the copy
follows its own code where the other versions cannot), so A/A visits are separate: a visit is either "A/B" (e.g.
ring, pipelined ring, library) or "A/A" (ring, ring again, library), each kind with the same balanced orders, and
`flip_test` runs on both. Whatever it finds on A/B visits is then a property of the codes, not of where they ran.

    schedule = sweep_schedule(sizes, 3, rounds=48, rounds_large=12, aa_below=16 << 20)
    for kept, i, kind, order in schedule: ...          # time versions in `order` (indices), kind "A/B" or "A/A"
    statistic, p = flip_test([[b - a for a, b in zip(A[i], B[i])] for i in sizes_tested])
"""
from __future__ import annotations

import itertools
import math
import random
from collections import Counter
from typing import Sequence

from .timing import Spread


def sweep_schedule(sizes_bytes: Sequence[int], n_versions: int, rounds: int, rounds_large: int,
                   large_from: int = 16 << 20, aa_below: int | None = None, seed: int = 0) -> list[tuple]:
    """The visits of a timing sweep in the order they run: (kept, size index, kind, order), warm-up round first.

    Every round visits every size below `large_from` (the sizes in an order rotated from round to round); sizes from
    `large_from` on come in `rounds_large` of the `rounds` rounds, evenly spread. Round -1 is a warm-up (kept False,
    kind "A/B", order 0..n-1). Each size's kept visits are of kind "A/B", or, for sizes below `aa_below`, half "A/B"
    and half "A/A"; within each kind they use each of the n! orders of the versions equally often, shuffled with
    `seed`. So a kind's visit count must be a multiple of n!: ValueError otherwise.
    """
    orders = [list(p) for p in itertools.permutations(range(n_versions))]
    every = max(1, rounds // rounds_large)
    plan = []                                       # (kept, size index) in run order
    for rep in range(-1, rounds):
        due = [i for i, size in enumerate(sizes_bytes) if size < large_from or rep < 0 or rep % every == every - 1]
        shift = rep % len(due)
        plan += [(rep >= 0, i) for i in due[shift:] + due[:shift]]
    rng = random.Random(seed)
    assigned = {}
    for i, size in enumerate(sizes_bytes):
        visits = sum(kept and j == i for kept, j in plan)
        kinds = ("A/B", "A/A") if aa_below is not None and size < aa_below else ("A/B",)
        per_kind, left = divmod(visits, len(kinds))
        if left or per_kind % len(orders):
            raise ValueError(f"size {size}: {visits} kept visits do not split into {len(kinds)} kind(s) × a multiple "
                             f"of the {len(orders)} orders")
        combos = [(kind, order) for kind in kinds for order in orders for _ in range(per_kind // len(orders))]
        rng.shuffle(combos)
        assigned[i] = iter(combos)
    return [(kept, i, *(next(assigned[i]) if kept else ("A/B", list(range(n_versions))))) for kept, i in plan]


def order_balance(schedule: Sequence[tuple], n_versions: int) -> dict:
    """Counts over the kept visits, per (size index, kind): places[(x, p)] = how often version x ran in place p,
    after[(x, y)] = how often x ran right after y inside a visit (a visit's first version follows whatever ended the
    visit before, which the caller keeps the same for every visit)."""
    out = {}
    for kept, i, kind, order in schedule:
        if not kept:
            continue
        places, after = out.setdefault((i, kind), (Counter(), Counter()))
        for p, x in enumerate(order):
            places[x, p] += 1
        for y, x in zip(order, order[1:]):
            after[x, y] += 1
    return out


def is_balanced(counts: tuple, n_versions: int) -> bool:
    """True when, in one entry of `order_balance`, every version took every place equally often and followed every
    other version equally often (and none followed itself)."""
    places, after = counts
    place_counts = {places[x, p] for x in range(n_versions) for p in range(n_versions)}
    pair_counts = {after[x, y] for x in range(n_versions) for y in range(n_versions) if x != y}
    return len(place_counts) == 1 and len(pair_counts) <= 1 and all(after[x, x] == 0 for x in range(n_versions))


def flip_test(diffs: Sequence[Sequence[float]], draws: int = 2000, seed: int = 3) -> tuple[float, float]:
    """Sign-flip permutation test of paired differences, stratified (one list per stratum, e.g. per size).

    Statistic: each stratum's sum(d) / sum(|d|), between -1 and +1 so that every stratum weighs alike whatever its
    scale, summed over the strata. Were the two versions equally fast (each difference as likely + as -, the visits
    independent), flipping signs at random leaves its distribution unchanged: flip each sign (|d| kept) `draws` times,
    seeded, and count draws at least as far from 0 as the observed. Returns (statistic, two-sided p), p from
    (1 + hits) / (1 + draws), so never below 1 / (1 + draws).
    """
    diffs = [list(d) for d in diffs]
    stat = lambda ds: sum(sum(d) / sum(map(abs, d)) for d in ds if any(d))
    observed, rng = stat(diffs), random.Random(seed)
    hits = sum(abs(stat([[x if rng.random() < 0.5 else -x for x in d] for d in diffs])) >= abs(observed) - 1e-12
               for _ in range(draws))
    return observed, (1 + hits) / (1 + draws)


def sign_test(diffs: Sequence[float]) -> tuple[int, int, float]:
    """Two-sided exact sign test of paired differences, zeros dropped: (rounds above 0, rounds below 0, p). It counts
    sides, not sizes, so one round slowed by the machine's load weighs no more than any other; n rounds all on one
    side give p = 2 / 2**n, its smallest value (0.0625 at n = 5)."""
    up, down = sum(d > 0 for d in diffs), sum(d < 0 for d in diffs)
    n = up + down
    p = min(1.0, 2 * sum(math.comb(n, i) for i in range(max(up, down), n + 1)) / 2 ** n) if n else 1.0
    return up, down, p


def separation_p(a: Sequence[float], b: Sequence[float]) -> float | None:
    """Exact two-sided rank-sum (Mann–Whitney) p of two samples that do not overlap at all (every value of one above
    every value of the other), or None where they overlap or touch (this helper covers complete separation only).

    Were the two versions equally fast, with all m + n values exchangeable, each of the C(m + n, m) ways to split the
    pooled ranks would be equally likely; one puts all of `a` on top and one all of `b`, so p = 2 / C(m + n, m): 0.0079
    at 5 + 5, where a paired sign test cannot go below 0.0625. It uses the values, not the visits: unlike the sign
    test it ignores the pairing, and rests on that exchangeability instead."""
    m, n = len(a), len(b)
    if not m or not n or not (min(a) > max(b) or min(b) > max(a)):
        return None
    return min(1.0, 2 / math.comb(m + n, m))


def paired(a: Sequence[float], b: Sequence[float]) -> Spread:
    """Spread of b − a taken visit by visit (a[j] and b[j] timed in the same visit)."""
    if len(a) != len(b):
        raise ValueError(f"paired samples need equal lengths, got {len(a)} and {len(b)}")
    return Spread.of([y - x for x, y in zip(a, b)])


def side(spread: Spread, at: float = 0.0, digits: int | None = None) -> str:
    """Where an interquartile range lies against `at`: 'above', 'below' or 'spans'. With `digits`, the quartiles are
    first rounded as printed (an end that prints as `at` reaches it)."""
    q1, q3 = (spread.q1, spread.q3) if digits is None else (round(spread.q1, digits), round(spread.q3, digits))
    return "above" if q1 > at else "below" if q3 < at else "spans"
