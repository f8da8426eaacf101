"""Llama layers: the units an engine stacks into pipeline stages (spec: spec.py).

    TokenEmbedding   tokens (B, T) ints -> h (B, T, D)        embed/tokens (no positions)
    LlamaBlock i     h -> h                                   block_{i}/...
      Residual[RMSNorm ln_1, FusedLinear(q, k, v), Rotary, GroupedQueryAttention, attn proj]
      Residual[RMSNorm ln_2, FusedLinear(gate, up), SwiGLU, mlp down]
        (n_experts set: Residual[RMSNorm ln_2, SparseMoE]: moe_units.py)
    LlamaHead        h -> logits (B, T, V)                    ln_f, head/weights or tied

Between FusedLinear(q, k, v) and the attention core the activation is (B, T, (Hq + 2 Hkv) Dh):
the q | k | v columns, each cut into heads of Dh columns (Hq, Hkv: the heads this rank
computes, all of them without tp). Rotary turns q and k by position; the core serves query
head i from kv head kv_heads[i] (HF's repeat_kv: i // (Hq / Hkv)). Under context
parallelism the core is cp's ring (its grouped form, parallelize.py) or RepeatKV (q | k, v
repeated to every query head) and Ulysses. These attention units are in attention.py.

Like nn.transformer's units, every unit reaches its parameters through the access policy and
keeps what its backward needs on its tape per microbatch. Tensor parallelism passes the same
`linear(access, w_name, b_name, role)` factory as the GPT's Block (nn/transformer.plain_linear
or parallel/decoder_tensor_parallel.tp_linear) for its communication units; `FusedLinear`
computes the column projections that read the same input as one matmul.
"""
from __future__ import annotations

from ...nn import cuda_ops
from ...nn import functional as nn
from ...nn.activation_layer import keep_low_around
from ...nn.gemm import is_low
from ...nn.layers import Composite, Head, Layer, Linear, Residual
from ...nn.transformer import leading_positions, model_head, plain_linear
from .attention import GroupedQueryAttention, KVHeads, Rotary
from .moe_units import SparseMoE


class RMSNorm(Layer):
    """y = x rsqrt(mean(x^2) + eps) scale over the last dim (HF LlamaRMSNorm): x -> y.

    backward  dscale = sum over rows of dy * n,  n = x r,  r = rsqrt(mean(x^2) + eps)
              dx = r (g - n mean(g n)),  g = dy * scale
    """

    def __init__(self, access, prefix, eps):
        super().__init__()
        self.access, self.eps = access, float(eps)
        self.scale = f"{prefix}/scale"
        self.param_names = (self.scale,)

    def __repr__(self):
        return f"RMSNorm({self.scale.rsplit('/', 1)[0]})"

    def forward(self, x, mb=0, record=True):
        xp = nn.array_module(x)
        scale = self.access.get(self.scale, mb)
        if cuda_ops.norm_takes(xp, x, scale):                     # cupy: one kernel each way,
            x = cuda_ops.saved_input(xp, x)                       # n recomputed from x, r
            y, r = cuda_ops.rmsnorm_forward(xp, x, scale, self.eps)
            self.access.release(self.scale, mb)
            self.save(mb, record, (x, r, True))
            return y
        r = 1.0 / xp.sqrt(xp.einsum("...d,...d->...", x, x)[..., None] / x.shape[-1] + self.eps)
        n = x * r                                                 # x rsqrt(mean x^2 + eps)
        y = n * scale
        self.access.release(self.scale, mb)
        self.save(mb, record, (n, r, False))
        return y

    def backward(self, dy, mb=0):
        n, r, kernel = self.pop(mb)
        d = dy.shape[-1]
        scale = self.access.get(self.scale, mb)
        if kernel:                                                # n is x here (forward's)
            dx, dscale = cuda_ops.rmsnorm_backward(nn.array_module(dy), dy, n, scale, r)
            self.access.release(self.scale, mb)
            self.access.add_grad(self.scale, dscale)
            return dx
        g = dy * scale                                            # undoes * scale (in n)
        dx = g - n * (nn.array_module(g).einsum("...d,...d->...", g, n)[..., None] / d)
        dx *= r                                                   # undoes the normalisation
        self.access.release(self.scale, mb)
        self.access.add_grad(self.scale, nn.column_sums((dy * n).reshape(-1, d)))
        return dx


class TokenEmbedding(Layer):
    """tokens (B, T) ints -> h = embed/tokens[tokens] (B, T, D); no gradient for the ids."""

    def __init__(self, access, tokens="embed/tokens"):
        super().__init__()
        self.access, self.tokens = access, tokens
        self.param_names = (tokens,)

    def __repr__(self):
        return "TokenEmbedding"

    def forward(self, ids, mb=0, record=True):
        table = self.access.get(self.tokens, mb)
        h = nn.embedding_forward(table, ids)                     # rows of the ids
        self.access.release(self.tokens, mb)
        self.save(mb, record, (ids, table.shape[0]))
        return h

    def backward(self, dy, mb=0):
        ids, rows = self.pop(mb)
        self.access.add_grad(self.tokens, nn.embedding_backward(dy, ids, rows))   # scatter-add
        return None


