"""Sample text from a GPT checkpoint: `python -m mpishard generate`.

    python -m mpishard generate --checkpoint ckpt --prompt "def " --max-new-tokens 200 \\
        --temperature 0.8 --top-k 40 --seed 0
    mpiexec -n 2 python -m mpi4py -m mpishard generate --checkpoint ckpt --layout dp=2 ...

Every rank rebuilds the GPT from the checkpoint's index, makes the engine for `--layout` (any
layout whose engine has `predict`; default dp over all ranks, single on one) and loads its
shard. Tokens are bytes (vocab 256, train/text.py): the prompt is encoded as UTF-8, and each
new byte is drawn from the logits of the last position of `gather_batch(predict(context))`,
the context cropped to the model's last seq_len bytes (no KV cache: the whole context is
recomputed for every byte). Under data-parallel axes every data-parallel rank is fed the same
context row, so the logits are those of a one-row batch on one device. `gather_batch` gives
every rank the same logits and every rank draws from its own generator seeded with --seed, so
all ranks pick the same byte without communicating; rank 0 prints the text as it comes
(decoded as UTF-8 with errors="replace").

--temperature 0 is greedy (argmax); --top-k K keeps the K largest logits (0: all).
"""
from __future__ import annotations

import codecs
import sys

import numpy as np

from ..validate import check_number
from .infer import (add_checkpoint_arguments, add_compute_arguments, checkpoint_engine,
                    open_checkpoint)
from .usage import (UsageError, agreed, check_flags, checked_layout, default_layout,
                    world_comm)

DEFAULT_NEW_TOKENS = 200


def add_generate_arguments(p):
    add_checkpoint_arguments(p, "a GPT checkpoint directory, e.g. from train --model gpt")
    p.add_argument("--prompt", default="\n", help="the text to continue (UTF-8; default a "
                   "newline)")
    p.add_argument("--max-new-tokens", "--tokens", dest="max_new_tokens", type=int,
                   default=DEFAULT_NEW_TOKENS, metavar="N",
                   help=f"bytes to generate (default {DEFAULT_NEW_TOKENS})")
    p.add_argument("--temperature", type=float, default=1.0,
                   help="divide the logits by this (default 1; 0: greedy)")
    p.add_argument("--top-k", type=int, default=0, metavar="K",
                   help="sample among the K most likely bytes (default 0: all)")
    p.add_argument("--seed", type=int, default=0, help="the sampling generator's seed (0)")
    add_compute_arguments(p)
    return p


# -- sampling (the same on every rank) ----------------------------------------------------------
def next_token(logits, rng, temperature: float, top_k: int) -> int:
    """One token id from the float64 logits (V,) of the last position."""
    if temperature == 0.0:
        return int(np.argmax(logits))
    z = logits / temperature
    if 0 < top_k < z.shape[0]:
        kth = np.partition(z, -top_k)[-top_k]
        z = np.where(z < kth, -np.inf, z)
    p = np.exp(z - z.max())
    return int(rng.choice(z.shape[0], p=p / p.sum()))


def generate_tokens(engine, prompt: list, n_new: int, *, temperature=1.0, top_k=0, seed=0,
                    on_token=None) -> list:
    """Collective: `n_new` token ids continuing `prompt` (a list of ids), the same list on
    every rank; `on_token(id)` is called with each new id as it is drawn."""
    seq_len, rows = engine.model.seq_len, engine.data_parallel_size
    rng = np.random.default_rng(seed)
    tokens = list(prompt)
    for _ in range(n_new):
        context = np.asarray(tokens[-seq_len:], dtype=np.int64)[None, :]
        x = engine.shard_batch(np.repeat(context, rows, axis=0))   # one row per dp rank
        logits = engine.backend.to_host(engine.gather_batch(engine.predict(x)))
        tokens.append(next_token(logits[0, -1].astype(np.float64), rng, temperature, top_k))
        if on_token is not None:
            on_token(tokens[-1])
    return tokens[len(prompt):]


# -- the command --------------------------------------------------------------------------------
def build_generator(args, comm):
    """Validate (the same on every rank), open the checkpoint, make the engine and load it;
    returns (engine, prompt token ids). UsageError/ValueError/TypeError before any collective
    except those inside make_engine."""
    size = comm.Get_size()
    layout = checked_layout(args.layout or default_layout(size), size)
    check_flags(args, ("max_new_tokens", "top_k", "seed"), low=0)
    check_number("--temperature", args.temperature, low=0, error=UsageError)
    prompt = list(args.prompt.encode("utf-8"))
    if not prompt:
        raise UsageError("--prompt is empty; give at least one character")
    ckpt, model = open_checkpoint(args.checkpoint)
    if getattr(model, "kind", None) != "gpt":
        raise UsageError(f"--checkpoint {args.checkpoint} holds {ckpt.model_spec.get('class')}, "
                         f"not a GPT; generate samples from GPT checkpoints")
    if args.top_k > model.vocab_size:
        raise UsageError(f"--top-k {args.top_k} exceeds the vocabulary of {model.vocab_size}")
    return checkpoint_engine(ckpt, model, layout, args, comm), prompt


def run_generate(args) -> int:
    comm = world_comm()
    engine, prompt = agreed(comm, lambda: build_generator(args, comm))
    printing = comm.Get_rank() == 0
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def show(token):
        if printing:
            sys.stdout.write(decoder.decode(bytes([token])))
            sys.stdout.flush()

    if printing:
        sys.stdout.write(args.prompt)
    generate_tokens(engine, prompt, args.max_new_tokens, temperature=args.temperature,
                    top_k=args.top_k, seed=args.seed, on_token=show)
    if printing:
        sys.stdout.write(decoder.decode(b"", final=True) + "\n")
        sys.stdout.flush()
    return 0
