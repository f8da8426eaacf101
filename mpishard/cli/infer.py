"""Batch inference from a checkpoint: `python -m mpishard infer`, and `infer_rows` under it.

    mpiexec -n 4 python -m mpi4py -m mpishard infer --checkpoint ckpt --layout dp=2,pp=2 \\
        --input x.npy --output y.npy --batch 256

Every rank rebuilds the model from the checkpoint's index (`Checkpoint.model()`), makes the
engine for `--layout` and calls `engine.load_checkpoint(ms.checkpoint.load(DIR))`: reshard on
load, each rank reads only the blocks it keeps (any layout, whatever the saving layout was).
The input `.npy` is memory-mapped (allow_pickle=False): for an MLP (rows, d_in) numbers, for a
GPT (rows, T) integer token ids with T <= seq_len, whose output is the logits (rows, T, vocab)
at every position (to sample text use `generate`). Its rows go in batches of `--batch` through
`engine.inference_loop(input_stream, output_stream)`:

  - Data axes (dp, fsdp, ep): every batch is split by `engine.shard_batch`, so each replica
    computes 1/dp of every batch (fsdp ranks must run the same batches in lock-step anyway).
    `--batch` must divide by the data-parallel size; a short last batch is padded with zero
    rows up to a multiple of it and the padded rows' outputs are dropped.
  - pp > 1: the pipeline's streaming loop (mpishard/parallel/pipeline.py): stage 0 reads the
    batches, stage k works on batch i while stage k-1 works on batch i+1, and an end-of-stream
    message shuts the stages down; the outputs appear on the last stage. pp = 1: `predict`
    per batch.
  - Then the outputs are collected one batch at a time with `engine.gather_batch` (broadcast
    from the last stage over pp, all-gather over the data axes) and rank 0 writes them into
    the output `.npy` (memory-mapped, a plain .npy without pickle, written under a temporary
    name and renamed once complete) and prints one line: rows, batches, rows/s.

Raw input: a model trained on standardised features (`--dataset digits`) carries the training
split's mean and std (extra["standardize"], two .npy files beside its blocks, train/data.py);
infer applies (x - mean) / std to each batch, as training did, and says so in its line
(`--no-standardize` for input already standardised).

Memory: a rank touches only its rows of the input; a last-stage rank keeps its share of the
outputs (rows / dp x d_out) until the stream ends. Bad input (no checkpoint, an input of the
wrong width, a batch the data axes do not divide, ...) is found inside `agreed` before any
collective: one `mpishard: error:` line and exit code 2 on every rank.
"""
from __future__ import annotations

import os
import time

import numpy as np

from ..checkpoint import CheckpointError
from ..checkpoint import load as load_checkpoint
from ..checkpoint.format import read_asset_array
from ..engine import make_engine
from ..train.data import standardized
from .device_options import add_device_arguments, engine_options
from .usage import (UsageError, agreed, check_flags, checked_layout, default_layout,
                    world_comm)

DEFAULT_BATCH = 256


def add_checkpoint_arguments(p, what="checkpoint directory"):
    """--checkpoint DIR and --layout on parser `p` (infer and generate)."""
    p.add_argument("--checkpoint", required=True, metavar="DIR",
                   help=f"{what} (saved under any layout and world size)")
    p.add_argument("--layout", help="mesh layout, e.g. dp=2 or pp=2 (default: dp over all "
                   "ranks, single on one)")


def add_compute_arguments(p):
    """--dtype (default: the checkpoint's) and the device flags (device_options.py) on `p`."""
    p.add_argument("--dtype", choices=("float32", "float64"),
                   help="compute dtype (default: the checkpoint's)")
    add_device_arguments(p.add_argument)


def add_infer_arguments(p):
    add_checkpoint_arguments(p)
    p.add_argument("--input", required=True, metavar="X.npy",
                   help="2-D array, read memory-mapped: (rows, model input width), or for a GPT "
                   "(rows, T) token ids, T <= seq_len")
    p.add_argument("--output", required=True, metavar="Y.npy",
                   help="written by rank 0: (rows, model output width), or for a GPT the logits "
                   "(rows, T, vocab); `generate` samples text from a GPT")
    p.add_argument("--batch", type=int, default=DEFAULT_BATCH,
                   help=f"rows per batch (default {DEFAULT_BATCH}); must divide by the "
                   "data-parallel size")
    p.add_argument("--no-standardize", action="store_true", help="feed the input as it is, "
                   "when it is already standardised (default: a checkpoint trained on "
                   "standardised features, digits, standardises the raw input as training did)")
    add_compute_arguments(p)
    return p