class FusedLinear(Linear):
    """Several projections of the same input side by side, as one matmul on their weights
    joined along the columns (W = cat(W_1, W_2, ...), each fetched through the access policy):

    forward   y = x W = cat(x W_1, x W_2, ...)   'bd,df->bf'
    backward  dx = dy W^T  'bf,df->bd';  dW = x^T dy 'bd,bf->df', cut back into dW_i
              split (zero bubble): backward_input gives dx and keeps (x, dy) in `deferred`,
              backward_weights adds the dW_i later (last first, as a Composite would)

    Under tp each W_i is this rank's column block (whole heads), so y is [q_r | k_r | v_r].
    The tape, `deferred` and backward are Linear's, its `autocast` too (x, W and dy rounded
    before use, y, dx and each dW_i after). A subclass with more parameters (biases) extends
    param_names and overrides forward and add_grads; the weights stay `weights`."""

    def __init__(self, access, w_names):
        super().__init__(access, w_names[0])
        self.weights = self.param_names = tuple(w_names)

    def __repr__(self):
        return f"{type(self).__name__}({', '.join(n.rsplit('/', 2)[-2] for n in self.weights)})"

    def _fetched(self, names, mb, axis):
        """The parameters `names` through the access policy, joined along `axis`, and their
        sizes along it."""
        arrays = [self.access.get(n, mb) for n in names]
        joined = nn.array_module(arrays[0]).concatenate(arrays, axis=axis)
        for n in names:
            self.access.release(n, mb)
        return joined, [a.shape[axis] for a in arrays]

    def _joined(self, mb):
        """W = cat(W_1, W_2, ...) along the columns, and the widths of the W_i."""
        return self._fetched(self.weights, mb, axis=1)

    def forward(self, x, mb=0, record=True):
        cast = self.autocast
        w, widths = self._joined(mb)
        x = cast.round(x)
        self.save(mb, record, (x, widths))
        if self.low_out:                                         # SwiGLU's kernels: 16 bits
            return cast.linear_kept(x, cast.round(w))
        return cast.output(nn.linear_forward(x, cast.round(w)))  # 'bd,df->bf'

    def backward_input(self, dy, mb=0):
        x, widths = self.pop(mb)
        w, _ = self._joined(mb)
        cast = self.autocast
        dy = cast.round(dy)
        self.deferred[mb] = (x, dy, widths)
        out = cast.grad_kept if self.low_dx else cast.output
        return out(nn.linear_backward_input(dy, cast.round(w), x.shape))   # 'bf,df->bd'

    def backward_weights(self, mb=0) -> None:
        x, dy, widths = self.deferred.pop(mb)
        x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
        ends = [sum(widths[:i + 1]) for i in range(len(widths))]
        for i in reversed(range(len(widths))):
            self.add_grads(i, x2, dy2[:, ends[i] - widths[i]:ends[i]])

    def add_grads(self, i: int, x2, dy_i) -> None:
        """Projection i's gradients from x (rows flattened) and its columns dy_i of dy:
        dW_i = x^T dy_i 'bd,bf->df'."""
        self.autocast.enter()
        self.access.add_grad(self.weights[i],
                             self.autocast.output(nn.einsum("bd,bf->df", x2, dy_i)))


def fused_column(linear, access, fused) -> list:
    """The units of `fused` (a FusedLinear: projections read from one input) as `linear`
    (Block's factory) builds a column layer: its communication units in front (once), then
    `fused`."""
    return linear(access, fused.weights[0], None, "column")[:-1] + [fused]


