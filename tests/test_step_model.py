"""utils.step_model: hand-computed cases of the α–β ring, overlap and efficiency."""
import pytest

from utils.step_model import (bucketed_all_reduce_seconds, compute_seconds, efficiency,
                              halving_doubling_all_reduce_seconds, halving_doubling_any_n_all_reduce_seconds,
                              hierarchical_all_reduce_seconds,
                              ring_all_reduce_seconds, scaling_efficiency, step_seconds)


def test_ring_seed_figures():
    # 7B bf16 gradients (14 GB) on 8 GPUs: each moves 2·7/8·14 GB = 24.5 GB; 400 GB/s → 61.25 ms
    assert ring_all_reduce_seconds(14e9, 8, 0.0, 400e9) == pytest.approx(0.06125)
    # 25 Gb/s Ethernet = 3.125 GB/s → 7.84 s
    assert ring_all_reduce_seconds(14e9, 8, 0.0, 25e9 / 8) == pytest.approx(7.84)


def test_ring_latency_and_single_rank():
    assert ring_all_reduce_seconds(0, 4, 1e-3, 1e9) == pytest.approx(6e-3)       # 2(N−1) = 6 messages
    assert ring_all_reduce_seconds(1200, 4, 0.0, 100.0) == pytest.approx(18.0)   # 2·3/4·1200 B at 100 B/s
    assert ring_all_reduce_seconds(10**9, 1, 1.0, 1.0) == 0.0
    with pytest.raises(ValueError):
        ring_all_reduce_seconds(1, 0, 0, 1)


def test_halving_doubling_and_hierarchical():
    assert halving_doubling_all_reduce_seconds(0, 1024, 1e-5, 1e9) == pytest.approx(2 * 10 * 1e-5)
    assert halving_doubling_all_reduce_seconds(0, 1000, 1e-5, 1e9) == pytest.approx(2 * 10 * 1e-5)   # ⌈log₂ 1000⌉ = 10
    assert halving_doubling_all_reduce_seconds(5, 1, 1, 1) == 0.0
    # non-power of two: 512 ranks run the exact algorithm, the 488 others fold in and out (2 more full steps)
    assert halving_doubling_any_n_all_reduce_seconds(1024.0, 1000, 1.0, 1.0) == pytest.approx(
        2 * 9 * 1.0 + 2 * 511 / 512 * 1024.0 + 2 * (1.0 + 1024.0))
    assert halving_doubling_any_n_all_reduce_seconds(1024.0, 1024, 1.0, 1.0) == halving_doubling_all_reduce_seconds(
        1024.0, 1024, 1.0, 1.0)
    # 16 ranks, 8 per node: intra ring of 8 on M, inter ring of 2 on M/8
    t = hierarchical_all_reduce_seconds(800.0, 16, 8, 1.0, 100.0, 10.0, 1.0)
    assert t == pytest.approx(2 * 7 * (1.0 + 100 / 100.0) + 2 * 1 * (10.0 + 50 / 1.0))
    # 256 ranks in 32 nodes, a log-N all-reduce across the nodes: 2·log₂ 32 = 10 messages there, not a ring's 2·31
    t = hierarchical_all_reduce_seconds(800.0, 256, 8, 1.0, 100.0, 10.0, 1.0,
                                        inter_allreduce=halving_doubling_all_reduce_seconds)
    assert t == pytest.approx(2 * 7 * (1.0 + 100 / 100.0) + 2 * 5 * 10.0 + 2 * 31 / 32 * 100 / 1.0)
    with pytest.raises(ValueError):
        hierarchical_all_reduce_seconds(1, 10, 8, 1, 1, 1, 1)


def test_step_with_and_without_overlap():
    assert step_seconds(0.100, 0.040) == pytest.approx(0.140)
    assert step_seconds(0.100, 0.040, overlap=2 / 3) == pytest.approx(0.100)   # fully hidden
    assert step_seconds(0.100, 0.080, overlap=0.5) == pytest.approx(0.130)      # 30 ms exposed
    # "2× faster compute": 140 ms → 90 ms, a 1.56× faster step
    assert step_seconds(0.100, 0.040) / step_seconds(0.050, 0.040) == pytest.approx(140 / 90)
    with pytest.raises(ValueError):
        step_seconds(1, 1, overlap=1.5)


def test_efficiencies():
    assert efficiency(0.100, 0.025) == pytest.approx(0.8)
    assert efficiency(0.100, 0.025, overlap=0.5) == 1.0
    assert scaling_efficiency(720e3, 100e3, 8) == pytest.approx(0.9)
    assert compute_seconds(1e9, 1000, 6e12) == pytest.approx(1.0)


def test_halving_doubling_latency_grows_as_log2():
    # 2⌈log₂ N⌉ latencies: 20 at 1,000 ranks, 28 at 10,000 (a ring: 1,998 and 19,998)
    assert halving_doubling_all_reduce_seconds(0, 1000, 1.0, 1.0) == pytest.approx(20.0)
    assert halving_doubling_all_reduce_seconds(0, 10000, 1.0, 1.0) == pytest.approx(28.0)
    assert ring_all_reduce_seconds(0, 10000, 1.0, 1.0) == pytest.approx(19998.0)


def test_bucketed():
    # 10 bytes in buckets of 4: two full buckets and one of 2, each a ring of 2 ranks (2 messages)
    t = bucketed_all_reduce_seconds(10, 4, 2, 1.0, 1.0)
    assert t == pytest.approx(2 * (2 * (1 + 2)) + 2 * (1 + 1))
    assert bucketed_all_reduce_seconds(8, 4, 2, 1.0, 1.0) == pytest.approx(2 * ring_all_reduce_seconds(4, 2, 1.0, 1.0))
    assert bucketed_all_reduce_seconds(10, 4, 1000, 1.0, 1e9, halving_doubling_all_reduce_seconds) == pytest.approx(
        3 * 20.0, rel=1e-6)
    with pytest.raises(ValueError):
        bucketed_all_reduce_seconds(10, 0, 2, 1.0, 1.0)
