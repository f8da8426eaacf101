"""A decoder's cost model (no MPI): the GPT's, and the terms ms.Llama shares (llama/costs.py).

Parameter uses (the generic table: parallel/unit_costs.py), with what a decoder adds: a tied
head fetches embed/tokens twice more and adds a second gradient for it (the embedding's uses on
the first pp stage, the head's on the last, tied.py), and `recompute=1` runs every block's
forward a second time in its backward: one more fetch of each block parameter
(`recompute=attn` recomputes only parameter-free units).

A decoder's pipeline boundary is the residual stream of this rank's tokens: (B, T_l, D) with
T_l = seq_len / cp (the plan assumes full-length sequences), and T_l / tp of them under
sequence_parallel. Its tp traffic (Megatron's f and g, sequence_parallel, the vocab-parallel
embedding and loss) is priced per activation of that stream: decoder_tensor_parallel.py.

Step time (costs/step_time.py): per weight block forward 2 r d_in d_out, backward twice that,
a forward more under recompute=1, and per block and microbatch the attention's batched GEMMs:
2 forward (q k^T, p v), 5 backward (the scores again, dv, dp, dq, dk), on (heads / tp) x T_q x
T_k x D_h. Element-wise: two norms, the MLP's activation, the softmax on the scores (ring cp:
per step, and the online merges), the plain passes (biases, residuals, head splits); the
embedding, ln_f and the cross-entropy on the first and last stage.
"""
from __future__ import annotations

from collections import Counter

from ...parallel import decoder_tensor_parallel as decoder_tp
from ...parallel.unit_costs import (HEAD_MARK, CostPart, decoder_stage, holds_embedding,
                                    local_tokens, unit_grad_order, unit_uses)

TIED_NAME = "embed/tokens"


def param_uses(model, layout, name: str, held=None) -> tuple:
    """(gets, gradients added) of parameter `name` per microbatch (module docstring). held: the
    names the rank holds, when they tell its pp stage."""
    gets, grads = unit_uses(name)
    if name == TIED_NAME and model.tied:
        embedding, head = (True, True) if held is None else \
            (holds_embedding(held), HEAD_MARK in held)
        gets, grads = embedding + 2 * head, embedding + head   # embedding; tied head
    if layout.option("recompute") == "1" and name.startswith("block_"):
        gets += 1                                      # the block's forward, once more
    return gets, grads


def grad_order(model, names) -> list:
    """unit_grad_order, and a tied head adds embed/tokens first (on the last stage; a pp rank
    without the embedding holds the head's copy only)."""
    order = unit_grad_order(names)
    if model.tied and TIED_NAME in order:
        if not holds_embedding(names):                 # pp: the last stage's tied copy
            order.remove(TIED_NAME)
        if HEAD_MARK in names:
            order.insert(0, TIED_NAME)
    return order


def boundary_width(model, layout, layer) -> int:
    """Elements per batch row of the residual stream (T_l, D) a stage sends on."""
    sp = layout.size("tp") if layout.option("sequence_parallel", 0) else 1
    return local_tokens(model, layout) // sp * model.d_model


def check_costs(model, layout) -> None:
    """sequence_parallel must split a rank's seq_len / cp tokens over tp."""
    if layout.size("tp") > 1 and layout.option("sequence_parallel", 0):
        decoder_tp.check_sequence_split(model, layout)


class DecoderTensorParallel(CostPart):
    """A decoder's tp traffic: decoder_tensor_parallel's, with `sublayers` split blocks per
    block (the attention and the MLP; the attention alone where the MLP is not on tp)."""

    def __init__(self, sublayers: int = 2):
        self.sublayers = sublayers

    def memory(self, view, n_state) -> dict:
        return decoder_tp.memory(view, n_state)

    def step_comm(self, view) -> dict:
        return decoder_tp.step_comm(view, self.sublayers)

    def step_calls(self, view) -> Counter:
        return decoder_tp.step_calls(view, self.sublayers)


