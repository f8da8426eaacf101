"""A Llama on the mesh: where its parameters live and which units this rank runs (no MPI).

Everything but the tp table is the GPT's (gpt.py): the blocks are the pipeline's layers
(stage balancing, `stages=`, interleaved and zero-bubble schedules), the embedding lives with
block 0 and rms_f + head with the last block (a tied Llama under pp: the GPT's tied copies,
tied.py), FSDP ZeRO-3 splits every parameter along dim 0, zero=1/2 and dp keep them
replicated, cp replicates them and the layout checks are check_gpt_layout's.

Tensor parallelism (tp, sequence_parallel) is llama_tensor_parallel.py: each parameter's tp
split (`llama_tp_shards`) comes first in its placement, then fsdp's.
"""
from __future__ import annotations

from ..nn.llama_layers import llama_units
from .gpt import plan_gpt_params
from .llama_tensor_parallel import LlamaTensorParallel, llama_tp_shards
from .vocab_parallel import ReplicatedOutput, VocabParallelOutput


def plan_llama_params(model, layout, vstages: list) -> dict:
    """name -> ParamInfo(full_shape, Placement) for every Llama parameter (the GPT's plan with
    the Llama's tp table)."""
    return plan_gpt_params(model, layout, vstages,
                           tp_shards=llama_tp_shards(model, layout.size("tp")))


def llama_units_and_output(model, layout, comm):
    """(units builder for gpt.gpt_chunks, the engine's output seam) for this layout; comm: the
    engine's Comm."""
    if layout.size("tp") == 1:
        return llama_units, ReplicatedOutput()
    tp, sp = comm.group("tp"), bool(layout.option("sequence_parallel", 0))
    return LlamaTensorParallel(tp, sp), VocabParallelOutput(tp, model.vocab_size, sp)
