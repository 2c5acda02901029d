"""Stragglers: name the slow rank from per-rank timings, and model the synchronised step as a maximum.

    busy = gather_per_rank(my_busy_seconds)        # every rank: list (rank order) of every rank's timings
    find_stragglers(busy)                           # → [3]  (or [] when no rank stands out)

    jitter = JitterModel.fit(unsynchronised_step_times)
    jitter.expected_max(n)                          # expected synchronised step on n ranks (i.i.d. ranks)

Time a rank's *own* work (data + compute, up to the collective), not its whole step: in synchronous training
every rank's step lasts as long as the slowest one's, so whole steps cannot tell the ranks apart.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

import torch

__all__ = ["find_stragglers", "gather_per_rank", "JitterModel", "expected_max_of_samples"]


def find_stragglers(per_rank: list, rel: float = 0.2, k: float = 6.0) -> list:
    """Ranks whose median time exceeds the typical rank's by more than max(rel × typical, k × noise).

    `per_rank[r]` is rank r's list of timings. The typical rank is the median of the ranks' medians; the noise
    is the median over ranks of each rank's median absolute deviation (robust: one slow rank or a few hiccups
    do not move it). Both thresholds must be passed, so ordinary jitter essentially never names a rank.
    The rule needs a healthy majority: with two ranks the typical rank is the midpoint of the two, so a straggler
    must be more than 50 % slower than the other rank to be named (with rel = 0.2).
    """
    if len(per_rank) < 2:
        return []
    medians = [statistics.median(times) for times in per_rank]
    typical = statistics.median(medians)
    noise = statistics.median(statistics.median(abs(t - m) for t in times)
                              for times, m in zip(per_rank, medians))
    threshold = typical + max(rel * typical, k * noise)
    return [r for r, m in enumerate(medians) if m > threshold]


def gather_per_rank(values, group=None) -> list:
    """All-gather a list of floats (the same length on every rank): returns every rank's list, in rank order."""
    import torch.distributed as dist

    from .devices import device
    mine = torch.tensor(list(values), dtype=torch.float64, device=device())   # NCCL: on this rank's GPU
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    return [t.tolist() for t in everyone]


def expected_max_of_samples(samples, n: int) -> float:
    """Exact expected maximum of n draws (with replacement) from the empirical distribution of `samples`:
    Σ x₍ᵢ₎ · [(i/m)ⁿ − ((i−1)/m)ⁿ] over the m sorted samples."""
    xs = sorted(samples)
    m = len(xs)
    return sum(x * ((i / m) ** n - ((i - 1) / m) ** n) for i, x in enumerate(xs, start=1))


def _normal_cdf(z):
    return 0.5 * (1 + torch.erf(z / math.sqrt(2)))


@dataclass
class JitterModel:
    """A rank's step time: normal(mean, std), plus with probability `p` a hiccup adding `hiccup` seconds."""
    mean: float
    std: float
    p: float = 0.0
    hiccup: float = 0.0

    @classmethod
    def fit(cls, samples, k: float = 6.0) -> "JitterModel":
        """Calibrate on measured step times: samples more than k robust standard deviations (1.4826 × the
        median absolute deviation) above the median are hiccups (their share is p, their mean excess over the
        rest's mean is the hiccup); the rest give mean and std."""
        xs = list(samples)
        median = statistics.median(xs)
        cut = median + k * 1.4826 * statistics.median(abs(x - median) for x in xs)
        normal = [x for x in xs if x <= cut]
        slow = [x for x in xs if x > cut]
        mean, std = statistics.fmean(normal), statistics.pstdev(normal)
        hiccup = statistics.fmean(slow) - mean if slow else 0.0
        return cls(mean, std, len(slow) / len(xs), hiccup)

    def cdf(self, t: torch.Tensor) -> torch.Tensor:
        std = max(self.std, 1e-12)
        return ((1 - self.p) * _normal_cdf((t - self.mean) / std)
                + self.p * _normal_cdf((t - self.mean - self.hiccup) / std))

    def expected_max(self, n: int, points: int = 20001) -> float:
        """E[max of n independent step times] = lo + ∫ (1 − F(t)ⁿ) dt, integrated numerically (float64)."""
        std = max(self.std, 1e-12)
        lo, hi = self.mean - 12 * std, self.mean + self.hiccup + 12 * std
        threads = torch.get_num_threads()
        torch.set_num_threads(1)        # 20,001 points are too few for intra-op threads: on a busy machine
        try:                            # waking them cost ~8× the work (45 ms instead of 5.5 ms per call)
            t = torch.linspace(lo, hi, points, dtype=torch.float64)
            return lo + torch.trapezoid(1 - self.cdf(t) ** n, t).item()
        finally:
            torch.set_num_threads(threads)

    def sample(self, shape, generator: torch.Generator) -> torch.Tensor:
        """Draw step times (float64) of the given shape."""
        normal = self.mean + self.std * torch.randn(shape, generator=generator, dtype=torch.float64)
        hiccups = torch.rand(shape, generator=generator, dtype=torch.float64) < self.p
        return normal + self.hiccup * hiccups
