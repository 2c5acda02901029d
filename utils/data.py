"""Synthetic token data whose best possible loss is known exactly.

The source is a fixed random Markov chain of order k over a small vocabulary:
the next token depends only on the previous k tokens. A small transformer can
learn it, and no model can beat its entropy rate, which we compute exactly
from the chain's stationary distribution. That rate is the "floor" a loss
curve is plotted against.

Everything is integer arithmetic on seeded ``torch.Generator`` objects (no
global RNG, no floating point in the sampling path), so sequence ``n`` is the
same tokens on every run, every machine and every rank.
"""

from __future__ import annotations

import math

import numpy as np
import torch

__all__ = ["MarkovSource", "TokenDataset", "empirical_conditional_entropy", "nats_to_bits"]

_MASK64 = (1 << 64) - 1


def _mix(seed: int, index: int) -> int:
    """A well-spread 63-bit seed for (seed, index) (splitmix64), so neighbouring
    sequence indices get unrelated random streams."""
    z = (seed * 0x9E3779B97F4A7C15 + index + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


class MarkovSource:
    """A seeded order-``order`` Markov chain over ``vocab_size`` tokens.

    Each context (the last ``order`` tokens) has a next-token distribution
    ``counts[context] / 2**resolution`` with integer counts: weights ``2**e``
    with random exponents ``e`` in ``0..sharpness`` make a few tokens likely
    and the rest rare, so the chain is learnable yet every transition has
    probability > 0 (the chain is ergodic and its stationary law is unique).

    Attributes:
        counts: int64 tensor (vocab_size**order, vocab_size); rows sum to 2**resolution.
        probs: float64 tensor of the same shape, counts / 2**resolution (exact).
        stationary: float64 tensor (vocab_size**order,), stationary law of contexts.
        entropy_rate: the floor, in nats per token: sum_c stationary[c] * H(probs[c]).
    """

    def __init__(self, vocab_size: int = 8, order: int = 2, seed: int = 0,
                 sharpness: int = 12, resolution: int = 24, burn_in: int = 32):
        if vocab_size < 2 or order < 1:
            raise ValueError("need vocab_size >= 2 and order >= 1")
        self.vocab_size, self.order, self.seed = vocab_size, order, seed
        self.sharpness, self.resolution, self.burn_in = sharpness, resolution, burn_in
        self.num_contexts = vocab_size ** order

        gen = torch.Generator().manual_seed(seed)
        exponents = torch.randint(0, sharpness + 1, (self.num_contexts, vocab_size), generator=gen)
        weights = torch.ones_like(exponents) << exponents            # 2**e, exact integers
        total = 1 << resolution
        counts = (weights * total) // weights.sum(1, keepdim=True)    # rows now sum to <= total
        counts = counts.clamp_min(1)
        rows = torch.arange(self.num_contexts)
        counts[rows, counts.argmax(1)] += total - counts.sum(1)       # make every row sum to exactly total
        assert int(counts.min()) >= 1 and bool((counts.sum(1) == total).all())
        self.counts = counts
        self.cdf = counts.cumsum(1)                                   # integer CDF for exact sampling
        self.probs = counts.double() / total

        self.stationary = self._stationary_distribution()
        row_entropy = -(self.probs * self.probs.log()).sum(1)
        self.entropy_rate = float((self.stationary * row_entropy).sum())

    # ------------------------------------------------------------------ analysis
    def _stationary_distribution(self) -> torch.Tensor:
        """Solve pi = pi M for the chain on contexts (float64, exact up to rounding)."""
        n, V = self.num_contexts, self.vocab_size
        M = np.zeros((n, n))
        nxt = (np.arange(n)[:, None] * V + np.arange(V)[None, :]) % n   # context after emitting v
        np.add.at(M, (np.repeat(np.arange(n), V), nxt.ravel()), self.probs.numpy().ravel())
        A = M.T - np.eye(n)
        A[-1, :] = 1.0                                                 # replace one equation by sum(pi) = 1
        b = np.zeros(n)
        b[-1] = 1.0
        pi = np.clip(np.linalg.solve(A, b), 0.0, None)                # rounding may leave -1e-17
        return torch.from_numpy(pi / pi.sum())

    def conditional_entropies(self, seq_len: int) -> list[float]:
        """Exact best loss (nats) at each of the ``seq_len`` prediction positions.

        Position t predicts token t+1 from tokens 0..t. From t = order-1 on the
        model sees a whole context and the best it can do is the entropy rate;
        before that it sees fewer tokens and must pay H(X_{t+1} | X_0..X_t),
        computed from the stationary law of ``order`` consecutive tokens.
        """
        k, V = self.order, self.vocab_size
        joint = self.stationary.reshape((V,) * k)          # law of k consecutive tokens

        def block_entropy(m: int) -> float:                # H(X_0..X_{m-1}) for m <= k
            if m == 0:
                return 0.0
            p = joint.sum(dim=tuple(range(m, k))) if m < k else joint
            p = p[p > 0]
            return float(-(p * p.log()).sum())

        out = []
        for t in range(seq_len):
            if t + 2 <= k:
                out.append(block_entropy(t + 2) - block_entropy(t + 1))
            else:
                out.append(self.entropy_rate)
        return out

    def best_nll(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Per-token loss (nats, float64, shape of ``targets``) of the best possible predictor —
        the chain itself — on a batch from ``batch()``: position t predicts ``targets[:, t]`` from
        ``inputs[:, :t+1]``. Positions with a whole context pay ``-log probs[context, next]``; the
        first ``order - 1`` positions pay the conditional of the stationary law of their shorter
        prefix. Over many tokens its mean approaches ``loss_floor(seq_len)``; over one batch it
        scatters around it."""
        k, V = self.order, self.vocab_size
        inputs, targets = torch.as_tensor(inputs).long(), torch.as_tensor(targets).long()
        T = inputs.shape[1]
        tokens = torch.cat([inputs, targets[:, -1:]], dim=1)            # the T + 1 tokens of each row
        logp = torch.empty(targets.shape, dtype=torch.float64)
        joint = self.stationary.reshape((V,) * k)                       # law of k consecutive tokens
        for t in range(min(k - 1, T)):                                   # prefix of t + 1 < k tokens
            upto_next = joint.sum(dim=tuple(range(t + 2, k))) if t + 2 < k else joint
            prefix = upto_next.sum(dim=-1)
            logp[:, t] = (upto_next[tuple(tokens[:, :t + 2].t())] / prefix[tuple(tokens[:, :t + 1].t())]).log()
        if T >= k:
            context = torch.zeros(tokens.shape[0], T - k + 1, dtype=torch.long)
            for j in range(k):                                           # oldest token most significant
                context = context * V + tokens[:, j:T - k + 1 + j]
            logp[:, k - 1:] = self.probs.log()[context, tokens[:, k:]]
        return -logp

    def loss_floor(self, seq_len: int) -> float:
        """The lowest possible mean next-token cross-entropy (nats) over
        sequences of ``seq_len`` predictions. Equals the entropy rate for
        order 1 and exceeds it slightly for longer contexts (the first
        positions lack a full context)."""
        return sum(self.conditional_entropies(seq_len)) / seq_len

    # ------------------------------------------------------------------ sampling
    def sequences(self, indices, seq_len: int) -> torch.Tensor:
        """Token sequences number ``indices`` (each of length ``seq_len + 1``).

        Sequence n depends only on (seed, n): it gets its own generator, starts
        from a uniformly drawn context and runs ``burn_in`` discarded steps so it
        starts (very nearly) from the stationary law.
        """
        indices = [int(i) for i in indices]
        n, steps = len(indices), self.burn_in + seq_len + 1
        if n == 0:
            return torch.empty(0, seq_len + 1, dtype=torch.long)
        draws = torch.empty(n, steps, dtype=torch.long)
        context = torch.empty(n, dtype=torch.long)
        for row, index in enumerate(indices):
            gen = torch.Generator().manual_seed(_mix(self.seed, index))
            context[row] = torch.randint(0, self.num_contexts, (1,), generator=gen)
            draws[row] = torch.randint(0, 1 << self.resolution, (steps,), generator=gen)
        draws = draws.t().contiguous()                      # (steps, n): one row per time step
        tokens = torch.empty(n, steps, dtype=torch.long)
        for t in range(steps):                              # vectorised over the sequences
            nxt = torch.searchsorted(self.cdf[context], draws[t].unsqueeze(1), right=True).squeeze(1)
            tokens[:, t] = nxt
            context = (context * self.vocab_size + nxt) % self.num_contexts
        return tokens[:, self.burn_in:]

    def batch(self, step: int, batch_size: int, seq_len: int, rank: int = 0,
              world_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank ``rank``'s share of global batch ``step``, as (inputs, targets).

        Global batch ``step`` holds sequences ``step*B*W .. (step+1)*B*W - 1`` with
        B = batch_size (per rank) and W = world_size; rank r takes rows
        ``r*B .. (r+1)*B - 1``. So the ranks' shards, stacked in rank order, are
        exactly ``batch(step, B*W, seq_len)`` of a single process.
        """
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world of size {world_size}")
        start = (step * world_size + rank) * batch_size
        tokens = self.sequences(range(start, start + batch_size), seq_len)
        return tokens[:, :-1], tokens[:, 1:]

    def dataset(self, num_sequences: int, seq_len: int, offset: int = 0) -> "TokenDataset":
        """A map-style ``torch.utils.data.Dataset`` of sequences offset..offset+num_sequences-1."""
        return TokenDataset(self, num_sequences, seq_len, offset)

    def __repr__(self) -> str:
        return (f"MarkovSource(vocab_size={self.vocab_size}, order={self.order}, seed={self.seed}, "
                f"entropy_rate={self.entropy_rate:.4f} nats)")


class TokenDataset(torch.utils.data.Dataset):
    """A fixed set of sequences from a source, materialised once (fast indexing).

    Item i is ``(inputs, targets)`` of sequence ``offset + i``; both have length ``seq_len``.
    """

    def __init__(self, source: MarkovSource, num_sequences: int, seq_len: int, offset: int = 0):
        self.tokens = source.sequences(range(offset, offset + num_sequences), seq_len)

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        seq = self.tokens[i]
        return seq[:-1], seq[1:]


def empirical_conditional_entropy(tokens: torch.Tensor, order: int, vocab_size: int) -> float:
    """Plug-in estimate (nats) of H(next token | previous ``order`` tokens) from
    samples: count every (context, next) pair in each row of ``tokens`` and
    average the entropy of each context's empirical next-token distribution.
    Model-free: it approaches the entropy rate as the sample grows."""
    tokens = torch.as_tensor(tokens).long()
    if tokens.dim() == 1:
        tokens = tokens.unsqueeze(0)
    T = tokens.shape[1]
    context = torch.zeros(tokens.shape[0], T - order, dtype=torch.long)
    for j in range(order):                                 # context of the token at position order+t
        context = context * vocab_size + tokens[:, j:T - order + j]
    pair = context * vocab_size + tokens[:, order:]
    counts = torch.bincount(pair.reshape(-1), minlength=vocab_size ** (order + 1)).double()
    counts = counts.reshape(-1, vocab_size)
    per_context = counts.sum(1, keepdim=True)
    p = counts / per_context.clamp_min(1)
    plogp = torch.where(counts > 0, p * p.clamp_min(1e-300).log(), torch.zeros_like(p))
    return float(-(plogp.sum(1) * per_context.squeeze(1)).sum() / counts.sum())


def nats_to_bits(nats: float) -> float:
    """Convert an entropy from nats (natural log, torch's cross-entropy unit) to bits."""
    return nats / math.log(2)
