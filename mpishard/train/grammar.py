"""A synthetic byte corpus whose best achievable loss is known exactly: `--text synthetic:SEED`.

A seeded first-order Markov chain over a small alphabet of printable bytes: each symbol is
followed by one of `branching` others, drawn with probabilities P[s, :] from a Dirichlet(1)
(all from numpy.random.default_rng(seed)). The text starts in the chain's stationary
distribution pi (pi P = pi), so every position is distributed by pi, and

    entropy rate   H = - sum_s pi[s] sum_j P[s, j] log P[s, j]     nats per byte

is the best achievable expected loss: every target of a window (t[i] = the byte after x[i])
is predicted from at least the byte before it, and the chain is first order, so no model
beats the true conditional P[x[i], :], whose expected cross-entropy is H at every position.
(H0 = -sum pi log pi, the entropy of a byte with no context, is reported too.) Validation
losses of a trained GPT approach H from above (tests/train/test_gpt_corpora.py).
"""
from __future__ import annotations

import hashlib
import math

import numpy as np

SYNTHETIC_PREFIX = "synthetic:"
ALPHABET = b"etaoinshrdlucmfwypvbgk .,\n"


class MarkovGrammar:
    """The chain of `seed`: symbols (bytes), transition matrix P, stationary pi."""

    def __init__(self, seed: int = 0, n_symbols: int = 16, branching: int = 4):
        if not 2 <= branching <= n_symbols <= len(ALPHABET):
            raise ValueError(f"need 2 <= branching ({branching}) <= n_symbols ({n_symbols}) "
                             f"<= {len(ALPHABET)}")
        rng = np.random.default_rng([int(seed), 12])
        self.seed = int(seed)
        self.symbols = np.frombuffer(ALPHABET[:n_symbols], dtype=np.uint8)
        self.P = np.zeros((n_symbols, n_symbols))
        for s in range(n_symbols):
            nxt = rng.choice(n_symbols, size=branching, replace=False)
            self.P[s, nxt] = rng.dirichlet(np.ones(branching))
        self.pi = stationary(self.P)

    def entropy_rate(self) -> float:
        """H = -sum_s pi_s sum_j P_sj log P_sj (nats per byte)."""
        with np.errstate(divide="ignore", invalid="ignore"):
            plogp = np.where(self.P > 0, self.P * np.log(self.P), 0.0)
        return float(-(self.pi * plogp.sum(axis=1)).sum())

    def first_entropy(self) -> float:
        """H0 = -sum_s pi_s log pi_s: the first byte of a window, seen without context."""
        p = self.pi[self.pi > 0]
        return float(-(p * np.log(p)).sum())

    def best_loss(self) -> float:
        """The lowest expected token-mean cross-entropy of next-byte prediction: H."""
        return self.entropy_rate()

    def sample(self, n: int) -> np.ndarray:
        """n bytes of the chain (uint8), the first drawn from pi."""
        rng = np.random.default_rng([self.seed, 13])
        u = rng.random(n)
        cum = np.cumsum(self.P, axis=1)
        cum[:, -1] = 1.0                                       # no round-off gap at the top
        states = np.empty(n, dtype=np.int64)
        s = int(np.searchsorted(np.cumsum(self.pi), u[0], side="right"))
        states[0] = s = min(s, len(self.pi) - 1)
        rows = [list(r) for r in cum]                          # python lists: a fast loop
        for i in range(1, n):
            row, x, j = rows[s], u[i], 0
            while row[j] <= x:
                j += 1
            states[i] = s = j
        return self.symbols[states]


def stationary(P) -> np.ndarray:
    """pi with pi P = pi, sum 1 (the left eigenvector of eigenvalue 1)."""
    w, v = np.linalg.eig(P.T)
    pi = np.abs(np.real(v[:, np.argmin(np.abs(w - 1.0))]))
    return pi / pi.sum()


def synthetic_seed(corpus) -> int | None:
    """'synthetic:SEED' -> SEED; None for any other corpus (ValueError: SEED not an int)."""
    if not isinstance(corpus, str) or not corpus.startswith(SYNTHETIC_PREFIX):
        return None
    text = corpus[len(SYNTHETIC_PREFIX):] or "0"
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"corpus {corpus!r}: expected synthetic:SEED with an integer "
                         f"SEED") from None


def synthetic_corpus(seed: int, n_bytes: int) -> tuple:
    """(tokens, info) like read_corpus's, for the grammar of `seed`; info adds best_loss =
    the entropy rate and the first-byte entropy (nats per byte)."""
    g = MarkovGrammar(seed)
    tokens = g.sample(int(n_bytes))
    info = {"source": f"{SYNTHETIC_PREFIX}{seed}", "files": 0, "bytes": int(n_bytes),
            "sha256": hashlib.sha256(tokens.tobytes()).hexdigest(),
            "entropy_rate": g.entropy_rate(), "best_loss": g.best_loss(),
            "first_entropy": g.first_entropy(),
            "entropy_rate_bits": g.entropy_rate() / math.log(2.0)}
    return tokens, info


__all__ = ["ALPHABET", "MarkovGrammar", "SYNTHETIC_PREFIX", "stationary", "synthetic_corpus",
           "synthetic_seed"]
