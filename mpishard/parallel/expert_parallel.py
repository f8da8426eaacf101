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

Top-k selection and capacity are piecewise constant, so they pass no gradient. Routing
(`route`) and the exchanges with their adjoints (`TokenExchange`) are nn/moe_routing.py's,
shared with the Mixtral blocks (models/llama/moe_units.py and experts.py). The plan of an
ms.MoE (expert ownership) is models/moe/parallelize.py's.

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
Padding (an evaluation chunk's filler rows, inside nn/moe_routing.valid_tokens) routes to no
expert and takes no capacity: a group's capacity is that of its real rows. Per-forward
statistics, summed over the data axes, land in engine.stats: moe_routed and moe_kept
(assignments per expert, padding not counted), moe_dropped, moe_capacity (the largest
group's), moe_groups.
"""
from __future__ import annotations

import numpy as np

from ..nn import functional as nn
from ..nn.autocast import FULL
from ..nn.layers import Layer
from ..nn.moe_routing import TokenExchange, group_capacity, route, router_probs, token_mask
from ..comm.mesh import DATA_AXES


# -- the layer ---------------------------------------------------------------------------------
class MoELayer(Layer):
    """Router + top-k gating + experts, the experts spread over the ep axis.

    access: the parameter-access policy; comm: the engine's Comm (all_to_all_v over ep, the
    routing statistics summed over the data axes); stats: the dict the statistics land in;
    valid: the rows' (b,) bool mask inside nn/moe_routing.valid_tokens (None: no padding).
    `autocast` (nn/autocast.py): the experts' matmul precision (inputs, weights, gradients
    and outputs rounded; the activation, the router and the mix in float32).
    """

    autocast = FULL

    valid = None

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
        self.exchange = TokenExchange(comm, self.ep, model.n_experts, self.xp)

    def __repr__(self):
        return f"MoELayer(experts {self.experts[0]}..{self.experts[-1]} of {self.model.n_experts})"

    # -- one expert: act(x W0 + b0) W1 + b1 ----------------------------------------------------
    def _names(self, e, i):
        b = f"expert_{e}/layer_{i}/bias" if self.model.bias else None
        return f"expert_{e}/layer_{i}/weights", b

    def _expert_forward(self, e, x):
        (w0, b0), (w1, b1) = self._names(e, 0), self._names(e, 1)
        get, cast = self.access.get, self.autocast
        x, r = cast.round(x), cast.round
        h = cast.output(nn.linear_forward(x, r(get(w0)), r(get(b0)) if b0 else None))  # nd,dh
        a, saved = nn.activation_forward(self.model.activation, h)
        a = r(a)
        out = cast.output(nn.linear_forward(a, r(get(w1)), r(get(b1)) if b1 else None))
        return out, (x, saved, a)                                            # 'nh,hd->nd'

    def _expert_backward(self, e, dout, cache, scale):
        x, saved, a = cache
        (w0, b0), (w1, b1) = self._names(e, 0), self._names(e, 1)
        r, out = self.autocast.round, self.autocast.output
        da, dw1, db1 = map(out, nn.linear_backward(r(dout), a, r(self.access.get(w1))))
        dh = nn.activation_backward(self.model.activation, da, saved)        # undoes act
        w = r(self.access.get(w0)) if self.need_dx else None                # dW0 needs no W0
        dx, dw0, db0 = map(out, nn.linear_backward(r(dh), x, w, self.need_dx))   # 'nd,dh->nh'
        for name, g in ((w1, dw1), (b1, db1), (w0, dw0), (b0, db0)):        # 'nh,hd->nd' above
            if name:
                self.access.add_grad(name, g * scale)
        return dx

    # -- forward -------------------------------------------------------------------------------
    def forward(self, x, mb=0, record=True):
        model, xp = self.model, self.xp
        b, k = x.shape[0], model.top_k
        n_groups = model.groups // self.data_size if model.groups else 1
        if b % n_groups:
            raise ValueError(f"MoE: {b} local rows do not split into the {n_groups} capacity "
                             f"groups per rank (groups={model.groups}, {self.data_size} "
                             f"data-parallel ranks)")
        valid = token_mask(self.valid, (b,), self.exchange.to_host)         # padding: None
        capacity = group_capacity(model.capacity, valid, n_groups, b)
        # route: logits 'bd,de->be', softmax, top-k, capacity
        probs = router_probs(x, self.access.get("router/weights"))
        experts, keep = route(self.exchange.to_host(probs), k, n_groups, capacity, valid)
        gates = xp.take_along_axis(probs, xp.asarray(experts), axis=1)        # (b, k)
        self._record_stats(*((experts, keep) if valid is None else
                             (experts[valid], keep[valid])), int(np.max(capacity)), n_groups)

        xe, bounds, ctx = self.exchange.dispatch(x, experts, keep)           # dispatch
        outs, caches = [], []
        for i, e in enumerate(self.experts):
            out, cache = self._expert_forward(e, xe[bounds[i]:bounds[i + 1]])
            outs.append(out)
            caches.append(cache)
        slots = self.exchange.combine(xp.concatenate(outs, axis=0), ctx)      # combine
        y = (gates[:, :, None] * slots).sum(axis=1)                           # 'bk,bkd->bd'
        self.save(mb, record, dict(x=x, probs=probs, experts=experts, gates=gates, slots=slots,
                                   ctx=ctx, bounds=bounds, caches=caches))
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
        xp = self.xp
        x, probs, gates, slots, ctx = s["x"], s["probs"], s["gates"], s["slots"], s["ctx"]
        # mix: y = sum_j gate_j * slot_j
        dgates = (slots * dy[:, None, :]).sum(axis=2)                         # 'bkd,bd->bk'
        dslots = gates[:, :, None] * dy[:, None, :]                           # 'bk,bd->bkd'
        de = self.exchange.combine_backward(dslots, ctx)          # adjoint of combine
        bounds = s["bounds"]
        dxs = []
        for i, e in enumerate(self.experts):
            dxs.append(self._expert_backward(e, de[bounds[i]:bounds[i + 1]], s["caches"][i],
                                             1.0 / self.ep))
        dx = None
        if self.need_dx:                                          # adjoint of dispatch
            dx = self.exchange.dispatch_backward(xp.concatenate(dxs, axis=0), ctx)
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
    sent), so an ms.MoE raises ValueError; `engine.comm_bytes` measures them."""
    raise ValueError("the communication model covers MLPs on dp, fsdp, tp and pp; got "
                     f"{view.model!r} on {view.layout.text!r}")
