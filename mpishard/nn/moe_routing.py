"""Mixture-of-experts routing: top-k with capacity, and the token exchange to the experts.

`router_probs` is the router's softmax and `route` picks each token's top-k experts and the
capacity keep-mask (local, no communication), for ms.MoE and the Mixtral blocks alike.

Padding (the left padding of batched generation, the right padding of a recomputed window,
the filler rows of an evaluation chunk) is not a token: inside `valid_tokens(chunks, valid)`
each routing unit of `chunks` takes `valid` (bool, False at padding) and routes the padded
tokens to no expert. They take no place in an expert's queue, and a capacity group holding p
padded of s slots gets the capacity of s - p tokens, so a prompt gives the same drops, logits
and ids alone and in a batch of longer prompts. They count neither in the routing statistics
nor in the load-balancing loss, and their output is zero (never used). In training, the
padding of fine-tune rows comes with the step's document ids instead (-1, nn/documents.py),
which the Mixtral blocks read themselves and route the same way.

`TokenExchange` moves the kept (token, choice) rows to the ep rank holding their expert and
back, for ms.MoE (parallel/expert_parallel.py) and the Mixtral blocks
(models/llama/moe_units.py) alike. With P = ep ranks and E experts, ep rank q holds experts
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

from contextlib import contextmanager

import numpy as np

from .functional import array_module, einsum
from .kv_cache import walk_units


def router_probs(rows, router):
    """p = softmax over E of the logits 'nd,de->ne' (rows (n, D), router (D, E)), row max
    subtracted so exp never overflows, in the rows' dtype."""
    xp = array_module(rows)
    logits = einsum("nd,de->ne", rows, router)
    z = xp.exp(logits - logits.max(axis=-1, keepdims=True))
    return z / z.sum(axis=-1, keepdims=True)


def route(probs_host, top_k: int, n_groups: int, capacity, valid=None):
    """Top-k experts and capacity keep-mask for b tokens cut into n_groups contiguous groups.

    probs_host: (b, E) numpy; capacity: an int, or one per group (n_groups,); valid: None or
    (b,) bool, False for padding (kept nowhere, no place in any queue). Returns experts (b, k)
    int64 (best first) and keep (b, k) bool. Queue order inside a group: choice j major,
    token position minor.
    """
    b, n_exp = probs_host.shape
    experts = np.argsort(-probs_host, axis=1, kind="stable")[:, :top_k]
    s = b // n_groups
    queue = experts.reshape(n_groups, s, top_k).transpose(0, 2, 1).reshape(n_groups, -1)
    onehot = queue[:, :, None] == np.arange(n_exp)                 # (G, k*s, E)
    if valid is not None:                                          # padding queues nowhere
        real = np.broadcast_to(valid.reshape(n_groups, 1, s), (n_groups, top_k, s))
        onehot &= real.reshape(n_groups, -1)[:, :, None]
    position = np.cumsum(onehot, axis=1) - 1                       # place in its expert's queue
    mine = np.take_along_axis(position, queue[:, :, None], axis=2)[:, :, 0]
    limit = np.asarray(capacity).reshape(-1, 1)                    # () or (G,) -> (1|G, 1)
    keep = (mine < limit).reshape(n_groups, top_k, s).transpose(0, 2, 1).reshape(b, top_k)
    if valid is not None:
        keep &= valid[:, None]
    return experts.astype(np.int64), keep


def group_capacity(capacity_of, valid, n_groups: int, b: int):
    """Each expert's capacity per group of b // n_groups token slots: capacity_of(slots) (an
    int) without padding, else capacity_of(real tokens of each group) (n_groups,)."""
    if valid is None:
        return capacity_of(b // n_groups)
    return np.array([capacity_of(int(n)) for n in valid.reshape(n_groups, -1).sum(axis=1)],
                    dtype=np.int64)


def token_mask(valid, shape, to_host):
    """The host bool mask (prod(shape),) of a routing unit's tokens of `shape` ((b,) rows of
    an ms.MoE, (B, T) of a Mixtral block), or None when there is no padding (valid None or all
    True). valid has that shape or a leading part of it ((B,): whole sequences); ValueError
    otherwise."""
    if valid is None:
        return None
    mask = np.asarray(to_host(valid)).astype(bool, copy=False)
    shape = tuple(shape)
    if mask.shape != shape[:mask.ndim]:
        raise ValueError(f"valid tokens of shape {mask.shape} for this rank's tokens of shape "
                         f"{shape}: give the tokens' shape or its leading axes, False at "
                         f"padding")
    mask = np.broadcast_to(mask.reshape(mask.shape + (1,) * (len(shape) - mask.ndim)), shape)
    return None if mask.all() else mask.reshape(-1)


@contextmanager
def valid_tokens(chunks, valid):
    """Within: every routing unit (one with a `valid` attribute: ms.MoE's and the Mixtral
    blocks') of `chunks` (lists of units) routes with `valid` (bool, False at padding: this
    rank's tokens' shape, or its rows' (B,) for whole padded rows; None: no padding);
    restored afterwards."""
    units = [u for u in walk_units([u for chunk in chunks for u in chunk])
             if hasattr(u, "valid")]
    saved = [(u, u.valid) for u in units]
    for u in units:
        u.valid = valid
    try:
        yield
    finally:
        for u, before in saved:
            u.valid = before


class TokenExchange:
    """Rows of (token, choice) assignments to their experts' ep ranks and back (see the module
    docstring). Each dispatch returns a context the other three calls take."""

    def __init__(self, comm, ep: int, n_experts: int, xp):
        self.comm, self.ep, self.n_experts, self.xp = comm, int(ep), int(n_experts), xp
        self.n_local = self.n_experts // self.ep

    def to_host(self, a) -> np.ndarray:
        """`a` on the host, where the routing decision is made (the engine's Backend.to_host;
        without a comm the arrays are numpy)."""
        return np.asarray(a) if self.comm is None else self.comm.backend.to_host(a)

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
