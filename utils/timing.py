"""Timings a reader can trust: variants interleaved, spread kept, differences judged against the spread.

On a shared machine one timing scatters by tens of percent, and whatever runs first or second in a
sequence can be systematically favoured (caches, CPU frequency, another process waking up). So:

    for rep, name in rotated_rounds(["ring", "pipelined"], repeats=7):
        t = measure(name)                      # however the caller times one run
        if rep >= 0:                           # negative reps are warm-up rounds: not kept
            samples[name].append(t)
    Spread.of(samples["ring"])                 # median, quartiles, min, max
    compare(samples["ring"], samples["pipelined"], "ring", "pipelined")
        → "pipelined is 1.8× faster than ring" or "no measurable difference here (…)"

A verdict computed from timings changes between runs: print it in a cell nbval ignores, and let the
lesson's prose say what to look for, not which way it went.

Importing this module, and each rotated_rounds, first waits for the forkserver warm-up that
`import utils` starts in a notebook (utils/warmup.py): it burns CPU that would skew a timing.
"""
from __future__ import annotations

import random
import statistics
from typing import Iterator, NamedTuple, Sequence

from . import warmup as _warmup

_warmup.wait()  # e.g. lesson 01 times its baseline right after the setup cell started the warm-up


def rotated_rounds(names: Sequence[str], repeats: int, warmup: int = 1,
                   design: str = "cyclic") -> Iterator[tuple[int, str]]:
    """Yield (repetition, name): each round runs every variant once, in an order that changes from round to round.

    The first `warmup` rounds come with negative repetition numbers: run them, do not keep them.
    design="cyclic" (the default): each round starts one variant later. Over len(names) rounds every variant
    runs in every position equally often, so an order effect spreads over all variants instead of favouring
    one; but neighbours stay neighbours, so a variant follows the same variant in almost every round.
    design="williams": a Williams design (a Latin square balanced for the step before). Over len(names) rounds
    (2·len(names) when the count is odd) every variant still runs in every position equally often, and within
    a round every variant runs right after every other variant equally often (once, or twice for an odd count),
    so an effect that one variant leaves on the next is spread too. The round boundary (the last variant of one
    round before the first of the next) is not balanced.
    """
    names = list(names)
    if design == "cyclic":
        orders = [[(i + shift) % len(names) for i in range(len(names))] for shift in range(len(names))]
    elif design == "williams":
        orders = _williams(len(names))
    else:
        raise ValueError(f"design must be 'cyclic' or 'williams', not {design!r}")
    _warmup.wait()
    for round_ in range(-warmup, repeats):
        for index in orders[round_ % len(orders)]:
            yield round_, names[index]


def _williams(n: int) -> list[list[int]]:
    """The rows of a Williams design for n variants: n rows for even n, 2n (the rows and their reverses) for odd n."""
    first, low, high = [0], 1, n - 1                 # 0, 1, n−1, 2, n−2, …: every difference mod n once
    while len(first) < n:
        first.append(low)
        low += 1
        if len(first) < n:
            first.append(high)
            high -= 1
    rows = [[(v + shift) % n for v in first] for shift in range(n)]
    return rows if n % 2 == 0 else rows + [row[::-1] for row in rows]


class Spread(NamedTuple):
    """Summary of repeated timings: median, quartiles (q1, q3), min and max, and the count."""
    median: float
    q1: float
    q3: float
    low: float
    high: float
    count: int

    @classmethod
    def of(cls, samples: Sequence[float]) -> "Spread":
        """The spread of `samples` (at least one). Quartiles need 4 samples; below that they are min and max."""
        xs = sorted(samples)
        if not xs:
            raise ValueError("Spread.of needs at least one sample")
        if len(xs) >= 4:
            q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive")
        else:
            q1, q3 = xs[0], xs[-1]
        return cls(statistics.median(xs), q1, q3, xs[0], xs[-1], len(xs))

    def format(self, scale: float = 1e3, unit: str = "ms", digits: int = 3) -> str:
        """'1.23 ms (IQR 1.10–1.40, min–max 1.02–1.91, n=7)', values multiplied by `scale`.

        Below 4 samples there are no quartiles, so only the min–max range is printed: '1.23 ms (min–max …, n=3)'.
        """
        f = lambda v: f"{v * scale:.{digits}g}"
        iqr = f"IQR {f(self.q1)}–{f(self.q3)}, " if self.count >= 4 else ""
        return f"{f(self.median)} {unit} ({iqr}min–max {f(self.low)}–{f(self.high)}, n={self.count})"


