"""utils.timing: rotated interleaving, spread, and verdicts that refuse to read noise."""
from collections import Counter

import pytest

from utils.timing import Spread, compare, rotated_rounds, separated


def test_every_variant_runs_in_every_position_equally_often():
    names = ["a", "b", "c"]
    rounds = list(rotated_rounds(names, repeats=6, warmup=1))
    assert len(rounds) == 3 * 7
    assert [rep for rep, _ in rounds[:3]] == [-1, -1, -1]          # the warm-up round comes first
    kept = [name for rep, name in rounds if rep >= 0]
    positions = Counter((i % 3, name) for i, name in enumerate(kept))
    assert set(positions.values()) == {2}                           # 6 rounds / 3 positions, each name


def test_spread_quartiles_and_small_samples():
    s = Spread.of([5.0, 1.0, 3.0, 2.0, 4.0])
    assert (s.median, s.q1, s.q3, s.low, s.high, s.count) == (3.0, 2.0, 4.0, 1.0, 5.0, 5)
    small = Spread.of([2.0, 1.0])
    assert (small.q1, small.q3) == (1.0, 2.0)
    assert "IQR 2–4" in s.format(scale=1, unit="s")
    with pytest.raises(ValueError):
        Spread.of([])


def test_overlapping_spreads_are_no_measurable_difference():
    a = [1.0, 1.1, 1.2, 1.3, 1.4]
    b = [1.15, 1.25, 1.35, 1.45, 1.55]                               # medians differ, IQRs overlap
    assert not separated(a, b)
    assert "no measurable difference here" in compare(a, b, "x", "y")


def test_separated_spreads_name_the_faster_variant():
    a = [2.0, 2.1, 2.2, 2.3]
    b = [1.0, 1.05, 1.1, 1.2]
    assert separated(a, b)
    verdict = compare(a, b, "slow one", "fast one")
    assert verdict.startswith("fast one is 2") and "faster than slow one" in verdict


def test_below_four_samples_the_labels_say_min_max():
    small = Spread.of([3.0, 1.0, 2.0])
    assert small.format(scale=1, unit="s") == "2 s (min–max 1–3, n=3)"             # no quartiles to call IQR
    assert Spread.of([5.0, 1.0, 3.0, 2.0]).format(scale=1, unit="s") == "2.5 s (IQR 1.75–3.5, min–max 1–5, n=4)"
    assert compare([1.0, 1.1, 1.2], [2.0, 2.1, 2.2], "x", "y").endswith("their min–max ranges do not overlap)")
    assert compare([1.0, 1.5, 2.1], [2.0, 2.1, 2.2], "x", "y").endswith("their min–max ranges overlap)")
    mixed = compare([1.0, 1.1, 1.2], [2.0, 2.1, 2.2, 2.3], "x", "y")
    assert mixed.endswith("ranges (interquartile from 4 samples, min–max below) do not overlap)")
    assert compare([2.0, 2.1, 2.2, 2.3], [1.0, 1.05, 1.1, 1.2], "a", "b").endswith(
        "their interquartile ranges do not overlap)")                            # n ≥ 4: as before


def test_throughput_is_tokens_per_step_over_the_median_step_after_warm_up():
    from utils.timing import throughput
    steps = [9.0] * 5 + [0.010, 0.020, 0.040, 0.020, 0.010]   # five slow warm-up steps, then five kept
    t = throughput(steps, 1000, warmup=5)
    assert t.median == pytest.approx(1000 / 0.020) and t.count == 5
    assert t.low == pytest.approx(1000 / 0.040) and t.high == pytest.approx(1000 / 0.010)
    assert t.low <= t.q1 <= t.median <= t.q3 <= t.high
    with pytest.raises(ValueError, match="warm-up"):
        throughput(steps[:5], 1000, warmup=5)


@pytest.mark.parametrize("count", [2, 3, 4, 5, 8, 12])
def test_williams_design_balances_position_and_the_variant_before(count):
    names = [f"v{i}" for i in range(count)]
    cycle = count if count % 2 == 0 else 2 * count                  # rounds in one full design
    rounds = list(rotated_rounds(names, repeats=2 * cycle, warmup=1, design="williams"))
    assert [rep for rep, _ in rounds[:count]] == [-1] * count
    kept = [name for rep, name in rounds if rep >= 0]
    orders = [kept[i:i + count] for i in range(0, len(kept), count)]
    assert all(sorted(order) == sorted(names) for order in orders)  # each round runs every variant once
    positions = Counter((i, name) for order in orders for i, name in enumerate(order))
    assert set(positions.values()) == {2 * cycle // count}          # every position equally often
    before = Counter((a, b) for order in orders for a, b in zip(order, order[1:]))
    assert len(before) == count * (count - 1)                       # every ordered pair occurs …
    assert set(before.values()) == {2 * cycle // count}             # … equally often


def test_cyclic_rotation_keeps_neighbours_together():
    # the default: position is balanced but the variant before is not (why the Williams design exists)
    names = ["a", "b", "c", "d"]
    kept = [name for rep, name in rotated_rounds(names, repeats=4, warmup=0)]
    orders = [kept[i:i + 4] for i in range(0, 16, 4)]
    before = Counter((a, b) for order in orders for a, b in zip(order, order[1:]))
    assert before[("a", "b")] == 3 and before[("b", "a")] == 0
    with pytest.raises(ValueError):
        list(rotated_rounds(names, repeats=1, design="latin"))


def test_median_ci_is_seeded_narrows_with_samples_and_covers_the_median():
    from utils.timing import median_ci
    few = [0.01 * i for i in range(-5, 6)]                          # median 0
    many = few * 9
    lo, hi = median_ci(few)
    assert lo <= 0 <= hi and median_ci(few) == (lo, hi)             # the same samples, the same interval
    lo9, hi9 = median_ci(many)
    assert lo <= lo9 <= 0 <= hi9 <= hi and hi9 - lo9 < hi - lo      # more samples, a narrower interval
    assert median_ci([3.0]) == (3.0, 3.0)
    with pytest.raises(ValueError):
        median_ci([])


def test_within_tolerance_needs_clearance_both_ways():
    from utils.timing import within_tolerance
    assert within_tolerance((-0.05, 0.07), 0.10, 0.02) == "holds"
    assert within_tolerance((-0.05, 0.09), 0.10, 0.02) == "not resolved"     # inside, but within the margin
    assert within_tolerance((-0.20, -0.125), 0.10, 0.02) == "fails"
    assert within_tolerance((-0.20, -0.11), 0.10, 0.02) == "not resolved"    # outside by less than the margin
    assert within_tolerance((0.13, 0.30), 0.10, 0.02) == "fails"
    assert within_tolerance((-0.15, 0.05), 0.10, 0.02) == "not resolved"     # straddles an edge
    with pytest.raises(ValueError):
        within_tolerance((0.1, 0.0), 0.10, 0.02)
