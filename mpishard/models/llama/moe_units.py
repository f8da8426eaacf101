"""The Mixtral block's sparse MLP (HF MixtralSparseMoeBlock): x (B, T, D) -> y (B, T, D).

Per token row x (n = B T rows), with E experts, k = top_k and expert e's stacked weights
gate_e, up_e (D, F) and down_e (F, D) (spec: spec.py):

    route    logits = x router 'nd,de->ne';  p = softmax(logits) over E (the model dtype)
             top-k experts by p (capacity drops: moe_routing.route, one group per sequence)
    gates    w_j = p_top_j / sum_i p_top_i                    (renormalised over the k)
    experts  out = (silu(x gate_e) * (x up_e)) down_e         on the rows sent to expert e
    mix      y = sum_j w_j out_j 'nk,nkd->nd'  (a dropped assignment's out_j is zero)

Backward, each step's adjoint beside it (top-k's choice and capacity are piecewise constant
and pass no gradient; the gradient flows through the softmax weights, as PyTorch's):

    mix      dw_j = dy . out_j;  d out_j = w_j dy
    gates    dp_top_j = (dw_j - sum_i dw_i w_i) / sum_i p_top_i, scattered to dp (n, E)
    softmax  dlogits = p (dp - sum_e p_e dp_e);  drouter = x^T dlogits;  dx += dlogits router^T
    experts  swiglu_expert_backward (below), expert weight gradients scaled by 1/ep

Load-balancing loss (router_aux_loss_coef = c > 0; HF's load_balancing_loss_func over every
block's rows concatenated, N of them): aux = E sum_e (C_e / N) (P_e / N), C_e the top-k
assignments to expert e, P_e the sum of p_e. C is piecewise constant, so d(c aux)/dp_e =
c E C_e / N^2 on every row: `aux` (optional, experts.AuxLoss) collects
(C, P, n) in forward and gives that row gradient, scaled to the engine's convention, in
backward, added to dp before the softmax's Jacobian.

The rows travel to their expert's ep rank and back through a moe_routing.TokenExchange
(`exchange`; None: every expert local). Each ep rank holds E/ep experts (their stacked
blocks, dim 0) and receives the rows of every ep rank, so its expert gradients are the sum
over the ep group's tokens: times 1/ep, GradientSync's average over the other data axes then
gives the global mean's gradient (as ms.MoE, parallel/expert_parallel.py). `record(index,
experts, keep, capacity)` (optional) gets the routing of each forward that records for a
backward (training: not predict nor generate; under recompute its second pass) for the
statistics. `valid` (set by moe_routing.valid_tokens; None: no padding) marks padded tokens,
which route nowhere and take no capacity (moe_routing's docstring).

In training the padding of fine-tune rows is marked by the step's document ids (-1,
nn/documents.py: padded or packed rows alike), which the block reads from its rank's
`documents` (documents.attach) as attention does: `real(mb)`, cut to the tokens this rank
routes by `local_tokens` ((B, T) -> (B, t): cp's chunks, sequence_parallel's part;
experts.LocalTokens), joins `valid`. So a padded token takes no capacity, has no place in
C_e, P_e nor N of the load-balancing loss, and gets and gives no gradient here: a padded
batch's loss and gradients are those of its real tokens alone.
"""
from __future__ import annotations

import numpy as np

from ...nn import functional as nn
from ...nn.autocast import FULL
from ...nn.documents import real_of
from ...nn.layers import Layer
from ...nn.moe_routing import TokenExchange, group_capacity, route, router_probs, token_mask


def swiglu_expert_forward(x, gate, up, down, cast=FULL):
    """out = (silu(x gate) * (x up)) down for rows x (m, D): 'md,df->mf', 'mf,fd->md'.
    cast (nn/autocast.py): the three matmuls' inputs and outputs rounded (x and h kept so),
    silu and the product in between in float32."""
    x = cast.round(x)
    a = cast.output(nn.einsum("md,df->mf", x, cast.round(gate)))
    u = cast.output(nn.einsum("md,df->mf", x, cast.round(up)))
    s, _ = nn.sigmoid_forward(a)
    h = cast.round(a * s * u)                                        # silu(a) * u
    return cast.output(nn.einsum("mf,fd->md", h, cast.round(down))), (x, a, u, s, h)


