"""`import`: a Hugging Face directory (an architecture hf.ARCHITECTURES names) into a checkpoint.

    mpiexec -n 4 python -m mpi4py -m mpishard import --hf ./gpt2 --checkpoint gpt2-ckpt
    python -m mpishard import --hf ./SmolLM2-135M --checkpoint smol --layout single

Every rank reads config.json (ms.hf.read_model), builds the engine for `--layout` (default
fsdp over all ranks, so each rank holds and reads a quarter of a 4-way model) and fills it
with ms.hf.load_into, reading only its slices; then the collective ms.checkpoint.save writes
the checkpoint, which any layout and world size can load (train --resume, generate, infer).
The checkpoint's dtype is the file's when float64, else float32 (exact for bfloat16 and
float16). Its `extra["hf"]` keeps the source config.json and dtype, so `export` writes the
same config fields (token ids, dropout) in the same dtype; it carries the directory's
tokenizer.json and companions (extra["tokenizer"]), which generate and export use.
"""
from __future__ import annotations

import os

import numpy as np

from .. import hf
from ..checkpoint import save as save_checkpoint
from ..engine import make_engine
from ..train.tokenizer import TOKENIZER_JSON
from .model_flag import HF_NAMES
from .token_options import load_tokenizer
from .usage import UsageError, agreed, checked_layout, print_report, world_comm


def add_import_arguments(p):
    p.add_argument("--hf", metavar="DIR", required=True, help="a Hugging Face model "
                   f"directory (config.json + safetensors): {HF_NAMES}")
    p.add_argument("--checkpoint", metavar="DIR", required=True, help="the checkpoint to write")
    p.add_argument("--layout", help="the mesh to load through (default fsdp over all ranks, "
                   "single on one): each rank reads only its blocks")
    return p


def read_hf_model(path):
    """ms.hf.read_model(path), its errors as a UsageError naming --hf."""
    try:
        return hf.read_model(path)
    except (OSError, ValueError) as exc:
        raise UsageError(f"--hf {path}: {exc}") from None


def carried_tokenizer(path) -> tuple:
    """(extra, assets) of the checkpoint for directory `path`'s tokenizer, if it has one."""
    if not os.path.isfile(os.path.join(path, TOKENIZER_JSON)):
        return {}, {}
    record, files = load_tokenizer(path, "--hf").carried()
    return {"tokenizer": record}, files


def build_importer(args, comm):
    """The engine on --layout, filled from --hf: the same UsageError on every rank for a bad
    layout, or a directory any rank cannot read (agreed before the engine's collectives, so
    no rank waits in make_engine for one that raised); load_into agrees on its own errors."""
    size = comm.Get_size()
    layout = checked_layout(args.layout or (f"fsdp={size}" if size > 1 else "single"), size)
    model, carried = agreed(comm, lambda: (read_hf_model(args.hf),   # before make_engine's
                                           carried_tokenizer(args.hf)))  # collectives
    wide = hf.source(model)["dtype"] == "float64"
    engine = make_engine(model, layout, dtype=np.float64 if wide else np.float32, comm=comm)
    hf.load_into(engine, args.hf)
    return engine, carried


def run_import(args) -> int:
    comm = world_comm()
    engine, (extra, assets) = agreed(comm, lambda: build_importer(args, comm))
    path = save_checkpoint(args.checkpoint, engine, extra={"hf": hf.source(engine.model),
                                                           **extra}, assets=assets)
    text = (f"imported {args.hf} ({engine.model!r}, {engine.model.num_params():,} parameters) "
            f"into {path} as {np.dtype(engine.dtype).name}")
    engine.close()
    return print_report(text)