def gemms(model, view) -> list:
    """(flops per GEMM call, calls per step, curve) of a decoder rank (module docstring): the
    weight blocks on 'gemm' (not the embeddings' look-ups; the tied head's product is one),
    the attention on 'bgemm'."""
    layout, m = view.layout, view.microbatches
    forwards = 2 if layout.option("recompute") == "1" else 1
    rows = view.rows * local_tokens(model, layout)
    out = []
    for name, info in view.params.items():
        shape = view.blocks[name]
        if len(shape) != 2 or name == "embed/positions" or name == TIED_NAME and not model.tied:
            continue                                  # biases, norms, embedding look-ups
        size = shape[0] * shape[1] * (layout.size("fsdp") if not
                                      info.placement.is_replicated_on("fsdp") else 1)
        out.append((2 * rows / m * size, (forwards + 2) * m, "gemm"))
    stage, c = decoder_stage(view), layout.size("cp")
    heads, dh = model.n_heads // layout.size("tp"), model.d_model // model.n_heads
    if layout.option("cp_kind", "ring") == "ring":      # c blocks of T/c keys each
        tq, tk, blocks = model.seq_len // c, model.seq_len // c, c
    else:                                               # Ulysses: heads over cp
        heads, tq, tk, blocks = heads // c, model.seq_len, model.seq_len, 1
    per_call = 2 * (view.rows / m) * heads * tq * tk * dh
    out.append((per_call, (2 * forwards + 5) * stage.blocks * blocks * m, "bgemm"))
    return out


def gelu_mlp(model, view, op, tokens, seq) -> tuple:
    """(the MLP's element-wise seconds, the rest's beyond the shared terms) of one GPT block:
    GELU on the d_ff activation; the column biases (forward + gradient) and the row biases."""
    t, d, f = view.layout.size("tp"), model.d_model, model.d_ff
    extra = (2 * sum(op("pass", tokens * w / t) for w in (3 * d, f))      # column biases
             + 2 * 2 * op("pass", seq * d))                # row biases: add, gradient
    return op("gelu", tokens * f / t), extra


def elementwise(model, view, op, fixed, mlp_terms=gelu_mlp) -> float:
    """Seconds of a decoder rank's element-wise work per train_step (module docstring);
    op(name, elements): the calibrated seconds of one call; mlp_terms: the block's MLP and
    model-specific passes (gelu_mlp; a Llama's SwiGLU: llama/costs.py)."""
    layout, m = view.layout, view.microbatches
    stage, t, d = decoder_stage(view), layout.size("tp"), model.d_model
    tokens = view.rows / m * local_tokens(model, layout)
    seq = tokens / t if layout.option("sequence_parallel", 0) else tokens
    scores = view.rows / m * model.n_heads / t * local_tokens(model, layout) * model.seq_len
    ring = layout.option("cp_kind", "ring") == "ring" and layout.size("cp") > 1
    steps = layout.size("cp") if ring else 1     # ring: a block of scores per step, merged
    mlp, extra = mlp_terms(model, view, op, tokens, seq)
    block = (2 * op("layernorm", seq * d) + mlp + extra
             + steps * op("softmax", scores / steps)
             + (steps - 1) * 6 * op("pass", tokens * d / t)      # online merges
             + 2 * 4 * op("pass", tokens * d / t)    # q|k|v|out head splits
             + 4 * op("pass", seq * d))         # residual adds, both ways
    block *= (2 + (2 if layout.option("recompute") == "1" else 1)) / 3    # a forward is ~1/3
    seconds = stage.blocks * block
    if stage.first:
        seconds += op("embedding", seq * d)
    if stage.last:
        seconds += op("layernorm", seq * d) + op("xent", tokens * model.vocab_size / t)
    return m * (seconds + stage.blocks * fixed["gpt_block"] + fixed["gpt_base"])