def separated(a: Sequence[float], b: Sequence[float]) -> bool:
    """True when the interquartile ranges of `a` and `b` do not overlap (min–max below 4 samples)."""
    sa, sb = Spread.of(a), Spread.of(b)
    return sa.q3 < sb.q1 or sb.q3 < sa.q1


def compare(a: Sequence[float], b: Sequence[float], name_a: str, name_b: str, scale: float = 1e3,
            unit: str = "ms") -> str:
    """One sentence on two sets of timings in seconds (lower is faster), honest about noise.

    'name_b is 1.8× faster than name_a (medians …)' only when their interquartile ranges are apart (min–max
    ranges below 4 samples, and the sentence says which); otherwise 'no measurable difference here'.
    Medians are printed multiplied by `scale`, in `unit`.
    """
    sa, sb = Spread.of(a), Spread.of(b)
    detail = f"medians {sa.median * scale:.3g} vs {sb.median * scale:.3g} {unit}"
    ranges = _range_label(sa.count, sb.count)
    if not separated(a, b):
        return f"{name_a} vs {name_b}: no measurable difference here ({detail}; their {ranges} overlap)"
    fast, slow = (name_a, name_b) if sa.median < sb.median else (name_b, name_a)
    ratio = max(sa.median, sb.median) / min(sa.median, sb.median)
    return f"{fast} is {ratio:.3g}× faster than {slow} ({detail}; their {ranges} do not overlap)"


def _range_label(count_a: int, count_b: int) -> str:
    """What `separated` compared: quartiles need 4 samples, below that the whole min–max range stands in."""
    if count_a >= 4 and count_b >= 4:
        return "interquartile ranges"
    if count_a < 4 and count_b < 4:
        return "min–max ranges"
    return "ranges (interquartile from 4 samples, min–max below)"


def throughput(step_seconds: Sequence[float], tokens_per_step: float, warmup: int = 5) -> Spread:
    """Tokens/s the course's one way: after `warmup` steps, tokens per step over the median step time.

    Returns a Spread of tokens/s: median = tokens_per_step / median step time; the quartiles and min/max
    come from the step times' (a slower step is a lower rate: q1 from the step times' q3, low from their max).
    """
    kept = list(step_seconds)[warmup:]
    if not kept:
        raise ValueError(f"throughput needs more than {warmup} step times: the first {warmup} are warm-up")
    t = Spread.of(kept)
    return Spread(tokens_per_step / t.median, tokens_per_step / t.q3, tokens_per_step / t.q1,
                  tokens_per_step / t.high, tokens_per_step / t.low, t.count)


def median_ci(samples: Sequence[float], level: float = 0.9, resamples: int = 2000, seed: int = 0) -> tuple:
    """(low, high): a percentile-bootstrap confidence interval of the median of `samples` at `level`.

    The uncertainty of a typical value (a model's bias), not the scatter of single samples: resample the
    samples with replacement `resamples` times, take each resample's median, and return the two quantiles
    that leave (1 − level)/2 on each side. Seeded, so the same samples always give the same interval.
    """
    xs = list(samples)
    if not xs:
        raise ValueError("median_ci needs at least one sample")
    if not 0 < level < 1:
        raise ValueError(f"level must lie between 0 and 1, got {level}")
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(xs, k=len(xs))) for _ in range(resamples))
    cut = (1 - level) / 2
    return medians[int(cut * (resamples - 1))], medians[int(round((1 - cut) * (resamples - 1)))]


def within_tolerance(ci: tuple, tolerance: float, margin: float) -> str:
    """'holds', 'fails' or 'not resolved': an interval (low, high) judged against ±`tolerance`, with a clearance.

    holds: the whole interval lies inside ±(tolerance − margin); fails: it lies wholly beyond +(tolerance +
    margin) or below −(tolerance + margin); otherwise it comes within `margin` of an edge or straddles one.
    """
    low, high = ci
    if low > high or tolerance <= 0 or not 0 <= margin < tolerance:
        raise ValueError(f"need low <= high and 0 <= margin < tolerance, got {ci}, {tolerance}, {margin}")
    if -(tolerance - margin) <= low and high <= tolerance - margin:
        return "holds"
    if high < -(tolerance + margin) or low > tolerance + margin:
        return "fails"
    return "not resolved"
