"""ms.Llama's cost model (no MPI): the decoder's (gpt/costs.py) with a Llama's own terms.

A Llama under tp adds the all_reduce of each kv weight gradient it holds replicated on tp
(the spec's tp_replicated_params); its MLP is SwiGLU (a sigmoid and four products of the
(T, F) activation), its norms RMSNorm (priced as LayerNorm, no bias), and rotary runs on q and
k both ways. In a Mixtral the attention alone is split over tp (the router and experts are
replicated on it: experts.py), and the experts cost one rank the ep exchange's bytes and
calls, the routing statistics' all_reduce, and their GEMMs, at the expected tokens per expert.

The exchange follows the routing, so the plan prices its expectation under uniform routing:
each of the n tokens a rank routes per microbatch picks k experts, E/P of them on each of the
P ep ranks, so of its n k (token, choice) rows n k (P-1)/P travel to other ranks, and as many
come back from them (every expert gets n k / E rows from each rank: P n k / E in all).
`engine.comm_bytes` counts exactly that on a balanced batch (tests/costs/test_moe_costs.py).
Per block and microbatch, as nn/moe_routing.TokenExchange and experts.RoutingStats
run them (each forward: `forwards` = 2 under recompute=1):

    gradients  (once per step) those replicated on ep averaged over it too: ep_gradient_bytes;
               under sequence_parallel the router's and experts' summed over tp (tp_partial_*)
    forward    counts all_to_all of E int64 ((P-1)/P x 8 E bytes), dispatch and combine
               all_to_all_v (n k (P-1)/P rows of D each); routing statistics: one all_reduce of
               2 E int64 over the token axes (aux_loss.token_axes), ep or not, in the
               recording forward only
    backward   the adjoints of combine and dispatch (the same rows again)

n is this rank's tokens of a microbatch: rows / m x T / cp, / tp under sequence_parallel
(without it the tp ranks repeat their group's exchange). The experts' weights are the
placement's (dim 0 over ep, then fsdp's split), so the base memory already holds E / P
experts per rank; the dispatch buffers are transient and `memory_report` measures them (the
activation tapes hold the received rows and the combined slots).

The experts' GEMMs: each local expert runs 3 matrices (gate, up: D x F; down: F x D) on its
P n k / E expected rows, forward and twice backward (plus a forward under recompute=1).
"""
from __future__ import annotations

from collections import Counter

from ...parallel.unit_costs import CostPart
from ..gpt import costs as decoder
from ...parallel.aux_loss import token_axes
from .tensor_parallel import step_comm as kv_comm

INT_BYTES = 8                    # the counts and the statistics travel as int64


class LlamaTensorParallel(decoder.DecoderTensorParallel):
    """The decoder's tp traffic, and the all_reduce of each replicated kv weight gradient
    held, per microbatch (tensor_parallel.step_comm)."""

    def step_comm(self, view) -> dict:
        out = {phase: Counter(kinds) for phase, kinds in super().step_comm(view).items()}
        for phase, kinds in kv_comm(view).items():
            out.setdefault(phase, Counter()).update(kinds)
        return {phase: dict(kinds) for phase, kinds in out.items()}

    def time_groups(self) -> tuple:
        """One tp group: its calls with the kv gradients' all_reduces, its bytes the decoder's
        alone (the step-time model's mean bytes per call leaves the kv gradients out)."""
        return ((self.step_calls, self.decoder_sent, self.axes),)

    def decoder_sent(self, view) -> dict:
        """{kind: bytes} of the decoder's tp traffic, both phases."""
        out = Counter()
        for kinds in super().step_comm(view).values():
            out.update(kinds)
        return dict(out)

    def step_calls(self, view) -> Counter:
        out = super().step_calls(view)
        if view.size("tp") > 1:
            kv = sum(1 for n in view.model.tp_replicated_params(view.size("tp"))
                     if n in view.params)
            out.update(all_reduce=view.microbatches * kv)
        return out


def microbatch_tokens(view) -> float:
    """n: the tokens this rank routes in one microbatch (module docstring)."""
    sp = view.layout.option("sequence_parallel", 0)
    tokens = view.rows / view.microbatches * view.model.seq_len / view.size("cp")
    return tokens / (view.size("tp") if sp else 1)


def _counts(view) -> tuple:
    """(MoE blocks this rank holds, forwards per microbatch, microbatches)."""
    blocks = len({n.split("/", 1)[0] for n in view.params if "/moe/router/" in n})
    return blocks, 2 if view.layout.option("recompute") == "1" else 1, view.microbatches


def exchange_calls(view) -> Counter:
    """The ep exchange's all_to_all calls (counts, dispatch, combine; two adjoints)."""
    if view.size("ep") == 1:
        return Counter()
    blocks, forwards, m = _counts(view)
    return Counter(all_to_all=blocks * m * (3 * forwards + 2))


