"""The balanced sequence split of context parallelism (no MPI): which tokens a cp rank holds.

With c = cp ranks and T tokens, the sequence is cut into 2c chunks of n = T / (2c) tokens and
cp rank r holds chunks r and 2c-1-r, concatenated (its local T/c tokens). Under the causal mask
a chunk late in the sequence attends to more keys than an early one; pairing an early chunk
with a late one gives every rank the same work.

    sequence_part        (B, T, ...) -> this rank's (B, T/c, ...)
    to_global_order      rank-ordered chunks (an all_gather or all_to_all over cp) -> global
    to_rank_order        its inverse
    TokenPositions       the global positions of a rank's tokens (the embedding's, the rotary's)
"""
from __future__ import annotations

import numpy as np

from ..nn.functional import array_module


def check_cp_length(t: int, c: int) -> None:
    """ValueError unless the sequence length divides into the 2c balanced chunks."""
    if t % (2 * c):
        raise ValueError(f"cp={c} cuts the sequence into 2*cp = {2 * c} chunks, but its length "
                         f"T={t} does not divide by {2 * c}")


def chunk_ids(r: int, c: int) -> tuple:
    """The two global chunks cp rank r holds, in local order: (r, 2c-1-r)."""
    return r, 2 * c - 1 - r


def global_order(c: int) -> list:
    """For global chunk g = 0..2c-1, its slot in rank order (slot 2s + h: rank s's h-th chunk)."""
    return [2 * g if g < c else 2 * (2 * c - 1 - g) + 1 for g in range(2 * c)]


def reorder_chunks(x, axis: int, order: list):
    """x cut into len(order) equal chunks along `axis`, chunk order[i] put i-th."""
    xp = array_module(x)
    n = x.shape[axis] // len(order)
    index = [slice(None)] * x.ndim

    def chunk(i):
        index[axis] = slice(i * n, (i + 1) * n)
        return x[tuple(index)]
    return xp.concatenate([chunk(i) for i in order], axis=axis)


def to_global_order(x, axis: int, c: int):
    """Rank-ordered chunks (all_gather or all_to_all over cp) -> the global sequence order."""
    return reorder_chunks(x, axis, global_order(c))


def to_rank_order(x, axis: int, c: int):
    """Inverse of to_global_order."""
    return reorder_chunks(x, axis, list(np.argsort(global_order(c))))


def sequence_part(arr, c: int, r: int):
    """(B, T, ...) -> (B, T/c, ...): chunks r and 2c-1-r of 2c along axis 1 (ValueError when
    T does not divide by 2c or `arr` has no sequence axis)."""
    arr = arr if hasattr(arr, "shape") else np.asarray(arr)     # a device array stays there
    if arr.ndim < 2:
        raise ValueError(f"cp={c} splits the sequence (axis 1): the batch needs (batch, T, ...) "
                         f"dims, got shape {tuple(arr.shape)}")
    check_cp_length(arr.shape[1], c)
    n = arr.shape[1] // (2 * c)
    parts = [arr[:, g * n:(g + 1) * n] for g in chunk_ids(r, c)]
    return array_module(arr).concatenate(parts, axis=1)


class TokenPositions:
    """The global positions of the tokens cp rank r holds: t local tokens -> two slices
    (chunks r and 2c-1-r of n = t/2 each; nn.transformer.position_rows takes them, with no
    index array to copy to a device). Given to the embedding and the rotary; in packed rows
    they cut the positions within each document to the same slices
    (nn.documents.local_positions)."""

    def __init__(self, c: int, r: int, seq_len: int):
        self.c, self.r, self.seq_len = c, r, seq_len

    def __call__(self, t: int):
        if t % 2 or t * self.c > self.seq_len:
            raise ValueError(f"cp={self.c}: a rank holds two equal chunks, {t} local tokens "
                             f"are {t * self.c} in all, seq_len={self.seq_len}")
        n = t // 2
        return tuple(slice(g * n, (g + 1) * n) for g in chunk_ids(self.r, self.c))


__all__ = ["TokenPositions", "check_cp_length", "chunk_ids", "global_order", "reorder_chunks",
           "sequence_part", "to_global_order", "to_rank_order"]
