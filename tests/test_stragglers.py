"""utils.stragglers: the detector names an injected slow rank and no rank otherwise; the max-of-N models."""
import random

import pytest
import torch

from utils.stragglers import JitterModel, expected_max_of_samples, find_stragglers


def _ranks(n, steps, slow=None, extra=0.0, seed=0):
    rng = random.Random(seed)
    return [[0.020 + rng.gauss(0, 0.001) + (extra if r == slow else 0.0) + (0.06 if rng.random() < 0.03 else 0)
             for _ in range(steps)] for r in range(n)]


@pytest.mark.parametrize("seed", range(5))
def test_names_the_injected_slow_rank(seed):
    assert find_stragglers(_ranks(8, 50, slow=5, extra=0.010, seed=seed)) == [5]


@pytest.mark.parametrize("seed", range(5))
def test_names_no_rank_when_none_is_slow(seed):
    assert find_stragglers(_ranks(8, 50, seed=seed)) == []


def test_hand_computed_detector_cases():
    assert find_stragglers([[1.0, 1.0], [1.0, 1.0], [1.3, 1.3]]) == [2]     # 30 % over the typical rank
    assert find_stragglers([[1.0, 1.0], [1.0, 1.0], [1.1, 1.1]]) == []      # 10 % is under rel = 20 %
    assert find_stragglers([[1.0]]) == []


def test_expected_max_of_samples_hand_computed():
    # two equally likely values 1 and 3: max of 2 draws is 3 unless both are 1 (prob 1/4) → 2.5
    assert expected_max_of_samples([1.0, 3.0], 2) == pytest.approx(2.5)
    assert expected_max_of_samples([1.0, 3.0], 1) == pytest.approx(2.0)
    assert expected_max_of_samples([5.0, 5.0, 5.0], 1000) == pytest.approx(5.0)


def test_jitter_model_expected_max():
    normal = JitterModel(mean=10.0, std=1.0)
    assert normal.expected_max(1) == pytest.approx(10.0, abs=1e-6)
    assert normal.expected_max(2) == pytest.approx(10.0 + 1 / 3.141592653589793 ** 0.5, abs=1e-6)  # μ + σ/√π
    hiccups = JitterModel(mean=10.0, std=1e-9, p=0.5, hiccup=4.0)       # 10 or 14, equally likely
    assert hiccups.expected_max(2) == pytest.approx(10 + 4 * 0.75, abs=1e-4)
    g = torch.Generator().manual_seed(0)
    draws = hiccups.sample((20000,), g)
    assert abs((draws > 12).double().mean().item() - 0.5) < 0.02


def test_jitter_model_fit_recovers_the_injected_distribution():
    rng = random.Random(1)
    xs = [0.020 + rng.gauss(0, 0.001) + (0.060 if i % 20 == 0 else 0.0) for i in range(2000)]
    m = JitterModel.fit(xs)
    assert m.p == pytest.approx(0.05)
    assert m.mean == pytest.approx(0.020, abs=2e-4) and m.std == pytest.approx(0.001, rel=0.1)
    assert m.hiccup == pytest.approx(0.060, abs=1e-3)


def test_two_ranks_need_more_than_half_slower():
    # with two ranks the typical rank is their midpoint: b > 1.2·(a + b)/2 only when b > 1.5·a
    assert find_stragglers([[1.0] * 5, [1.45] * 5]) == []
    assert find_stragglers([[1.0] * 5, [1.55] * 5]) == [1]