def exchange_bytes(view) -> dict:
    if not exchange_calls(view):
        return {}
    model, p = view.model, view.size("ep")
    blocks, forwards, m = _counts(view)
    rows = microbatch_tokens(view) * model.top_k * (p - 1) / p
    counts = (p - 1) / p * INT_BYTES * model.n_experts
    per_pass = 2 * rows * model.d_model * view.itemsize
    return {"all_to_all": blocks * m * (forwards * (per_pass + counts) + per_pass)}


def stats_calls(view) -> Counter:
    """The routing statistics' all_reduce over the token axes, one per block and microbatch:
    only the recording forward reduces them (under recompute=1 the untaped first pass does
    not, moe_units.SparseMoE.forward)."""
    if not token_axes(view.layout):
        return Counter()
    blocks, _, m = _counts(view)
    return Counter(all_reduce=blocks * m)


def stats_bytes(view) -> dict:
    calls = stats_calls(view)
    if not calls:
        return {}
    one = view.all_reduce_bytes(token_axes(view.layout), 2 * INT_BYTES * view.model.n_experts)
    return {"all_reduce": calls["all_reduce"] * one}


def ep_gradient_bytes(view) -> dict:
    """What ep adds to data_parallel.step_comm's gradient all_reduce (that one averages every
    gradient over dp and cp): the gradients replicated on ep (all but the experts') are
    averaged over dp, ep and cp together (GradientSync groups them by those axes)."""
    if view.size("ep") == 1:
        return {}
    base = tuple(a for a in ("dp", "cp") if view.size(a) > 1)
    extra = 0.0
    for name, info in view.params.items():
        if info.placement.is_replicated_on("ep"):
            nbytes = view.nbytes(view.grad_blocks[name])
            extra += view.all_reduce_bytes(base + ("ep",), nbytes) - \
                (view.all_reduce_bytes(base, nbytes) if base else 0.0)
    return {"all_reduce": extra}


def _tp_partial(view) -> list:
    """Under sequence_parallel each tp rank routes its own tokens, so the router's and its
    experts' gradients are partial sums per tp rank, summed over tp (SequenceParallelGrads:
    one all_reduce of each local block per microbatch)."""
    if view.size("tp") == 1 or not view.layout.option("sequence_parallel", 0):
        return []
    return [n for n in view.params if "/moe/" in n]


def tp_partial_calls(view) -> Counter:
    names = _tp_partial(view)
    return Counter(all_reduce=view.microbatches * len(names)) if names else Counter()


def tp_partial_bytes(view) -> dict:
    names = _tp_partial(view)
    if not names:
        return {}
    return {"all_reduce": view.microbatches * sum(
        view.all_reduce_bytes("tp", view.nbytes(view.blocks[n])) for n in names)}


class MixtralExperts(CostPart):
    """A Mixtral's exchange, routing statistics and tp-partial gradients (module docstring)."""

    axes = ("ep",)

    def step_comm(self, view) -> dict:
        """{'train_step': {kind: bytes}} of the exchange and the statistics."""
        out = Counter(exchange_bytes(view))
        for part in (stats_bytes, ep_gradient_bytes, tp_partial_bytes):
            out.update(part(view))
        return {"train_step": dict(out)} if out else {}

    def step_calls(self, view) -> Counter:
        """{kind: calls} of the exchange and the statistics in one train_step."""
        return exchange_calls(view) + stats_calls(view) + tp_partial_calls(view)

    def gradient_bytes(self, view) -> dict:
        return ep_gradient_bytes(view)

    def time_groups(self) -> tuple:
        return ((exchange_calls, exchange_bytes, ("ep",)),
                (tp_partial_calls, tp_partial_bytes, ("tp",)),
                (stats_calls, stats_bytes, ("dp", "fsdp", "ep", "cp")))


def cost_parts(model) -> dict:
    """The Llama's tp part (the attention alone on tp in a Mixtral), and a Mixtral's experts."""
    if model.n_experts is None:
        return {"tp": (LlamaTensorParallel(2),), "ep": ()}
    return {"tp": (LlamaTensorParallel(1),), "ep": (MixtralExperts(),)}


