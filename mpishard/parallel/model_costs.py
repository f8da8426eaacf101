"""What the cost models need to know about a model's units (no MPI), MLP or GPT.

    param_uses(model, layout, name) -> (gets, grads)
        per microbatch, how many times the units fetch parameter `name` through the access
        policy (FSDP ZeRO-3 all-gathers it each time) and how many gradients they add for it
        (ZeRO-2/3 reduce-scatter each one)
    boundary_width(model, layout, spec) -> elements per batch row of the activation a pipeline
        stage ending with layer `spec` sends on (and of the gradient that comes back)

The counts are read off the units' forward and backward (nn/layers.py, nn/transformer.py):

    unit                forward gets   backward gets   gradients added
    Linear W, b         W, b           W               W, b
    LayerNorm           scale, shift   scale           scale, shift
    Embedding           tokens, pos.   -               tokens, positions
    TiedHead            embed/tokens   embed/tokens    embed/tokens

so a weight is fetched twice and a bias once, and a tied GPT's embed/tokens three times with
two gradients. `recompute=1` runs every block's forward a second time in its backward: one
more fetch of each block parameter (`recompute=attn` recomputes only parameter-free units).

A GPT's pipeline boundary is the residual stream (B, T, D) with T = seq_len: the plan assumes
full-length sequences. Not yet: GPT under tp, sequence_parallel or cp (their boundary is
split along D-parallel heads or T, and their own traffic needs their cost models).
"""
from __future__ import annotations

from .tensor_parallel import output_width


def is_gpt(model) -> bool:
    return getattr(model, "kind", "mlp") == "gpt"


def param_uses(model, layout, name: str) -> tuple:
    """(gets, gradients added) of parameter `name` per microbatch (see the module docstring)."""
    kind = name.rsplit("/", 1)[1]
    gets = 2 if kind in ("weights", "scale") else 1
    grads = 1
    if is_gpt(model):
        if name == "embed/tokens" and model.tied:
            gets, grads = 3, 2                         # embedding, then the tied head
        if layout.option("recompute") == "1" and name.startswith("block_"):
            gets += 1                                  # the block's forward, once more
    return gets, grads


def boundary_width(model, layout, spec) -> int:
    """Elements per batch row sent on by a pipeline stage whose last layer is `spec`."""
    if is_gpt(model):
        return model.seq_len * model.d_model           # the residual stream (T, D)
    return output_width(spec, model.n_layers, layout.size("tp"))