def swiglu_expert_backward(dout, cache, gate, up, down, cast=FULL):
    """dx, dgate, dup, ddown of swiglu_expert_forward (dout (m, D)); cast: the forward's."""
    x, a, u, s, h = cache
    mm = cast.output
    dout = cast.round(dout)
    dh = mm(nn.einsum("md,fd->mf", dout, cast.round(down)))          # undoes h down
    cast.enter()
    ddown = mm(nn.einsum("mf,md->fd", h, dout))
    da = cast.round(dh * u * s * (1.0 + a * (1.0 - s)))              # silu'(a) = s (1 + a (1 - s))
    du = cast.round(dh * a * s)                                      # undoes * (x up)
    dx = mm(nn.einsum("mf,df->md", da, cast.round(gate))) + \
        mm(nn.einsum("mf,df->md", du, cast.round(up)))
    cast.enter()
    dgate = mm(nn.einsum("md,mf->df", x, da))
    cast.enter()
    return dx, dgate, mm(nn.einsum("md,mf->df", x, du)), ddown


def whole_sequence(mask):
    """The tokens a rank routes when it holds whole sequences: all of them."""
    return mask


def renormalised_gates_backward(dgates, gates, top_sum):
    """d p_top from d w, w = p_top / sum(p_top) (n, k)."""
    return (dgates - (dgates * gates).sum(axis=1, keepdims=True)) / top_sum