class SwiGLU(Layer):
    """(B, T, 2 F) gate | up -> silu(gate) * up (B, T, F); silu(g) = g sigmoid(g).

    backward  dgate = dy up s (1 + g (1 - s)),  s = sigmoid(g);  dup = dy silu(g)
              (written into the two halves of one (B, T, 2 F) gradient)

    On cupy with the fused kernels on (cuda_ops.swiglu_takes) one kernel each way: the tape
    keeps the input alone (2 F a token, not 4 F) and the backward recomputes s from it.
    Under a 16-bit compute there, gate | up arrive in 16 bits and y leaves in 16 bits (the
    values the down projection rounds to; activation_layer.keep_low_around): `reads_low`.
    """

    reads_low = True

    def __repr__(self):
        return "SwiGLU"

    def forward(self, a, mb=0, record=True):
        xp, f = nn.array_module(a), a.shape[-1] // 2
        if cuda_ops.swiglu_takes(xp, a):                         # cupy: one kernel
            a = xp.ascontiguousarray(a)
            self.save(mb, record, (a,))
            return cuda_ops.swiglu_forward(xp, a)
        g, u = a[..., :f], a[..., f:]
        s, _ = nn.sigmoid_forward(g)
        silu = g * s
        self.save(mb, record, (g, u, s, silu))
        return silu * u

    def backward(self, dy, mb=0):
        saved = self.pop(mb)
        xp, f = nn.array_module(dy), dy.shape[-1]
        if len(saved) == 1:                                      # the kernel's tape: a alone
            (a,) = saved
            if is_low(a):                      # dy on the 16-bit grid (the down's dx): exact
                dy = dy.astype(a.dtype, copy=False)
            if dy.dtype == a.dtype:
                return cuda_ops.swiglu_backward(xp, dy, a)
            g, u = a[..., :f], a[..., f:]                         # (another dtype: xp ops)
            s = nn.sigmoid_forward(g)[0]
            saved = (g, u, s, g * s)
        g, u, s, silu = saved
        da = xp.empty(dy.shape[:-1] + (2 * f,), dtype=dy.dtype)
        dgate, dup = da[..., :f], da[..., f:]
        xp.multiply(dy, silu, out=dup)                           # undoes silu * up in up
        slope = 1.0 - s                                          # silu'(g) = s (1 + g (1 - s))
        slope *= g
        slope += 1.0
        slope *= s
        xp.multiply(dy, u, out=dgate)                            # ... in gate
        dgate *= slope
        return da


class LlamaBlock(Composite):
    """Llama block i: h + attn(rms_1(h)), then h + mlp(rms_2(h)).

    The q | k | v projection is the spec's `qkv_projection(access, prefix)` (a Llama-derived
    spec's own unit; the Llama's FusedLinear). heads: a KVHeads for the heads this rank
    computes; linear: as the GPT's Block's;
    attention(heads): the attention units under cp (parallelize.py: a grouped ring, or
    RepeatKV and Ulysses; None: GroupedQueryAttention); token_positions: the rotary's."""

    recomputable = True        # what recompute=1 wraps (nn/recompute.py)

    def __init__(self, model, access, index, heads, linear=plain_linear, attention=None,
                 token_positions=leading_positions):
        p, eps = f"block_{index}", model.norm_eps
        core = [GroupedQueryAttention(heads)] if attention is None else list(attention(heads))
        attn = Residual([RMSNorm(access, f"{p}/ln_1", eps),
                         *fused_column(linear, access, model.qkv_projection(access, p)),
                         Rotary(heads.n_q, heads.n_kv, model.d_head, model.rope_theta,
                                token_positions),
                         *core,
                         *linear(access, f"{p}/attn/proj/weights", None, "row")])
        if model.n_experts is not None:        # Mixtral: experts replicated on tp
            mlp = Residual([RMSNorm(access, f"{p}/ln_2", eps), SparseMoE(model, access, index)])
        else:                                  # SwiGLU reads 16 bits on a device's kernels
            mlp = Residual(keep_low_around([
                RMSNorm(access, f"{p}/ln_2", eps),
                *fused_column(linear, access, FusedLinear(
                    access, [f"{p}/mlp/gate/weights", f"{p}/mlp/up/weights"])),
                SwiGLU(), *linear(access, f"{p}/mlp/down/weights", None, "row")]))
        super().__init__([attn, mlp])
        self.index = index

    def __repr__(self):
        return f"LlamaBlock({self.index})"


class LlamaHead(Head):
    """rms_f, then the head: logits = rms_f(h) head/weights, or rms_f(h) embed/tokens^T when
    tied. head: replacement head units (e.g. a vocab-parallel head)."""

    def __init__(self, model, access, head=None):
        head = model_head(access, model.tied) if head is None else head
        super().__init__([RMSNorm(access, "ln_f", model.norm_eps), *head])

    def __repr__(self):
        return "LlamaHead"


def llama_units(model, access, blocks, first: bool, last: bool, attention=None,
                token_positions=leading_positions, linear=plain_linear, heads=None,
                embedding=None, head=None) -> list:
    """The units of a pipeline chunk holding `blocks` (block indices), the embedding in front
    on the first chunk, rms_f + head behind on the last. attention, token_positions: cp's
    (context_parallel.context_units); linear, heads (a KVHeads), embedding, head: tp's."""
    heads = heads or KVHeads(model.n_heads, model.n_kv_heads)
    units = [embedding or TokenEmbedding(access)] if first else []
    units += [LlamaBlock(model, access, i, heads, linear, attention, token_positions)
              for i in blocks]
    if last:
        units.append(LlamaHead(model, access, head))
    return units
