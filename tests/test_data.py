"""The synthetic token source: deterministic, shardable, and its floor is right."""

import math

import numpy as np
import pytest
import torch

from utils.data import MarkovSource, TokenDataset, empirical_conditional_entropy


@pytest.fixture(scope="module")
def source():
    return MarkovSource(vocab_size=8, order=2, seed=0)


def test_same_seed_same_tokens_and_pinned_values(source):
    again = MarkovSource(vocab_size=8, order=2, seed=0)
    assert torch.equal(source.counts, again.counts)
    assert torch.equal(source.sequences(range(5), 40), again.sequences(range(5), 40))
    # Pinned: integer-only sampling must give these tokens on every machine.
    assert source.sequences([0], 15)[0].tolist() == [0, 4, 2, 2, 7, 2, 6, 1, 2, 3, 4, 2, 2, 7, 3, 3]
    assert source.entropy_rate == pytest.approx(0.9749587020780819, abs=1e-9)


def test_different_seed_different_chain(source):
    other = MarkovSource(vocab_size=8, order=2, seed=1)
    assert not torch.equal(source.counts, other.counts)
    assert not torch.equal(source.sequences(range(4), 32), other.sequences(range(4), 32))


def test_sequence_depends_only_on_its_index(source):
    alone = source.sequences([7], 32)
    in_batch = source.sequences([3, 7, 11], 32)[1:2]
    assert torch.equal(alone, in_batch)


def test_no_global_rng_used(source):
    torch.manual_seed(123)
    a = source.sequences(range(3), 16)
    torch.manual_seed(456)
    b = source.sequences(range(3), 16)
    assert torch.equal(a, b)


def test_rank_shards_stack_to_the_global_batch(source):
    world, per_rank, T = 4, 2, 24
    for step in (0, 3):
        shards = [source.batch(step, per_rank, T, rank=r, world_size=world) for r in range(world)]
        x_all, y_all = source.batch(step, per_rank * world, T)
        assert torch.equal(torch.cat([x for x, _ in shards]), x_all)
        assert torch.equal(torch.cat([y for _, y in shards]), y_all)
    x, y = source.batch(0, 2, T)
    assert x.shape == y.shape == (2, T) and torch.equal(x[:, 1:], y[:, :-1])
    # consecutive steps do not reuse sequences
    assert not torch.equal(source.batch(0, 8, T)[0], source.batch(1, 8, T)[0])
    with pytest.raises(ValueError):
        source.batch(0, 2, T, rank=4, world_size=4)


def test_chain_is_a_valid_ergodic_markov_chain(source):
    assert bool((source.counts.sum(1) == 2 ** source.resolution).all())
    assert bool((source.probs > 0).all())
    pi = source.stationary.numpy()
    n, V = source.num_contexts, source.vocab_size
    # one step of the chain on contexts keeps pi unchanged
    pushed = np.zeros(n)
    for c in range(n):
        for v in range(V):
            pushed[(c * V + v) % n] += pi[c] * float(source.probs[c, v])
    assert pi.sum() == pytest.approx(1.0, abs=1e-12)
    assert np.abs(pushed - pi).max() < 1e-12


def test_empirical_entropy_approaches_the_analytic_floor(source):
    # Model-free: count (context, next token) pairs in a long sample (~500k tokens).
    tokens = source.sequences(range(2000), 256)
    emp = empirical_conditional_entropy(tokens, order=2, vocab_size=8)
    assert emp == pytest.approx(source.entropy_rate, abs=0.01)
    # With one token of context the best you can do is the first conditional entropy.
    emp1 = empirical_conditional_entropy(tokens, order=1, vocab_size=8)
    assert emp1 == pytest.approx(source.conditional_entropies(2)[0], abs=0.01)
    assert emp1 > source.entropy_rate + 0.3          # the second token of context matters
    # The true next-token probabilities score (about) the entropy rate as cross-entropy.
    ctx = tokens[:, :-2] * 8 + tokens[:, 1:-1]
    nll = -source.probs[ctx, tokens[:, 2:]].log().mean().item()
    assert nll == pytest.approx(source.entropy_rate, abs=0.01)


def test_loss_floor_accounts_for_short_context(source):
    T = 32
    c = source.conditional_entropies(T)
    assert c[1:] == [source.entropy_rate] * (T - 1)
    assert c[0] > source.entropy_rate
    assert source.loss_floor(T) == pytest.approx((c[0] + (T - 1) * source.entropy_rate) / T)
    assert source.entropy_rate < source.loss_floor(T) < math.log(8)
    first_order = MarkovSource(vocab_size=8, order=1, seed=0)
    assert first_order.loss_floor(T) == pytest.approx(first_order.entropy_rate)


def test_dataset_matches_sequences(source):
    ds = source.dataset(10, 16, offset=5)
    assert isinstance(ds, TokenDataset) and len(ds) == 10
    x, y = ds[3]
    seq = source.sequences([8], 16)[0]
    assert torch.equal(x, seq[:-1]) and torch.equal(y, seq[1:])


def test_best_nll_is_the_chain_itself_and_averages_to_the_floor(source):
    x, y = source.batch(0, 4, 16)
    nll = source.best_nll(x, y)
    assert nll.shape == y.shape and nll.dtype == torch.float64 and bool((nll > 0).all())
    # a whole context: -log of the table's probability of the next token
    b, t = 2, 9
    context = int(x[b, t - 1]) * source.vocab_size + int(x[b, t])
    assert nll[b, t].item() == pytest.approx(-math.log(source.probs[context, int(y[b, t])].item()), abs=1e-12)
    # position 0 sees one token: P(next | first) from the stationary law of token pairs
    pair = source.stationary.reshape(source.vocab_size, source.vocab_size)
    first = int(x[b, 0])
    p = (pair[first, int(y[b, 0])] / pair[first].sum()).item()
    assert nll[b, 0].item() == pytest.approx(-math.log(p), abs=1e-12)
    # over many tokens the mean per position approaches the exact conditional entropies
    T = 8
    xs, ys = source.batch(0, 4000, T)
    per_position = source.best_nll(xs, ys).mean(0)
    sd = source.best_nll(xs, ys).std(0) / math.sqrt(4000)
    exact = torch.tensor(source.conditional_entropies(T), dtype=torch.float64)
    assert bool(((per_position - exact).abs() < 5 * sd).all())


def test_best_nll_for_other_orders():
    for order in (1, 3):
        src = MarkovSource(vocab_size=4, order=order, seed=2)
        xs, ys = src.batch(0, 3000, 6)
        nll = src.best_nll(xs, ys)
        assert nll.shape == (3000, 6)
        mean, sd = nll.mean().item(), nll.std().item() / math.sqrt(nll.numel())
        assert abs(mean - src.loss_floor(6)) < 5 * sd
