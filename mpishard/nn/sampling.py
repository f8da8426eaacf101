"""Choosing the next token from logits, as transformers' sampling does (host float64, no MPI).

For the logits z (R, V) of R rows' last positions:

    greedy (temperature 0)   argmax_v z[r, v] (the first of equal maxima, as torch.argmax)
    temperature T > 0        z / T
    top_k K > 0              z[r, v] = -inf where z[r, v] < the K-th largest of row r
                             (ties with the K-th are kept; K >= V keeps all)
    top_p P < 1              sort row r ascending, c = cumsum(softmax(sorted));
                             -inf where c <= 1 - P, the largest always kept: the smallest set
                             of most likely tokens whose probability reaches P
                             (transformers' TopPLogitsWarper, min_tokens_to_keep=1)
    draw                     u ~ U[0, 1) per row from `rng`; the token whose cumulative
                             probability interval holds u (inverse CDF of softmax(z))

in transformers' order (temperature, top_k, top_p). One uniform per row and step, drawn in row
order: a fixed seed gives the same ids wherever the logits are the same (every rank, every
layout: the logits agree to float64 rounding, which moves a draw only if u falls within
~1e-15 of an interval's end).
"""
from __future__ import annotations

import numpy as np

from ..validate import check_number


def check_sampling(temperature, top_k, top_p) -> None:
    """ValueError (TypeError for non-numbers) naming the option, before any communication."""
    check_number("temperature", temperature, low=0)
    check_number("top_k", top_k, low=0, integer=True)
    check_number("top_p", top_p, low=0, low_open=True)
    if top_p > 1:
        raise ValueError(f"top_p must lie in (0, 1], got {float(top_p):g}")


def filter_logits(z, top_k: int = 0, top_p: float = 1.0):
    """z (R, V) with -inf where top_k and then top_p remove a token (a new array)."""
    z = np.array(z, dtype=np.float64)
    if 0 < top_k < z.shape[-1]:
        kth = np.partition(z, -top_k, axis=-1)[:, -top_k:].min(axis=-1, keepdims=True)
        z[z < kth] = -np.inf
    if top_p < 1.0:
        order = np.argsort(z, axis=-1, kind="stable")                 # ascending
        ranked = np.take_along_axis(z, order, axis=-1)
        p = np.exp(ranked - ranked[:, -1:])
        c = np.cumsum(p / p.sum(axis=-1, keepdims=True), axis=-1)
        drop = c <= 1.0 - top_p
        drop[:, -1] = False                                           # keep at least one
        np.put_along_axis(z, order, np.where(drop, -np.inf, ranked), axis=-1)
    return z


def sample(logits, rng, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0):
    """The next token id of each row of logits (R, V): (R,) int64 (module docstring)."""
    logits = np.asarray(logits, dtype=np.float64)
    if temperature == 0.0:
        return np.argmax(logits, axis=-1)
    z = filter_logits(logits / temperature, top_k, top_p)
    p = np.exp(z - z.max(axis=-1, keepdims=True))
    c = np.cumsum(p, axis=-1)
    u = rng.random(z.shape[0]) * c[:, -1]
    ids = np.array([np.searchsorted(row, x, side="right") for row, x in zip(c, u)])
    last = z.shape[-1] - 1 - np.argmax(np.isfinite(z[:, ::-1]), axis=-1)   # last kept id
    return np.minimum(ids, last)


__all__ = ["check_sampling", "filter_logits", "sample"]
