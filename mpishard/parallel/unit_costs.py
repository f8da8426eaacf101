"""What the cost models read off the units (no MPI): the generic part of a spec's cost model.

A spec's `param_uses`, `grad_order` and `boundary_width` (models/interface.py, section "cost
model") start from these and add what their own units do differently:

    unit                forward gets   backward gets   gradients added
    Linear W, b         W, b           W               W, b
    LayerNorm           scale, shift   scale           scale, shift
    Embedding           tokens, pos.   -               tokens, positions

so a weight or a scale is fetched twice and a bias or a shift once (`unit_uses`), and one
microbatch's backward adds the gradients unit by unit, last to first (`unit_grad_order`).

A model's own strategies (its tensor-parallel blocks, its experts' exchange) are priced by
`CostPart`s its spec lists (`cost_parts`), beside the generic strategies' own cost models.

A decoder (blocks between a token embedding and a head) runs on a stream of tokens:
`DecoderStage` says which blocks, embedding and head a rank's pp stage holds and how many
tokens it runs per step; the decoder strategies' pricing (decoder_tensor_parallel,
context_parallel, and the step-time model) reads it.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

EMBEDDING_MARK = "block_0/ln_1/scale"     # the embedding lives with block 0 (decoder.py)
HEAD_MARK = "ln_f/scale"                  # ln_f, the head and the loss live together


def unit_uses(name: str) -> tuple:
    """(gets, gradients added) per microbatch of parameter `name` in its unit (table above)."""
    kind = name.rsplit("/", 1)[1]
    return (2 if kind in ("weights", "scale") else 1), 1


def unit_grad_order(names) -> list:
    """`names` (a stage's parameters, in model order) in the order one microbatch's backward
    adds their gradients: units last to first, each unit's own parameters in order (Linear W
    then b, LayerNorm scale then shift, Embedding tokens then positions)."""
    units: dict = {}
    for name in names:
        units.setdefault(name.rsplit("/", 1)[0], []).append(name)
    return [name for unit in reversed(list(units)) for name in units[unit]]


def holds_embedding(names) -> bool:
    """Whether a decoder rank holding parameters `names` runs the embedding."""
    return EMBEDDING_MARK in names


def local_tokens(model, layout) -> int:
    """Tokens per batch row a decoder rank's attention and projections run on: seq_len / cp."""
    return model.seq_len // layout.size("cp")


@dataclass(frozen=True)
class DecoderStage:
    """What a decoder rank's pp stage runs per train_step, for the cost models."""

    blocks: int          # transformer blocks held
    first: bool          # the embedding lives here
    last: bool           # ln_f, the head and the loss live here
    tokens: int          # rows x seq_len / cp: tokens per step, all microbatches together
    forwards: int        # forward passes of each block per microbatch (2 with recompute=1)


def decoder_stage(view) -> DecoderStage:
    """The DecoderStage of a RankView's rank."""
    held = {name.split("/", 1)[0] for name in view.params if name.startswith("block_")}
    return DecoderStage(blocks=len(held), first=holds_embedding(view.params),
                        last=HEAD_MARK in view.params,
                        tokens=view.rows * local_tokens(view.model, view.layout),
                        forwards=2 if view.layout.option("recompute") == "1" else 1)


class CostPart:
    """One of a model's own strategies as the cost models see it (a spec's `cost_parts`):
    what it holds beyond the base and sends per step, as every strategy file's cost model
    (costs/rank_costs.py), plus its calls (costs/call_counts.py) and, for the step-time
    model, the groups they run on. The defaults: nothing held, sent or called."""

    axes = ("tp",)       # the group its calls run on (time_groups)

    def memory(self, view, n_state) -> dict:
        return {}

    def step_comm(self, view) -> dict:
        """{phase: {kind: bytes}} of one train_step and optimizer step."""
        return {}

    def step_calls(self, view) -> Counter:
        """{kind: calls} of one train_step and optimizer step."""
        return Counter()

    def gradient_bytes(self, view) -> dict:
        """{kind: bytes} this part adds to the data-parallel gradient sync's calls."""
        return {}

    def sent(self, view) -> dict:
        """{kind: bytes} of step_comm, both phases added."""
        out = Counter()
        for kinds in self.step_comm(view).values():
            out.update(kinds)
        return dict(out)

    def time_groups(self) -> tuple:
        """((calls of a view, bytes of a view, axes), ...): the step-time model's groups."""
        return ((self.step_calls, self.sent, self.axes),)