def gpt_flops(model, batch: int) -> int:
    """FLOPs of one training step on full sequences, 3 x the forward's matmuls: per layer its
    weight matrices (a GPT's q, k, v and output projections 4 d^2 per token and MLP 2 d d_ff;
    a Llama's q, k, v, o, gate, up, down), scores and weighted values (2 T d), and the head
    (d V); 2 FLOPs per multiply-add."""
    d, T = model.d_model, model.seq_len
    block = sum(a * b for a, b in (s for s in model.block_param_shapes(0).values()
                                   if len(s) == 2))
    per_token = model.n_layers * (block + 2 * T * d) + d * model.vocab_size
    return 3 * 2 * batch * T * per_token


def gpt_block(model, view, t: int, n: int) -> dict:
    """Per batch row, what one GPT block keeps for backward besides the probabilities
    (activation_elements): two LayerNorms' xhat and rstd 2 n (D + 1), the qkv and fc inputs
    2 T D, q | k | v (views of one array) 3 T D / tp, the attention output (the proj input is
    a view of it) T D / tp, the GELU's derivative and output 2 T F / tp. recompute=attn keeps
    all of it (the core's q | k | v input is the qkv array).

    Under a rounding policy (costs/storage.py) 'wide' at the itemsize and 'low' at the compute
    dtype's: the norms' xhat and rstd, the attention output and GELU's derivative stay wide;
    the qkv and fc inputs, q | k | v, the proj input (a rounded copy of the attention output,
    beside it) and the mlp proj input (GELU's output rounded) are low. For recompute=attn:
    'out', the attention output (wide); 'core_low', what the core keeps low (q | k | v, 3 T D
    / tp); 'core_input', the core's input it keeps instead (the qkv product, wide);
    'act_wide', what the MLP's activation keeps among the wide (GELU's derivative T F / tp),
    and 'act_low', what it keeps instead, in 16 bits, on a device's fused 16-bit step
    (GELU's input T F / tp; costs/storage.py low_act); 'act_fused', what the device's fused
    kernels keep in a float32 or float64 step (fused.py's GELU: its derivative, T F / tp)."""
    tp, d, f = view.layout.size("tp"), model.d_model, model.d_ff
    return {"kept": 2 * n * (d + 1) + 2 * t * d + 4 * t * d // tp + 2 * t * f // tp,
            "wide": 2 * n * (d + 1) + t * d // tp + t * f // tp,
            "low": 2 * t * d + 4 * t * d // tp + t * f // tp, "out": t * d // tp, "core": 0,
            "core_low": 3 * t * d // tp, "core_input": 3 * t * d // tp, "per_microbatch": 0,
            "act_wide": t * f // tp, "act_low": t * f // tp, "act_fused": t * f // tp}


def activation_elements(model, view, recompute: str, block_terms=gpt_block) -> dict:
    """Per batch row, the elements this rank's units keep for backward and the largest
    transients (costs/peak_memory.py adds them up), from the blocks' local shapes: T = seq_len
    / cp tokens, D, H heads, tp; n norm tokens (T / tp under sequence_parallel).

    per block (recompute=0): block_terms(model, view, T, n)'s 'kept' (gpt_block; a Llama's:
    llama/costs.py) and the kept probabilities H T S / tp (S = seq_len keys per query of the
    T; cp: H seq^2 / (tp cp)); its 'per_microbatch' elements are held once per microbatch
    whatever its rows (a Llama's rotary angles).
    recompute=1: the block input n D, and in backward one block's internals (workspace);
    recompute=attn: the probabilities and block_terms' 'core' (what the attention core keeps
    beyond its input) are not kept.
    workspace: the attention backward's ds, one probabilities-sized array. First stage: the
    token ids (int64), under tp with their in-range mask (bool). Last stage: ln_f n (D + 1),
    the head input T D, the logits T v (v the vocabulary, per tp rank padded: vocab-parallel;
    alive with their gradient through the blocks' backward: backward_holds_logits) and the
    head's weight block D v; head_keeps_low: the head is the model's own (not tp's
    vocab-parallel one), whose logits a device's 16-bit step keeps in 16 bits for the loss
    (nn/transformer.model_head). Under cp the probabilities are an upper bound: the ring
    and Ulysses units keep less (measured: a few % of the total at toy size).

    For costs/storage.py, what a rounding policy keeps instead: saved_wide and saved_low (the
    blocks' 'wide' with the probabilities and 'low'; recompute=attn: the core's input wide
    instead of its output and its low q | k | v; ln_f's stats wide, the head input low),
    workspace_wide and workspace_low alike (the backward's ds wide; recompute=1 one block's
    internals); saved_probs and workspace_probs, the kept probabilities among them, and lse,
    the (H / tp) x T log-sum-exp a device's fused attention keeps instead; saved_out and
    workspace_out, the attention outputs among the wide, which cuDNN writes in 16 bits;
    saved_act_wide and workspace_act_wide, the MLP activations' wide arrays among them, and
    saved_act_low and workspace_act_low, the 16-bit ones a device's fused kernels keep,
    saved_act_fused and workspace_act_fused, what they keep in a float32 step; ds,
    the backward's probabilities-sized ds; fused_attention: whether a device's fused
    attention takes these blocks (whole sequences and Ulysses; the ring keeps its own)."""
    layout = view.layout
    tp, cp = layout.size("tp"), layout.size("cp")
    t, d = local_tokens(model, layout), model.d_model
    n = t // tp if tp > 1 and layout.option("sequence_parallel", 0) else t
    probs = model.n_heads * t * model.seq_len // tp if cp == 1 else \
        model.n_heads * model.seq_len ** 2 // (tp * cp)
    terms = block_terms(model, view, t, n)
    block = terms["kept"]
    blocks = len({name.split("/")[0] for name in view.params if name.startswith("block_")})
    kept = {"0": block + probs, "attn": block - terms["core"], "1": n * d}[recompute]
    rounded = {"0": (terms["wide"] + probs, terms["low"]),       # under a rounding policy
               "attn": (terms["wide"] - terms["out"] + terms["core_input"],
                        terms["low"] - terms["core_low"]), "1": (n * d, 0)}[recompute]
    again = recompute == "1"                      # the backward's block forward, again
    out = {"saved": blocks * kept, "workspace": probs + (block + probs) * again,
           "saved_wide": blocks * rounded[0], "saved_low": blocks * rounded[1],
           "saved_probs": blocks * probs * (recompute == "0"),
           "saved_out": blocks * terms["out"] * (recompute == "0"),
           "lse": blocks * model.n_heads // tp * t * (recompute == "0"),
           "workspace_wide": probs + (terms["wide"] + probs) * again,
           "workspace_low": terms["low"] * again, "workspace_probs": probs * again,
           "workspace_out": terms["out"] * again, "ds": probs,
           **{f"{key}_act_{k}": terms.get(f"act_{k}", 0) * (blocks * (recompute != "1")
                                                            if key == "saved" else again)
              for key in ("saved", "workspace") for k in ("wide", "low", "fused")},
           "fused_attention": cp == 1 or layout.option("cp_kind", "ring") != "ring",
           "per_microbatch": blocks * terms["per_microbatch"] * (recompute != "1"),
           "logits": 0, "head_weights": 0, "vocab_parallel": tp > 1,
           "input_bytes": 2 * 8 * model.seq_len // cp, "backward_holds_logits": True,
           "head_keeps_low": tp == 1}
    if holds_embedding(view.params):
        ids = (8 + (tp > 1)) * t / view.itemsize     # the token ids (int64); their
        out["saved"] += ids                          # vocab-parallel in-range mask (bool)
        out["saved_wide"] += ids
    if HEAD_MARK in view.params:
        v = -(-model.vocab_size // tp)
        out["saved"] += n * (d + 1) + t * d
        out["saved_wide"] += n * (d + 1)
        out["saved_low"] += t * d
        out.update(logits=t * v, head_weights=d * v)
    return out