# -- the stream (collective) -------------------------------------------------------------------
class _Held:
    """output_stream for inference_loop: this rank's output block of every batch, in order."""

    def __init__(self):
        self.blocks = []

    def write(self, y):
        self.blocks.append(y)


def batch_spans(rows: int, batch: int) -> list:
    """[(start, stop), ...] of consecutive batches covering `rows` (the last may be short)."""
    return [(i, min(i + batch, rows)) for i in range(0, rows, batch)]


def infer_rows(engine, x, batch: int, out=None, standardize=None) -> int:
    """Collective: run every row of `x` (host array or memmap, (rows, d_in)) through `engine`
    in batches of `batch` rows; where `out` is given (rank 0 in the CLI) write the outputs into
    it. standardize: None or (mean, std), applied to each batch of raw features first. Every
    rank passes the same x and batch. Returns the number of batches."""
    dp = engine.data_parallel_size
    spans = batch_spans(int(x.shape[0]), batch)
    tokens = engine.model.takes_tokens            # token ids stay integers

    def batches():                 # read by stage 0 only under pp; by every rank otherwise
        for start, stop in spans:
            rows = x[start:stop]
            if standardize is not None:
                rows = standardized(rows, *standardize)
            short = -len(rows) % dp              # only the last batch can be short
            if short:
                rows = np.concatenate([rows, np.zeros((short,) + rows.shape[1:], rows.dtype)])
            rows = engine.shard_batch(rows)
            yield rows if tokens else rows.astype(engine.dtype, copy=False)

    held = _Held()
    engine.inference_loop(batches(), held)
    last_stage = engine.stage == engine.layout.size("pp") - 1
    assert not last_stage or len(held.blocks) == len(spans), "one output per batch"
    for b, (start, stop) in enumerate(spans):
        y = engine.gather_batch(held.blocks[b] if last_stage else None)   # every rank
        if out is not None:
            out[start:stop] = engine.backend.to_host(y)[:stop - start]
    return len(spans)


# -- the command: validate and build inside agreed, then stream --------------------------------
def _open_input(path, model):
    try:
        x = np.load(path, mmap_mode="r", allow_pickle=False)
    except FileNotFoundError:
        raise UsageError(f"--input {path}: no such file") from None
    except (OSError, ValueError) as exc:
        raise UsageError(f"--input {path}: not a readable .npy array without pickle: {exc}"
                         ) from None
    if not isinstance(x, np.ndarray):            # an .npz archive
        x.close()
        raise UsageError(f"--input {path}: an .npz archive; give one .npy array")
    if x.shape[:1] == (0,):
        raise UsageError(f"--input {path}: no rows")
    if model.takes_tokens:
        return _check_tokens(path, x, model)
    if x.ndim != 2 or x.shape[1] != model.d_in:
        raise UsageError(f"--input {path}: shape {x.shape}, the model takes (rows, "
                         f"{model.d_in})")
    if x.dtype.kind not in "fiu":
        raise UsageError(f"--input {path}: dtype {x.dtype} is not a real number type")
    return x


def _check_tokens(path, x, model):
    """A decoder's input: (rows, T) integer token ids below vocab_size, 1 <= T <= seq_len."""
    if x.ndim != 2 or not 1 <= x.shape[1] <= model.seq_len:
        raise UsageError(f"--input {path}: shape {x.shape}; a GPT takes token ids (rows, T) "
                         f"with T <= seq_len={model.seq_len}")
    if x.dtype.kind not in "iu":
        raise UsageError(f"--input {path}: dtype {x.dtype}; a GPT takes integer token ids")
    low, high = int(x.min()), int(x.max())
    if low < 0 or high >= model.vocab_size:
        raise UsageError(f"--input {path}: token ids {low}..{high} outside the vocabulary "
                         f"0..{model.vocab_size - 1}")
    return x


def output_shape(model, x) -> tuple:
    """The shape of the outputs of every row of `x`: (rows, d_out), a decoder's (rows, T,
    vocab)."""
    return tuple(int(n) for n in model.output_shape(x.shape))


def _check_output(path, input_path):
    """--output names a new or replaceable file in a writable directory, not the input."""
    out = os.path.abspath(path)
    if not os.path.isdir(os.path.dirname(out)):
        raise UsageError(f"--output {path}: directory {os.path.dirname(out)} does not exist")
    if not os.access(os.path.dirname(out), os.W_OK):
        raise UsageError(f"--output {path}: directory {os.path.dirname(out)} is not writable")
    if os.path.isdir(out):                # found only at the final rename otherwise
        raise UsageError(f"--output {path} is a directory; give a file name")
    if os.path.exists(out) and os.path.samefile(out, input_path):
        raise UsageError(f"--output {path} is the input file")


