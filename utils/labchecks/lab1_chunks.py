"""Lab 1's chunks, positions and inputs: how a tensor is split over N ranks, the fold rule's positions, and
the input each rank gets."""
from __future__ import annotations

import torch


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

