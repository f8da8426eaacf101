"""A Qwen2 on the mesh: the Llama's plan and units (llama/parallelize.py), its tp table and
its tp-summed gradients extended by the q, k and v biases.

Placement: a bias is split like its weight's output columns, by whole heads: under tp the
Llama's table splits attn/q/weights (D, H Dh) along dim 1, so attn/q/bias (H Dh,) splits
along dim 0 on tp (the rank's query heads' entries); attn/k, v/bias follow their weights,
split when tp divides the kv heads, else replicated. Then fsdp's split (zero=3) along dim 0,
as for every parameter; pp puts them on their block's stage, cp replicates them.

Replicated kv biases are used by every tp rank for its own query heads only, like the
replicated kv weights: their gradients are summed over tp, the adjoint of the broadcast.
"""
from __future__ import annotations

from dataclasses import replace

from .units import BIASED


def tp_table(llama_table: dict) -> dict:
    """The Llama's {suffix: tp steps}, each bias split like its weight's columns (dim 1 ->
    dim 0; absent, replicated, when its weight is)."""
    return dict(llama_table, **{f"{p}/bias": tuple(replace(s, dim=0)
                                                   for s in llama_table[f"{p}/weights"])
                                for p in BIASED if f"{p}/weights" in llama_table})


def tp_replicated_params(llama_replicated: list) -> list:
    """The Llama's tp-replicated parameters (kv weights) and with them their biases."""
    return llama_replicated + [n[:-len("weights")] + "bias" for n in llama_replicated
                               if n.endswith(tuple(f"{p}/weights" for p in BIASED))]
