"""utils.pairing: a schedule that balances place and predecessor, and the stratified sign-flip test."""
import random

import pytest

from utils.pairing import flip_test, is_balanced, order_balance, paired, side, sweep_schedule
from utils.timing import Spread

SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20]


def test_schedule_balances_place_and_predecessor_per_size_and_kind():
    schedule = sweep_schedule(SIZES, 3, rounds=24, rounds_large=6, aa_below=16 << 20, seed=1)
    assert [kept for kept, *_ in schedule[:len(SIZES)]] == [False] * len(SIZES)      # the warm-up round first
    balance = order_balance(schedule, 3)
    assert set(balance) == {(i, k) for i in range(3) for k in ("A/B", "A/A")} | {(3, "A/B"), (4, "A/B")}
    assert all(is_balanced(counts, 3) for counts in balance.values())
    kept = [(i, kind) for k, i, kind, _ in schedule if k]
    assert kept.count((0, "A/B")) == kept.count((0, "A/A")) == 12 and kept.count((4, "A/B")) == 6
    assert schedule == sweep_schedule(SIZES, 3, rounds=24, rounds_large=6, aa_below=16 << 20, seed=1)   # seeded


def test_schedule_refuses_counts_that_cannot_balance():
    with pytest.raises(ValueError, match="multiple"):
        sweep_schedule(SIZES, 3, rounds=20, rounds_large=5, aa_below=16 << 20)


def test_is_balanced_can_fail():
    rotated = [(True, 0, "A/B", [(x + r) % 3 for x in range(3)]) for r in range(3)]   # places even, pairs not
    assert not is_balanced(order_balance(rotated, 3)[0, "A/B"], 3)


def test_flip_test_p_is_about_uniform_on_symmetric_noise():
    rng = random.Random(0)
    ps = [flip_test([[rng.gauss(0, 1) for _ in range(12)] for _ in range(3)], draws=199, seed=s)[1]
          for s in range(200)]
    assert 0.0 <= sum(p < 0.05 for p in ps) / len(ps) <= 0.12          # nominal 5 %
    assert 0.35 <= sum(p < 0.5 for p in ps) / len(ps) <= 0.65          # nominal 50 %
    assert 0.4 <= sum(ps) / len(ps) <= 0.6                             # mean of a uniform p


def test_flip_test_finds_a_shift_and_its_sign():
    rng = random.Random(1)
    shifted = [[rng.gauss(0.8, 1) for _ in range(24)] for _ in range(4)]
    statistic, p = flip_test(shifted)
    assert statistic > 0 and p < 0.01
    statistic, p = flip_test([[-x for x in d] for d in shifted])
    assert statistic < 0 and p < 0.01
    assert flip_test([[1.0, 2.0]], draws=99)[1] >= 1 / 100               # p never below 1/(1 + draws)


def test_paired_and_side():
    s = paired([1.0, 2.0, 3.0, 4.0], [2.0, 3.5, 4.0, 6.0])
    assert s.median == pytest.approx(1.25) and side(s) == "above"
    assert side(Spread.of([-1.0, -0.5, 0.5, 1.0])) == "spans"
    assert side(Spread(1.0, 1.001, 1.2, 1.0, 1.3, 5), at=1, digits=2) == "spans"          # prints as 1.00
    with pytest.raises(ValueError):
        paired([1.0], [1.0, 2.0])


def test_sign_test_counts_sides_and_gives_the_exact_two_sided_p():
    from utils.pairing import sign_test
    assert sign_test([1.0, 2.0, 3.0, 4.0, 5.0]) == (5, 0, 0.0625)
    up, down, p = sign_test([1.0] * 11 + [-200.0])          # one huge round weighs like any other
    assert (up, down) == (11, 1) and abs(p - 2 * 13 / 4096) < 1e-12
    assert sign_test([0.0, 1.0, -1.0]) == (1, 1, 1.0)          # zeros dropped
    assert sign_test([]) == (0, 0, 1.0)


def test_separation_p_is_the_exact_rank_sum_tail_of_complete_separation():
    import itertools
    import math
    from utils.pairing import separation_p
    assert separation_p([5.0, 6, 7, 8, 9], [0.0, 1, 2, 3, 4]) == pytest.approx(2 / 252)
    assert separation_p([0.0, 1, 2, 3, 4], [5.0, 6, 7, 8, 9]) == pytest.approx(2 / 252)   # either side on top
    assert separation_p([1.0, 5, 6], [2.0, 3]) is None                                     # overlapping
    assert separation_p([3.0, 4], [1.0, 3]) is None                                        # touching: a tie
    assert separation_p([2.0], [1.0]) == 1.0 and separation_p([], [1.0]) is None
    # against brute force: every split of 4 + 3 ranks, counting those with U as extreme as complete separation's
    m, n = 4, 3
    splits = list(itertools.combinations(range(m + n), m))
    u = lambda top: sum(i > j for i in top for j in set(range(m + n)) - set(top))   # pairs a above b
    extreme = sum(u(top) in (0, m * n) for top in splits) / len(splits)
    assert separation_p([10.0, 11, 12, 13], [0.0, 1, 2]) == pytest.approx(extreme) == pytest.approx(2 / math.comb(7, 4))
