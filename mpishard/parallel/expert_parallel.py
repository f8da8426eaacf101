"""Expert parallelism: a mixture-of-experts layer whose experts live on different ranks.

With P = ep ranks and E experts, ep rank q holds experts q*E/P ... (q+1)*E/P - 1 (E_l = E/P of
them); the router is replicated. Tokens are split over the data axes (dp x ep), so every rank
routes its own b tokens, then (for each microbatch):

    route      logits 'bd,de->be', p = softmax, top-k experts per token, capacity drops
    dispatch   counts all_to_all, then rows all_to_all_v   (token rows -> the experts' ranks)
    experts    each local expert: act(x W0 + b0) W1 + b1 on the rows it received
    combine    rows all_to_all_v back (counts swapped)    (expert outputs -> token owners)
    mix        y_t = sum_j gate_tj * out_tj                (gate = p of the chosen expert)

The backward runs the same exchanges in reverse, each the adjoint of a forward one:

    d out_tj = gate_tj dy_t        -> all_to_all_v to the experts  (adjoint of combine)
    experts' backward: dW (scaled 1/P, see below), d rows
    d rows -> all_to_all_v back to the token owners                (adjoint of dispatch)
    d gate_tj = dy_t . out_tj      -> softmax Jacobian -> d router weights, d x

Top-k selection and capacity are piecewise constant, so they pass no gradient.

Gradient scaling. Each rank's loss is the mean over its own rows, and GradientSync averages a
gradient over the data axes on which it is replicated. The router is replicated on dp and ep:
averaged over both, as in plain data parallelism. Expert e is held by one ep rank (placement
`owner={'ep': q}`, so ep is a sharded axis for it) which sums the gradients of the tokens of
all P ep ranks; multiplying that sum by 1/P and letting GradientSync average over dp gives
(1/(dp*P)) * sum over all data ranks, the single-device gradient of the global mean.

Capacity groups (see ms.MoE): each rank splits its rows into groups/(dp*ep) contiguous groups
and drops, per group and expert, the assignments over capacity *before* dispatching, so
dropped tokens cost no traffic and `single` with the same `groups` drops exactly the same
ones. With ep=1 (single, dp) the same layer runs with every expert local and no exchange.
Per-forward statistics, summed over the data axes, land in engine.stats: moe_routed and
moe_kept (assignments per expert), moe_dropped, moe_capacity, moe_groups.
"""
from __future__ import annotations

import numpy as np

from ..nn import functional as nn
from . import placement as pl
from ..nn.layers import Layer
from ..comm.mesh import DATA_AXES