def build_inference(args, comm):
    """Validate (the same on every rank), open the checkpoint and the input, make the engine
    and load it. Returns (engine, x). Raises UsageError/ValueError/TypeError; the only
    communication is inside make_engine, after every check that can fail on a rank alone."""
    size = comm.Get_size()
    layout = checked_layout(args.layout or default_layout(size), size)
    check_flags(args, ("batch",), low=0, low_open=True)
    dp = layout.data_parallel_size
    if args.batch % dp:
        raise UsageError(f"--batch {args.batch} must divide by the {dp} data-parallel ranks "
                         f"of layout {layout.text!r}")
    ckpt, model = open_checkpoint(args.checkpoint)
    if model.takes_tokens and layout.size("cp") > 1:
        raise UsageError(f"infer: layout {layout.text!r} splits the sequence (cp); a GPT's "
                         f"logits are gathered over the data axes only: leave cp out")
    x = _open_input(args.input, model)
    _check_output(args.output, args.input)
    scale = None if args.no_standardize else standardization(ckpt, model)
    return checkpoint_engine(ckpt, model, layout, args, comm), x, scale


def standardization(ckpt, model):
    """(mean, std) the checkpoint's model was trained with (extra["standardize"]), or None;
    UsageError for a missing or corrupt file or arrays that do not fit the model's input."""
    files = (ckpt.extra or {}).get("standardize")
    if files is None:
        return None
    try:
        mean, std = (read_asset_array(ckpt, files[k]) for k in ("mean", "std"))
    except (CheckpointError, KeyError, TypeError) as exc:
        raise UsageError(f"--checkpoint {ckpt.path}: its standardisation {files!r}: {exc}"
                         ) from None
    d_in = None if model.takes_tokens else model.d_in
    if any(a.shape != (d_in,) or a.dtype.kind != "f" for a in (mean, std)) or (std <= 0).any():
        raise UsageError(f"--checkpoint {ckpt.path}: its standardisation has mean "
                         f"{mean.shape} {mean.dtype} and std {std.shape} {std.dtype}; the model "
                         f"takes {d_in} features and needs std > 0")
    return mean, std


def open_checkpoint(path):
    """(Checkpoint, model spec) of --checkpoint PATH; UsageError when it is missing, corrupt
    or its model cannot be rebuilt."""
    try:
        ckpt = load_checkpoint(path)
    except CheckpointError as exc:
        raise UsageError(f"--checkpoint: {exc}") from None
    model = ckpt.model()
    if model is None:
        raise UsageError(f"--checkpoint {path}: cannot rebuild the model from its index "
                         f"({ckpt.model_spec})")
    return ckpt, model


def checkpoint_engine(ckpt, model, layout, args, comm):
    """The engine of `model` on `layout` (args.dtype, default the checkpoint's; the device
    flags: device_options.py), loaded with this rank's shard of `ckpt` (local reads)."""
    dtype = np.dtype(args.dtype or next(iter(ckpt.values())).dtype)
    engine = make_engine(model, layout, dtype=dtype, comm=comm, **engine_options(args, dtype))
    engine.load_checkpoint(ckpt)         # local reads (a corrupt block raises here)
    return engine


def run_infer(args) -> int:
    comm = world_comm()
    engine, x, scale = agreed(comm, lambda: build_inference(args, comm))
    rows, path = int(x.shape[0]), os.path.abspath(args.output)
    out = tmp = None
    if comm.Get_rank() == 0:
        tmp = f"{path}.tmp-{os.getpid()}"
        out = np.lib.format.open_memmap(tmp, mode="w+", dtype=engine.dtype,
                                        shape=output_shape(engine.model, x))
    t0 = time.perf_counter()
    n_batches = infer_rows(engine, x, args.batch, out, scale)
    if out is not None:
        out.flush()
        del out
        os.replace(tmp, path)
        seconds = time.perf_counter() - t0
        print(f"infer: {rows} rows in {n_batches} batches of {args.batch} on layout "
              f"{engine.layout.text!r} on {comm.Get_size()} rank(s): {rows / seconds:.0f} rows/s "
              f"-> {args.output}" + ("" if scale is None else "; the input standardised "
                                     "with the training split's mean and std"), flush=True)
    return 0
