"""A GPT on the mesh: where its parameters live and which units this rank runs.

Everything a decoder shares is parallel/decoder.py's (pipeline stages of blocks, the
embedding with block 0 and ln_f + head with the last, fsdp, tied copies under pp, cp's
attention and token positions); the GPT brings its tp table and units builder
(tensor_parallel.py). Not yet: ep raises a ValueError.
"""
from __future__ import annotations

from ...parallel.compose import RankUnits, layer_stages
from ...parallel.decoder import build_decoder, check_decoder_layout, plan_decoder_params
from .tensor_parallel import gpt_tp_shards, gpt_units_and_output


def plan_params(model, layout) -> dict:
    """name -> ParamInfo(full_shape, Placement) for every GPT parameter; ValueError (the same
    on every rank) for a layout it cannot run."""
    vstages = layer_stages(model, layout)
    check_decoder_layout(model, layout)
    return plan_decoder_params(model, layout, vstages, gpt_tp_shards)


def build(model, layout, comm, access, stats: dict) -> RankUnits:
    """This rank's chunks (one list per virtual stage) and the output seam (tp: vocab-parallel
    logits, loss and gather_batch); no auxiliary loss."""
    units, output = gpt_units_and_output(model, layout, comm)
    chunks, output = build_decoder(model, layout, comm, access, layer_stages(model, layout),
                                   units, output)
    return RankUnits(chunks, output)