# -- planning (no MPI) -------------------------------------------------------------------------
def plan_moe_params(model, layout) -> dict:
    """name -> ParamInfo for an ms.MoE model: router replicated, expert e owned by ep rank
    e // (E/ep). Raises the same ValueError on every rank when the layout does not fit."""
    ep = layout.size("ep")
    if getattr(model, "kind", "mlp") != "moe":
        raise ValueError(f"layout ep={ep} needs an ms.MoE model, got {model!r}; expert "
                         f"parallelism splits the experts of a mixture-of-experts layer")
    for axis in ("tp", "pp", "fsdp"):
        if layout.size(axis) > 1:
            raise ValueError(f"layout {layout.text!r}: {axis}={layout.size(axis)} is not "
                             f"supported with an ms.MoE model; use single, dp, ep or dp x ep")
    if model.n_experts % ep:
        raise ValueError(f"layout ep={ep} does not divide n_experts={model.n_experts}: each ep "
                         f"rank must hold the same number of experts")
    n_data = layout.data_parallel_size
    if model.groups is not None and model.groups % n_data:
        raise ValueError(f"MoE groups={model.groups} is not a multiple of the {n_data} "
                         f"data-parallel ranks of layout {layout.text!r}")
    per_rank = model.n_experts // ep
    plan = {}
    for name, shape in model.param_shapes().items():
        owner = {}
        if name.startswith("expert_") and ep > 1:
            owner = {"ep": int(name.split("/")[0][len("expert_"):]) // per_rank}
        plan[name] = pl.ParamInfo(name, tuple(shape), pl.Placement((), stage=0, owner=owner))
    return plan


def build_moe_chunks(model, access, comm, stats: dict) -> list:
    """The engine's layers: one chunk holding the MoE layer (the model input needs no dx)."""
    return [[MoELayer(model, access, comm, stats, need_dx=False)]]


# -- routing (local, no communication) ---------------------------------------------------------
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


# -- the layer ---------------------------------------------------------------------------------
class MoELayer(Layer):
    """Router + top-k gating + experts, the experts spread over the ep axis.

    access: the parameter-access policy; comm: the engine's Comm (all_to_all_v over ep, the
    routing statistics summed over the data axes); stats: the dict the statistics land in.
    """

    def __init__(self, model, access, comm, stats: dict, need_dx=True):
        super().__init__()
        self.model, self.access, self.need_dx = model, access, need_dx
        self.comm, self.xp, self.stats = comm, comm.xp, stats
        mesh = comm.mesh
        self.ep = mesh.size("ep")
        self.n_local = model.n_experts // self.ep
        first = mesh.coord("ep") * self.n_local
        self.experts = list(range(first, first + self.n_local))      # global ids held here
        self.param_names = ("router/weights",) + tuple(
            n for e in self.experts for n in model.expert_param_shapes(e))
        self.data_axes = tuple(a for a in DATA_AXES if mesh.size(a) > 1)
        self.data_size = mesh.size(DATA_AXES)

    def __repr__(self):
        return f"MoELayer(experts {self.experts[0]}..{self.experts[-1]} of {self.model.n_experts})"

    # -- one expert: act(x W0 + b0) W1 + b1 ----------------------------------------------------
    def _names(self, e, i):
        b = f"expert_{e}/layer_{i}/bias" if self.model.bias else None
        return f"expert_{e}/layer_{i}/weights", b

    def _expert_forward(self, e, x):
        (w0, b0), (w1, b1) = self._names(e, 0), self._names(e, 1)
        get = self.access.get
        h = nn.linear_forward(x, get(w0), get(b0) if b0 else None)          # 'nd,dh->nh'
        a, saved = nn.activation_forward(self.model.activation, h)
        out = nn.linear_forward(a, get(w1), get(b1) if b1 else None)         # 'nh,hd->nd'
        return out, (x, saved, a)

    def _expert_backward(self, e, dout, cache, scale):
        x, saved, a = cache
        (w0, b0), (w1, b1) = self._names(e, 0), self._names(e, 1)
        da, dw1, db1 = nn.linear_backward(dout, a, self.access.get(w1))      # undoes 'nh,hd->nd'
        dh = nn.activation_backward(self.model.activation, da, saved)        # undoes act
        w = self.access.get(w0) if self.need_dx else None                   # dW0 needs no W0
        dx, dw0, db0 = nn.linear_backward(dh, x, w, self.need_dx)
        for name, g in ((w1, dw1), (b1, db1), (w0, dw0), (b0, db0)):        # 'nd,dh->nh'
            if name:
                self.access.add_grad(name, g * scale)
        return dx

    # -- exchanges -----------------------------------------------------------------------------
    def _exchange(self, rows, send_counts, recv_counts):
        """all_to_all_v over ep (identity when ep=1); both count vectors are known here, so
        no count exchange. Adjoint: the same call on the gradient with the counts swapped."""
        if self.ep == 1:
            return rows, send_counts
        return self.comm.all_to_all_v(rows, send_counts, group="ep", recv_counts=recv_counts)

    # -- forward -------------------------------------------------------------------------------
    def forward(self, x, mb=0, record=True):
        model, xp = self.model, self.xp
        b, n_exp, k = x.shape[0], model.n_experts, model.top_k
        n_groups = model.groups // self.data_size if model.groups else 1
        if b % n_groups:
            raise ValueError(f"MoE: {b} local rows do not split into the {n_groups} capacity "
                             f"groups per rank (groups={model.groups}, {self.data_size} "
                             f"data-parallel ranks)")
        capacity = model.capacity(b // n_groups)
        # route: logits 'bd,de->be', softmax, top-k, capacity
        wr = self.access.get("router/weights")
        logits = nn.einsum("bd,de->be", x, wr)
        z = xp.exp(logits - logits.max(axis=1, keepdims=True))
        probs = z / z.sum(axis=1, keepdims=True)
        experts, keep = route(self.comm.backend.to_host(probs), k, n_groups, capacity)
        gates = xp.take_along_axis(probs, xp.asarray(experts), axis=1)        # (b, k)
        self._record_stats(experts, keep, capacity, n_groups)

        # dispatch: kept assignments (flat id t*k + j) sorted by expert, so each ep rank's
        # rows are consecutive and, inside them, each local expert's rows
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
        recv, _ = self._exchange(send, send_counts, recv_counts)              # dispatch

        # experts: group received rows (source-major) by local expert
        starts = np.concatenate([[0], np.cumsum(from_src.ravel())[:-1]]).reshape(from_src.shape)
        perm = np.concatenate([np.arange(starts[p, i], starts[p, i] + from_src[p, i])
                               for i in range(self.n_local) for p in range(self.ep)] +
                              [np.zeros(0, dtype=np.int64)]).astype(np.int64)
        bounds = np.concatenate([[0], np.cumsum(from_src.sum(axis=0))])
        xe = recv[xp.asarray(perm)]
        outs, caches = [], []
        for i, e in enumerate(self.experts):
            out, cache = self._expert_forward(e, xe[bounds[i]:bounds[i + 1]])
            outs.append(out)
            caches.append(cache)
        out_recv = xp.empty_like(recv)
        out_recv[xp.asarray(perm)] = xp.concatenate(outs, axis=0)

        back, _ = self._exchange(out_recv, recv_counts, send_counts)          # combine
        slots = xp.zeros((b * k, x.shape[1]), dtype=x.dtype)                  # dropped: zero
        slots[xp.asarray(order)] = back
        slots = slots.reshape(b, k, x.shape[1])
        y = (gates[:, :, None] * slots).sum(axis=1)                           # 'bk,bkd->bd'
        self.save(mb, record, dict(x=x, probs=probs, experts=experts, gates=gates, slots=slots,
                                   order=order, send_counts=send_counts,
                                   recv_counts=recv_counts, perm=perm, bounds=bounds,
                                   caches=caches))
        return y

    def _record_stats(self, experts, keep, capacity, n_groups):
        """Assignments routed / kept per expert, summed over the data axes."""
        n_exp = self.model.n_experts
        counts = np.concatenate([np.bincount(experts.ravel(), minlength=n_exp),
                                 np.bincount(experts[keep], minlength=n_exp)]).astype(np.int64)
        if self.data_axes:
            counts = self.comm.backend.to_host(
                self.comm.all_reduce(counts, op="sum", group=self.data_axes))
        routed, kept = counts[:n_exp], counts[n_exp:]
        self.stats.update(moe_routed=routed.tolist(), moe_kept=kept.tolist(),
                                 moe_dropped=int(routed.sum() - kept.sum()),
                                 moe_capacity=capacity, moe_groups=n_groups * self.data_size)

    # -- backward ------------------------------------------------------------------------------
    def backward(self, dy, mb=0):
        s = self.pop(mb)
        xp, k = self.xp, self.model.top_k
        x, probs, gates, slots, order = s["x"], s["probs"], s["gates"], s["slots"], s["order"]
        b, d = x.shape
        # mix: y = sum_j gate_j * slot_j
        dgates = (slots * dy[:, None, :]).sum(axis=2)                         # 'bkd,bd->bk'
        dslots = (gates[:, :, None] * dy[:, None, :]).reshape(b * k, d)       # 'bk,bd->bkd'
        # adjoint of combine: gradient rows back to the experts (counts swapped)
        d_recv, _ = self._exchange(dslots[xp.asarray(order)], s["send_counts"],
                                   s["recv_counts"])
        perm, bounds = xp.asarray(s["perm"]), s["bounds"]
        de = d_recv[perm]
        dxs = []
        for i, e in enumerate(self.experts):
            dxs.append(self._expert_backward(e, de[bounds[i]:bounds[i + 1]], s["caches"][i],
                                             1.0 / self.ep))
        dx = None
        if self.need_dx:
            dx_recv = xp.empty_like(d_recv)
            dx_recv[perm] = xp.concatenate(dxs, axis=0)
            # adjoint of dispatch: input-gradient rows back to the token owners
            dx_back, _ = self._exchange(dx_recv, s["recv_counts"], s["send_counts"])
            dx_slots = xp.zeros((b * k, d), dtype=x.dtype)
            dx_slots[xp.asarray(order)] = dx_back
            dx = dx_slots.reshape(b, k, d).sum(axis=1)                        # undoes x[t] copies
        # gate_j = p[expert_j]: scatter into dp, then the softmax Jacobian
        onehot = xp.asarray(s["experts"])[:, :, None] == xp.arange(self.model.n_experts)
        dprobs = (onehot * dgates[:, :, None]).sum(axis=1)                    # (b, E)
        dlogits = probs * (dprobs - (probs * dprobs).sum(axis=1, keepdims=True))
        self.access.add_grad("router/weights", nn.einsum("bd,be->de", x, dlogits))
        if self.need_dx:
            dx = dx + nn.einsum("be,de->bd", dlogits, self.access.get("router/weights"))
        return dx


# -- cost model (no MPI): bytes this rank sends per train_step, and memory ---------------------
def memory(view, n_state) -> dict:
    """Nothing beyond the base: the placement's owner keeps each expert on one ep rank."""
    return {}


def step_comm(view) -> dict:
    """No closed form: the all_to_all bytes follow the routing (how many rows each expert is
    sent), so a MoE model raises ValueError; `engine.comm_bytes` measures them."""
    if getattr(view.model, "kind", "mlp") == "moe" or view.size("ep") > 1:
        raise ValueError("the communication model covers MLPs on dp, fsdp, tp and pp; got "
                         f"{view.model!r} on {view.layout.text!r}")
    return {}
