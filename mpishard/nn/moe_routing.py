"""Mixture-of-experts routing: top-k with capacity, and the token exchange to the experts.

`route` picks each token's top-k experts and the capacity keep-mask (local, no
communication). `TokenExchange` moves the kept (token, choice) rows to the ep rank holding
their expert and back, for ms.MoE (parallel/expert_parallel.py) and the Mixtral blocks
(moe_layers.py) alike. With P = ep ranks and E experts, ep rank q holds experts
q E/P ... (q+1) E/P - 1 (E_l = E/P); `comm` is the engine's Comm (None or P = 1: every
expert is local and nothing travels).

    dispatch   counts all_to_all, then rows all_to_all_v   (token rows -> the experts' ranks),
               the received rows grouped by local expert
    combine    expert outputs all_to_all_v back (counts swapped), placed in their (token,
               choice) slots (a dropped assignment's slot is zero)

Adjoints (the backward runs the same exchanges in reverse):

    combine_backward    d slots -> all_to_all_v to the experts       (adjoint of combine)
    dispatch_backward   d rows -> all_to_all_v back, summed over the k copies of each token
                                                                      (adjoint of dispatch)
"""
from __future__ import annotations

import numpy as np


def route(probs_host, top_k: int, n_groups: int, capacity: int):
    """Top-k experts and capacity keep-mask for b tokens cut into n_groups contiguous groups.

    probs_host: (b, E) numpy. Returns experts (b, k) int64 (best first) and keep (b, k) bool.
    Queue order inside a group: choice j major, token position minor.
    """
    b, n_exp = probs_host.shape
    experts = np.argsort(-probs_host, axis=1, kind="stable")[:, :top_k]
    s = b // n_groups
    queue = experts.reshape(n_groups, s, top_k).transpose(0, 2, 1).reshape(n_groups, -1)
    onehot = queue[:, :, None] == np.arange(n_exp)                 # (G, k*s, E)
    position = np.cumsum(onehot, axis=1) - 1                       # place in its expert's queue
    mine = np.take_along_axis(position, queue[:, :, None], axis=2)[:, :, 0]
    keep = (mine < capacity).reshape(n_groups, top_k, s).transpose(0, 2, 1).reshape(b, top_k)
    return experts.astype(np.int64), keep


class TokenExchange:
    """Rows of (token, choice) assignments to their experts' ep ranks and back (see the module
    docstring). Each dispatch returns a context the other three calls take."""

    def __init__(self, comm, ep: int, n_experts: int, xp):
        self.comm, self.ep, self.n_experts, self.xp = comm, int(ep), int(n_experts), xp
        self.n_local = self.n_experts // self.ep

    def _exchange(self, rows, send_counts, recv_counts):
        """all_to_all_v over ep (identity when ep=1); both count vectors are known here, so
        no count exchange. Adjoint: the same call on the gradient with the counts swapped."""
        if self.ep == 1:
            return rows
        return self.comm.all_to_all_v(rows, send_counts, group="ep",
                                      recv_counts=recv_counts)[0]

    def dispatch(self, x, experts, keep):
        """x (b, d); experts, keep (b, k) numpy. Returns (rows grouped by local expert, bounds:
        local expert i's rows are rows[bounds[i]:bounds[i+1]], the context)."""
        xp, n_exp, k = self.xp, self.n_experts, experts.shape[1]
        # kept assignments (flat id t*k + j) sorted by expert, so each ep rank's rows are
        # consecutive and, inside them, each local expert's rows
        kept = np.flatnonzero(keep.ravel())
        order = kept[np.argsort(experts.ravel()[kept], kind="stable")]
        per_expert = np.bincount(experts.ravel()[kept], minlength=n_exp).astype(np.int64)
        send_counts = per_expert.reshape(self.ep, self.n_local).sum(axis=1)
        send = x[xp.asarray(order // k)]                                      # (n_send, d)
        if self.ep > 1:
            # counts per (source rank, local expert): all_to_all / adjoint: not needed (ints)
            from_src = self.comm.backend.to_host(self.comm.all_to_all(per_expert, group="ep"))
            from_src = from_src.reshape(self.ep, self.n_local)
        else:
            from_src = per_expert.reshape(1, n_exp)
        recv_counts = from_src.sum(axis=1)               # rows from each source rank
        recv = self._exchange(send, send_counts, recv_counts)                 # dispatch
        # group received rows (source-major) by local expert
        starts = np.concatenate([[0], np.cumsum(from_src.ravel())[:-1]]).reshape(from_src.shape)
        perm = np.concatenate([np.arange(starts[p, i], starts[p, i] + from_src[p, i])
                               for i in range(self.n_local) for p in range(self.ep)] +
                              [np.zeros(0, dtype=np.int64)]).astype(np.int64)
        bounds = np.concatenate([[0], np.cumsum(from_src.sum(axis=0))])
        ctx = dict(order=order, send_counts=send_counts, recv_counts=recv_counts,
                   perm=xp.asarray(perm), shape=(x.shape[0], k, x.shape[1]))
        return recv[ctx["perm"]], bounds, ctx

    def combine(self, out, ctx):
        """out: the local experts' output rows (dispatch's grouping) -> slots (b, k, d)."""
        xp = self.xp
        out_recv = xp.empty_like(out)
        out_recv[ctx["perm"]] = out
        back = self._exchange(out_recv, ctx["recv_counts"], ctx["send_counts"])   # combine
        b, k, d = ctx["shape"]
        slots = xp.zeros((b * k, d), dtype=out.dtype)                        # dropped: zero
        slots[xp.asarray(ctx["order"])] = back
        return slots.reshape(b, k, d)

    def combine_backward(self, dslots, ctx):
        """d slots (b, k, d) -> d of the local experts' output rows (adjoint of combine)."""
        b, k, d = ctx["shape"]
        rows = dslots.reshape(b * k, d)[self.xp.asarray(ctx["order"])]
        return self._exchange(rows, ctx["send_counts"], ctx["recv_counts"])[ctx["perm"]]

    def dispatch_backward(self, dx_rows, ctx):
        """d of the local experts' input rows -> dx (b, d): the adjoint of dispatch, each
        token's k copies summed."""
        xp = self.xp
        dx_recv = xp.empty_like(dx_rows)
        dx_recv[ctx["perm"]] = dx_rows
        dx_back = self._exchange(dx_recv, ctx["recv_counts"], ctx["send_counts"])
        b, k, d = ctx["shape"]
        dx_slots = xp.zeros((b * k, d), dtype=dx_rows.dtype)
        dx_slots[xp.asarray(ctx["order"])] = dx_back
        return dx_slots.reshape(b, k, d).sum(axis=1)                          # undoes x[t] copies
