"""What the cost models need to know about a model's units (no MPI), MLP or GPT.

    param_uses(model, layout, name) -> (gets, grads)
        per microbatch, how many times the units fetch parameter `name` through the access
        policy (FSDP ZeRO-3 all-gathers it each time) and how many gradients they add for it
        (ZeRO-2/3 reduce-scatter each one)
    grad_order(model, names) -> the order in which one microbatch's backward adds the
        gradients of `names` (ZeRO-2/3 bucket them in that order)
    boundary_width(model, layout, spec) -> elements per batch row of the activation a pipeline
        stage ending with layer `spec` sends on (and of the gradient that comes back)

The counts are read off the units' forward and backward (nn/layers.py, nn/transformer.py):

    unit                forward gets   backward gets   gradients added
    Linear W, b         W, b           W               W, b
    MLP's Linear 0      W, b           -               W, b     (dx of the model input unused)
    LayerNorm           scale, shift   scale           scale, shift
    Embedding           tokens, pos.   -               tokens, positions
    TiedHead            embed/tokens   embed/tokens    embed/tokens

so a weight is fetched twice (an MLP's first once) and a bias once, and a tied GPT's
embed/tokens three times with two gradients. `recompute=1` runs every block's forward a
second time in its backward: one more fetch of each block parameter (`recompute=attn`
recomputes only parameter-free units).

A GPT's pipeline boundary is the residual stream of this rank's tokens: (B, T_l, D) with
T_l = seq_len / cp (the plan assumes full-length sequences), and T_l / tp of them under
sequence_parallel. The GPT strategies' own traffic (tp, sequence_parallel, the vocab-parallel
embedding and loss, cp) is priced per activation of that stream: `gpt_stage` says which
blocks, embedding and head a rank's stage holds and how many tokens it runs per step.
"""
from __future__ import annotations

from dataclasses import dataclass

from .tensor_parallel import output_width


TRANSFORMER_KINDS = ("gpt", "llama")


def is_gpt(model) -> bool:
    """A transformer spec (ms.GPT, ms.Llama): blocks between a token embedding and a head,
    priced alike (a Llama's fused q|k|v and gate|up count as the GPT's qkv and fc)."""
    return getattr(model, "kind", "mlp") in TRANSFORMER_KINDS


def tp_sublayers(model) -> int:
    """Sublayers of a block split over tp, each with an f and a g (gpt_tensor_parallel.py):
    the attention and the MLP, or the attention alone in a Mixtral (its router and experts
    are replicated on tp: moe_transformer.py)."""
    return 1 if getattr(model, "n_experts", None) else 2


def holds_embedding(names) -> bool:
    """Whether a rank holding parameters `names` runs the embedding: it lives with block 0
    (gpt.gpt_param_stages), for every transformer spec."""
    return "block_0/ln_1/scale" in names


def param_uses(model, layout, name: str, held=None) -> tuple:
    """(gets, gradients added) of parameter `name` per microbatch (see the module docstring).
    held: the names the rank holds, when they tell its pp stage (a tied GPT's embed/tokens
    under pp: the embedding's uses on the first stage, the head's on the last, tied.py)."""
    kind = name.rsplit("/", 1)[1]
    gets = 2 if kind in ("weights", "scale") else 1
    grads = 1
    if getattr(model, "kind", "mlp") == "mlp" and name == "layer_0/weights":
        gets = 1                                       # no backward get: no dx needed
    if is_gpt(model):
        if name == "embed/tokens" and model.tied:
            embedding, head = (True, True) if held is None else \
                (holds_embedding(held), "ln_f/scale" in held)
            gets, grads = embedding + 2 * head, embedding + head   # embedding; tied head
        if layout.option("recompute") == "1" and name.startswith("block_"):
            gets += 1                                  # the block's forward, once more
    return gets, grads


def grad_order(model, names) -> list:
    """The order in which one microbatch's backward adds the gradients of `names` (a stage's
    parameters, in model order): units last to first, each unit's own parameters in order
    (Linear W then b, LayerNorm scale then shift, Embedding tokens then positions), and a tied
    GPT's head adds embed/tokens first."""
    units: dict = {}
    for name in names:
        units.setdefault(name.rsplit("/", 1)[0], []).append(name)
    order = [name for unit in reversed(list(units)) for name in units[unit]]
    if is_gpt(model) and model.tied and "embed/tokens" in units.get("embed", ()):
        if not holds_embedding(names):                 # pp: the last stage's tied copy
            order.remove("embed/tokens")
        if "ln_f/scale" in names:
            order.insert(0, "embed/tokens")
    return order


def local_tokens(model, layout) -> int:
    """Tokens per batch row a rank's attention and projections run on: seq_len / cp."""
    return model.seq_len // layout.size("cp")


def boundary_width(model, layout, spec) -> int:
    """Elements per batch row sent on by a pipeline stage whose last layer is `spec`."""
    if is_gpt(model):                                  # the residual stream (T_l, D)
        sp = layout.size("tp") if layout.option("sequence_parallel", 0) else 1
        return local_tokens(model, layout) // sp * model.d_model
    return output_width(spec, model.n_layers, layout.size("tp"))


@dataclass(frozen=True)
class GPTStage:
    """What a GPT rank's pp stage runs per train_step, for the cost models."""

    blocks: int          # transformer blocks held
    first: bool          # the embedding lives here
    last: bool           # ln_f, the head and the loss live here
    tokens: int          # rows x seq_len / cp: tokens per step, all microbatches together
    forwards: int        # forward passes of each block per microbatch (2 with recompute=1)


def gpt_stage(view) -> GPTStage:
    """The GPTStage of a RankView's rank."""
    held = {name.split("/", 1)[0] for name in view.params if name.startswith("block_")}
    return GPTStage(blocks=len(held), first=holds_embedding(view.params),
                    last="ln_f/scale" in view.params,
                    tokens=view.rows * local_tokens(view.model, view.layout),
                    forwards=2 if view.layout.option("recompute") == "1" else 1)
