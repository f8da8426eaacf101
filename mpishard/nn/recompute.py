"""Activation recompute: keep a unit's input, not its internals, and run it again in backward.

    forward   y = f(x)                    f runs with record=False: its units save nothing;
                                          the wrapper saves x (one (B, T, D) array) per mb
    backward  f(x) again, record=True     the same forward, now saving what its backward needs
              dx = f'(x)^T dy             then f's own backward, which pops what it just saved

The recomputed forward calls every inner unit exactly as the first one did: the same
parameter gets through the access policy (FSDP all-gathers the weights again), the same
collectives in the same order on every rank (a tp/sp all-reduce or all-gather, a cp ring), so
it stays correct under any strategy the inner units implement, at the price of one more
forward of the wrapped units. The wrapper knows nothing of what it wraps; it keeps, beside
x, the rows' document ids its first forward saw (nn/documents.py), and the recomputed
forward sees those again, whatever rows the engine was given since.

Layout option `recompute=`:
    1      every transformer block (the units that say `recomputable = True`: a decoder's
           blocks, each two residual branches: attention and MLP)
    attn   only the attention core (CausalSelfAttention, or cp's ring or Ulysses unit), "selective"
           recompute: its q | k | v input is kept, the per-head copies, output and
           log-sum-exp are not
    0      nothing (the default)
"""
from __future__ import annotations

from .documents import ids_of
from .layers import Composite, Layer

MODES = ("0", "1", "attn")


class Recompute(Layer):
    """Wraps one unit: forward without its tape, backward = forward again + backward."""

    documents = None           # the rank's nn.documents.Documents (documents.attach)

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.param_names = inner.param_names

    def __repr__(self):
        return f"Recompute({self.inner!r})"

    def clear(self):
        super().clear()
        self.inner.clear()

    def forget(self, mb) -> None:
        super().forget(mb)
        self.inner.forget(mb)

    def forward(self, x, mb=0, record=True):
        y = self.inner.forward(x, mb, record=False)     # nothing of f's internals is kept
        self.save(mb, record, (x, ids_of(self.documents, mb)))    # ... only its input
        return y

    def backward(self, dy, mb=0):
        x, ids = self.pop(mb)
        if ids is None:
            self.inner.forward(x, mb, record=True)      # recompute f(x), saving its internals
        else:
            with self.documents.holding(mb, ids):       # ... in the same documents
                self.inner.forward(x, mb, record=True)
        return self.inner.backward(dy, mb)              # undoes forward (pops what it saved)


def recompute_chunks(model, chunks: list, mode, layout_text: str = "") -> list:
    """`chunks` (lists of units, one per virtual stage) with `mode`'s units wrapped in
    Recompute; ValueError (the same on every rank, no communication) for a model without
    transformer blocks (model.supports_recompute())."""
    mode = "0" if mode is None else str(mode)
    if mode not in MODES:
        raise ValueError(f"layout {layout_text!r}: recompute={mode!r} not one of {list(MODES)}")
    if mode == "0":
        return chunks
    if not model.supports_recompute():
        raise ValueError(f"layout {layout_text!r}: recompute={mode} recomputes transformer "
                         f"blocks; {model!r} has none (use a decoder: a language model)")
    if mode == "1":
        return [[Recompute(u) if getattr(u, "recomputable", False) else u for u in chunk]
                for chunk in chunks]
    for chunk in chunks:
        for unit in chunk:
            wrap_attention(unit)
    return chunks


def wrap_attention(unit) -> None:
    """Wrap every attention core inside `unit` (a Composite tree) in Recompute: the units that
    say `attention_core = True` (CausalSelfAttention, and cp's ring and Ulysses units)."""
    if not isinstance(unit, Composite):
        return
    for i, sub in enumerate(unit.units):
        if getattr(sub, "attention_core", False):
            unit.units[i] = Recompute(sub)
        else:
            wrap_attention(sub)