class SparseMoE(Layer):
    """Block `index`'s router + top-k + renormalised gates + SwiGLU experts (module docstring).
    exchange: a moe_routing.TokenExchange (None: local); record: the statistics callback;
    valid: the tokens' (B, T) bool mask inside moe_routing.valid_tokens (None: no padding);
    documents, local_tokens: the step's padding (module docstring).
    `autocast` (nn/autocast.py): the experts' matmuls; the router, top-k and the gates' mix
    stay float32."""

    valid = None
    autocast = FULL
    documents = None           # the rank's nn.documents.Documents (documents.attach)
    local_tokens = staticmethod(whole_sequence)

    def __init__(self, model, access, index, exchange=None, record=None, aux=None):
        super().__init__()
        self.model, self.access, self.index = model, access, index
        self.exchange, self.record, self.aux = exchange, record, aux
        p = f"block_{index}/moe"
        self.router = f"{p}/router/weights"
        self.weights = tuple(f"{p}/experts/{w}/weights" for w in ("gate", "up", "down"))
        self.param_names = (self.router,) + self.weights

    def __repr__(self):
        return f"SparseMoE({self.index}, E={self.model.n_experts}, k={self.model.top_k})"

    def _exchange(self, xp):
        return self.exchange or TokenExchange(None, 1, self.model.n_experts, xp)

    def _experts(self, mb):
        return [self.access.get(n, mb) for n in self.weights]

    def _release(self, mb):
        for n in self.weights:
            self.access.release(n, mb)

    def _capacity(self, tokens: int) -> int:
        """Assignments each expert takes from a sequence of `tokens` real tokens."""
        model = self.model
        if model.capacity_factor is None:
            return model.top_k * tokens
        return int(-(-model.capacity_factor * tokens * model.top_k // model.n_experts))

    def _valid(self, mb, shape, to_host):
        """The host mask (n,) of the tokens of `shape` (B, t), False at padding: valid_tokens'
        and the documents' (cut to this rank's tokens) together; None without padding."""
        valid = token_mask(self.valid, shape, to_host)
        real = real_of(self.documents, mb)                               # (B, T) or None
        if real is None:
            return valid
        real = token_mask(self.local_tokens(real), shape, to_host)
        return real if valid is None else valid & real

    def forward(self, x, mb=0, record=True):
        xp, model = nn.array_module(x), self.model
        exchange = self._exchange(xp)
        rows = x.reshape(-1, x.shape[-1])                                 # (n, D)
        n_groups = x.shape[0]                                            # one per sequence
        valid = self._valid(mb, x.shape[:-1], exchange.to_host)         # padding: None
        capacity = group_capacity(self._capacity, valid, n_groups, rows.shape[0])
        probs = router_probs(rows, self.access.get(self.router, mb))     # route
        self.access.release(self.router, mb)
        experts, keep = route(exchange.to_host(probs), model.top_k, n_groups, capacity, valid)
        top = xp.take_along_axis(probs, xp.asarray(experts), axis=1)     # (n, k)
        top_sum = top.sum(axis=1, keepdims=True)
        gates = top / top_sum                                            # renormalised
        routed, kept, p_real = (experts, keep, probs) if valid is None else \
            (experts[valid], keep[valid], probs[xp.asarray(valid)])     # padding not counted
        if self.record is not None and record:          # training forwards (not predict)
            self.record(self.index, routed, kept, int(np.max(capacity)))
        if self.aux is not None:
            self.aux.add(mb, self.index, routed, p_real)
        xe, bounds, ctx = exchange.dispatch(rows, experts, keep)         # dispatch
        wg, wu, wd = self._experts(mb)
        outs, caches = [], []
        for i in range(exchange.n_local):
            out, cache = swiglu_expert_forward(xe[bounds[i]:bounds[i + 1]], wg[i], wu[i], wd[i],
                                               self.autocast)
            outs.append(out)
            caches.append(cache)
        self._release(mb)
        slots = exchange.combine(xp.concatenate(outs, axis=0), ctx)     # combine (n, k, D)
        y = xp.einsum("nk,nkd->nd", gates, slots)                        # mix
        self.save(mb, record, dict(rows=rows, probs=probs, experts=experts, gates=gates,
                                   top_sum=top_sum, slots=slots, ctx=ctx, bounds=bounds,
                                   caches=caches, valid=valid))
        return y.reshape(x.shape)

    def backward(self, dy, mb=0):
        s = self.pop(mb)
        xp = nn.array_module(dy)
        exchange, rows, bounds = self._exchange(xp), s["rows"], s["bounds"]
        dy2 = dy.reshape(rows.shape)
        dgates = xp.einsum("nkd,nd->nk", s["slots"], dy2)                 # undoes the mix
        de = exchange.combine_backward(s["gates"][:, :, None] * dy2[:, None, :], s["ctx"])
        wg, wu, wd = self._experts(mb)
        dws = [xp.zeros_like(wg), xp.zeros_like(wu), xp.zeros_like(wd)]
        dxs = []
        for i in range(exchange.n_local):
            dx_i, *dw_i = swiglu_expert_backward(de[bounds[i]:bounds[i + 1]], s["caches"][i],
                                                 wg[i], wu[i], wd[i], self.autocast)
            dxs.append(dx_i)
            for acc, g in zip(dws, dw_i):
                acc[i] = g
        self._release(mb)
        for name, g in zip(self.weights, dws):
            self.access.add_grad(name, g * (1.0 / exchange.ep))
        dx = exchange.dispatch_backward(xp.concatenate(dxs, axis=0), s["ctx"])   # adjoint
        dtop = renormalised_gates_backward(dgates, s["gates"], s["top_sum"])
        onehot = xp.asarray(s["experts"])[:, :, None] == xp.arange(self.model.n_experts)
        dprobs = (onehot * dtop[:, :, None]).sum(axis=1)                 # scatter (n, E)
        daux = None if self.aux is None else self.aux.dprobs(xp, dprobs.dtype)
        if daux is not None:                                             # c E C / N^2 (E,)
            dprobs += daux if s["valid"] is None else xp.asarray(s["valid"])[:, None] * daux
        probs = s["probs"]
        dlogits = probs * (dprobs - (probs * dprobs).sum(axis=1, keepdims=True))
        self.access.add_grad(self.router, nn.einsum("nd,ne->de", rows, dlogits))
        wr = self.access.get(self.router, mb)
        dx = dx + nn.einsum("ne,de->nd", dlogits, wr)
        self.access.release(self.router, mb)
        return dx.reshape(dy.shape)