def expert_gemms(view) -> list:
    """(flops per GEMM call, calls per step, 'gemm') of the local experts' matrices."""
    model, p = view.model, view.size("ep")
    blocks, forwards, m = _counts(view)
    rows = p * microbatch_tokens(view) * model.top_k / model.n_experts
    flops = 2 * rows * model.d_model * model.d_ff
    return [(flops, 3 * model.n_experts // p * blocks * m * (forwards + 2), "gemm")]


def gemms(model, view) -> list:
    """The decoder's GEMMs, and a Mixtral's experts' (their 3-d weights are not the
    decoder's)."""
    return decoder.gemms(model, view) + (expert_gemms(view) if model.n_experts else [])


def swiglu_mlp(model, view, op, tokens, seq) -> tuple:
    """(the MLP's element-wise seconds, the rest's) of one Llama block: SwiGLU's sigmoid and
    4 products of (T, F) split over tp, or in a Mixtral k experts' per token (not split over
    tp) and the mix; rotary on q and k both ways."""
    t, d, f = view.layout.size("tp"), model.d_model, model.d_ff
    if model.n_experts:
        k = model.top_k
        mlp = op("sigmoid", seq * f * k) + 4 * op("pass", seq * f * k) + \
            4 * op("pass", seq * d * k)
    else:
        mlp = op("sigmoid", tokens * f / t) + 4 * op("pass", tokens * f / t)
    return mlp, 2 * 4 * op("pass", tokens * d / t)


def elementwise(model, view, op, fixed) -> float:
    """The decoder's element-wise seconds with a Llama's MLP terms."""
    return decoder.elementwise(model, view, op, fixed, swiglu_mlp)


def llama_block(model, view, t: int, n: int) -> dict:
    """Per batch row, what one Llama block keeps for backward besides the probabilities
    (gpt/costs.activation_elements' block_terms), q = Hq Dh / tp and w = kv_width(tp):
    two RMSNorms' n and rsqrt 2 n (D + 1), the q | k | v input T D, the rotated q | k | v
    T (q + 2 w) (the core's input), k and v repeated to every query head 2 T q (the 'core':
    recompute=attn drops them), the attention output T q (the proj input is a view of it);
    the MLP: its input T D, SwiGLU's gate | up, sigmoid and silu 4 T F / tp (act_wide; its
    CUDA kernels, on a GPU, keep gate | up alone, 2 T F / tp: act_fused in a float32 or
    float64 step, act_low in 16 bits in a 16-bit one) and the down input T F / tp; in a
    Mixtral instead sparse_moe's. Per microbatch, the rotary's cos and
    sin of the T positions: half-width casts T Dh, or in float64 the angles' arrays 2 T Dh.
    Under a rounding policy (costs/storage.py) 'wide' at the itemsize and 'low' at the compute
    dtype's: the norms, the attention output and SwiGLU's arrays stay wide; the q | k | v and
    MLP inputs, q and the repeated k and v rounded (the rotated array is then freed; the
    repeated k and v are the 'core'), the proj input (a rounded copy of the attention
    output) and the down input are low. For recompute=attn: 'out', the attention output
    (wide); 'core_low', what the core keeps low (q and the repeated k and v, 3 T q);
    'core_input', the core's input it keeps instead (the rotated q | k | v, wide)."""
    tp, d, dh = view.layout.size("tp"), model.d_model, model.d_head
    q = model.n_heads * dh // tp
    attention = n * (d + 1) + t * d + t * (q + 2 * model.kv_width(tp)) + 3 * t * q
    wide, low = n * (d + 1) + t * q, t * d + 4 * t * q
    act = {}
    if model.n_experts is None:
        mlp, fixed = n * (d + 1) + t * d + 5 * t * model.d_ff // tp, 0
        wide += n * (d + 1) + 4 * t * model.d_ff // tp
        low += t * d + t * model.d_ff // tp
        act = {"act_wide": 4 * t * model.d_ff // tp, "act_low": 2 * t * model.d_ff // tp,
               "act_fused": 2 * t * model.d_ff // tp}
    else:
        mlp, fixed = sparse_moe(model, view, n)
        wide += mlp                                    # a Mixtral's MoE priced wide
    rotary = t * dh * (2 if view.itemsize == 8 else 1)
    return {"kept": attention + mlp, "wide": wide, "low": low, "out": t * q, "core": 2 * t * q,
            "core_low": 3 * t * q, "core_input": t * (q + 2 * model.kv_width(tp)),
            "per_microbatch": rotary + fixed, **act}


def sparse_moe(model, view, n: int) -> tuple:
    """(per batch row, per microbatch) elements a Mixtral block's ln_2 and SparseMoE keep, for
    its n tokens (T / tp under sequence_parallel) and k = top_k choices each, all of them kept
    (no capacity drops) and under ep the expected k rows each (uniform routing): ln_2's
    n (D + 1); the rows n D, router probabilities n E, gates n k and their sum n, the combined
    slots n k D, the dispatched rows n k D and the experts' four (rows, F) arrays 4 n k F; the
    choices and the exchange's two orders, 3 n k int64; per microbatch E + 3 int64 (the
    experts' bounds and the exchange's counts)."""
    d, e, k, f = model.d_model, model.n_experts, model.top_k, model.d_ff
    ints = INT_BYTES / view.itemsize
    row = n * (d + 1) + n * (d + e + k + 1 + 2 * k * d + 4 * k * f) + 3 * n * k * ints
    return row, (e + 3) * ints


def activation_elements(model, view, recompute: str) -> dict:
    """The decoder's activation elements with a Llama's (or Mixtral's) blocks: llama_block."""
    return decoder.activation_elements(model, view, recompute, llama_block)
