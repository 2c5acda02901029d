"""A step-time model for data parallelism: compute, plus the part of the gradient all-reduce overlap does not hide.

    comm  = ring_all_reduce_seconds(grad_bytes, n, alpha, bandwidth)   # 2(N−1)·α + 2(N−1)/N · M / bandwidth
    step  = step_seconds(compute, comm, overlap)                        # compute + max(0, comm − overlap·compute)
    eff   = compute / step                                              # = scaling efficiency under weak scaling

`overlap` is the fraction of the compute time during which communication can run alongside it (the backward
pass is about 2/3 of forward + backward, so overlap ≤ 2/3 is the usual ceiling; 0 = all-reduce after backward).
`alpha` is seconds per message, `bandwidth` bytes per second (per rank, each direction). The same α–β costs as
lesson 03's fit and as utils.simlink's simulated link: a run on that link cannot test the α–β formula (the link
sleeps it), only how compute and communication combine — overlap, the buckets, host overhead.
"""
from __future__ import annotations

import math

__all__ = ["ring_all_reduce_seconds", "halving_doubling_all_reduce_seconds",
           "halving_doubling_any_n_all_reduce_seconds", "hierarchical_all_reduce_seconds",
           "bucketed_all_reduce_seconds", "step_seconds", "efficiency", "scaling_efficiency", "compute_seconds"]


def ring_all_reduce_seconds(nbytes: float, n: int, alpha: float, bandwidth: float) -> float:
    """Ring all-reduce of `nbytes` on `n` ranks: 2(n−1) messages of nbytes/n → 2(n−1)α + 2(n−1)/n·nbytes/bandwidth."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    return 2 * (n - 1) * (alpha + nbytes / n / bandwidth)


def halving_doubling_all_reduce_seconds(nbytes: float, n: int, alpha: float, bandwidth: float) -> float:
    """Recursive halving-doubling: 2·⌈log₂ n⌉·α + 2(n−1)/n·nbytes/bandwidth. Exact when n is a power of two
    (log₂ n halving steps of a reduce-scatter, then log₂ n doubling steps of an all-gather); other n need
    extra steps, so for them it is optimistic (`halving_doubling_any_n_all_reduce_seconds` prices them). The latency grows as log₂ n (20α at 1,000 ranks, 28α at 10,000),
    far slower than a ring's 2(n−1)α. Both terms are near the limits: any all-reduce needs at least ⌈log₂ n⌉
    rounds of messages, and each rank must send and receive 2(n−1)/n of the data. Not a model of NCCL's
    pipelined double binary tree."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if n == 1:
        return 0.0
    return 2 * math.ceil(math.log2(n)) * alpha + 2 * (n - 1) / n * nbytes / bandwidth


def halving_doubling_any_n_all_reduce_seconds(nbytes: float, n: int, alpha: float, bandwidth: float) -> float:
    """Recursive halving-doubling with the extra steps a non-power-of-two n needs (Thakur, Rabenseifner & Gropp,
    2005): the n − p ranks beyond the largest power of two p ≤ n first hand their whole buffer to a partner and
    get the result back at the end, 2(α + nbytes/bandwidth) more, then p ranks run the exact algorithm:
    2·log₂p·α + 2(p−1)/p·nbytes/bandwidth. At n = 1,000 (p = 512) the latency is the same 20α as
    `halving_doubling_all_reduce_seconds` prices, but the bandwidth term about doubles."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    p = 1 << (n.bit_length() - 1)                     # largest power of two <= n
    extra = 0.0 if p == n else 2 * (alpha + nbytes / bandwidth)
    return halving_doubling_all_reduce_seconds(nbytes, p, alpha, bandwidth) + extra


def hierarchical_all_reduce_seconds(nbytes: float, n: int, per_node: int, alpha_intra: float,
                                    bandwidth_intra: float, alpha_inter: float, bandwidth_inter: float,
                                    inter_allreduce=ring_all_reduce_seconds) -> float:
    """Two-level all-reduce: reduce-scatter inside each node (ring of `per_node`), an all-reduce of each
    1/per_node shard across the n/per_node nodes (a ring unless `inter_allreduce` says otherwise, e.g.
    `halving_doubling_any_n_all_reduce_seconds`), all-gather inside the node. Assumes each GPU has its own
    inter-node link at bandwidth_inter, so the per_node shards cross the network in parallel."""
    if n % per_node:
        raise ValueError(f"n = {n} is not a multiple of per_node = {per_node}")
    nodes = n // per_node
    intra = ring_all_reduce_seconds(nbytes, per_node, alpha_intra, bandwidth_intra)   # reduce-scatter + all-gather
    inter = inter_allreduce(nbytes / per_node, nodes, alpha_inter, bandwidth_inter)
    return intra + inter


def bucketed_all_reduce_seconds(nbytes: float, bucket: float, n: int, alpha: float, bandwidth: float,
                                allreduce=ring_all_reduce_seconds) -> float:
    """All-reduce `nbytes` as DDP does, in buckets of `bucket` bytes (the last one holds the rest), one
    `allreduce(bucket_bytes, n, alpha, bandwidth)` after another: each bucket pays its own latency term."""
    if bucket <= 0:
        raise ValueError(f"bucket must be > 0 bytes, got {bucket}")
    full, rest = divmod(nbytes, bucket)
    return full * allreduce(bucket, n, alpha, bandwidth) + (allreduce(rest, n, alpha, bandwidth) if rest else 0.0)


def step_seconds(compute: float, comm: float, overlap: float = 0.0) -> float:
    """compute + the communication that overlap does not hide: compute + max(0, comm − overlap·compute)."""
    if not 0.0 <= overlap <= 1.0:
        raise ValueError(f"overlap is a fraction of the compute time in [0, 1], got {overlap}")
    return compute + max(0.0, comm - overlap * compute)


def efficiency(compute: float, comm: float, overlap: float = 0.0) -> float:
    """Share of the step spent computing: compute / step_seconds(...). Under weak scaling this *is* the
    scaling efficiency throughput_N / (N · throughput_1)."""
    return compute / step_seconds(compute, comm, overlap)


def scaling_efficiency(throughput_n: float, throughput_1: float, n: int) -> float:
    """throughput_N / (N × throughput_1): 1.0 is perfect linear scaling."""
    return throughput_n / (n * throughput_1)


def compute_seconds(params: float, tokens: float, flops_per_second: float) -> float:
    """Forward + backward time of a dense transformer: ≈ 6 FLOPs per parameter per token, at the given
    *achieved* FLOP/s (peak × utilisation)."""
    return 6 * params * tokens / flops_per_second
