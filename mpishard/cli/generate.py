"""Sample text from a GPT checkpoint: `python -m mpishard generate`.

    python -m mpishard generate --checkpoint ckpt --prompt "def " --max-new-tokens 200 \\
        --temperature 0.8 --top-k 40 --seed 0
    mpiexec -n 2 python -m mpi4py -m mpishard generate --checkpoint ckpt --layout dp=2 ...

Every rank rebuilds the GPT from the checkpoint's index, makes the engine for `--layout` (any
layout whose engine has `predict`; default dp over all ranks, single on one) and loads its
shard. Tokens are bytes (vocab 256, train/text.py): the prompt is encoded as UTF-8, and each
new byte is drawn from the logits of the last position, the context cropped to the model's
last seq_len bytes.

With a KV cache (nn/kv_cache.py; the default where parallel.gpt.check_decode allows it: not
under cp or sequence_parallel) the prompt goes through the model once (prefill) and then each
new byte alone, attending to the cached keys and values of the earlier positions: each rank
caches its own heads under tp and its own blocks under pp (the byte goes down the stages).
When the cache is full (seq_len positions), the cropped window is recomputed: the cache is
reset and the last `refill` bytes prefilled (default seq_len: the same logits as recomputing
the whole cropped context every byte; smaller refills are cheaper, the model then sees a
shorter context right after each refill). `--no-kv-cache` (and cp, sequence_parallel)
recomputes the whole cropped context for every byte. Under data-parallel axes every
data-parallel rank is fed the same context row, so the logits are those of a one-row batch
on one device. `gather_batch` gives
every rank the same logits and every rank draws from its own generator seeded with --seed, so
all ranks pick the same byte without communicating; rank 0 prints the text as it comes
(decoded as UTF-8 with errors="replace").

--temperature 0 is greedy (argmax); --top-k K keeps the K largest logits (0: all).
"""
from __future__ import annotations

import codecs
import sys

import numpy as np

from ..nn.kv_cache import KVCache, caching
from ..parallel.gpt import check_decode
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
    p.add_argument("--no-kv-cache", action="store_true", help="recompute the whole context "
                   "for every byte instead of decoding with a KV cache")
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


def last_logits(engine, tokens: list, cache=None):
    """Collective: the float64 logits (V,) after `tokens`, on every rank. cache None: the
    tokens are the whole context (recomputed); a KVCache: they are the new positions after
    the cached ones, and are cached too."""
    row = np.asarray(tokens, dtype=np.int64)[None, :]
    x = engine.shard_batch(np.repeat(row, engine.data_parallel_size, axis=0))  # a row per dp rank
    if cache is None:
        y = engine.predict(x)
    else:
        with caching(engine.chunks, cache):
            y = engine.predict(x)
        cache.advance(len(tokens))
    y = None if y is None else engine.xp.ascontiguousarray(y[:, -1:])   # the last position
    return engine.backend.to_host(engine.gather_batch(y))[0, -1].astype(np.float64)


def generate_tokens(engine, prompt: list, n_new: int, *, temperature=1.0, top_k=0, seed=0,
                    on_token=None, kv_cache=True, refill=None) -> list:
    """Collective: `n_new` token ids continuing `prompt` (a list of ids), the same list on
    every rank; `on_token(id)` is called with each new id as it is drawn. kv_cache: decode
    with a KVCache where the layout allows it; refill: the tokens prefilled when it is full
    (default seq_len, see the module docstring)."""
    seq_len = engine.model.seq_len
    refill = seq_len if refill is None else int(refill)
    if not 1 <= refill <= seq_len:
        raise ValueError(f"refill={refill} must lie in [1, seq_len={seq_len}]")
    cache = KVCache(seq_len) if kv_cache and decode_supported(engine.layout) else None
    rng = np.random.default_rng(seed)
    tokens = list(prompt)
    pending = tokens[-seq_len:]                  # the prefill
    for _ in range(n_new):
        if cache is None:
            logits = last_logits(engine, tokens[-seq_len:])
        else:
            if cache.length + len(pending) > seq_len:     # full: recompute the cropped window
                cache.reset()
                pending = tokens[-refill:]
            logits = last_logits(engine, pending, cache)
        tokens.append(next_token(logits, rng, temperature, top_k))
        pending = tokens[-1:]
        if on_token is not None:
            on_token(tokens[-1])
    return tokens[len(prompt):]


def decode_supported(layout) -> bool:
    """Whether the GPT units of `layout` decode with a KV cache (parallel.gpt.check_decode)."""
    try:
        check_decode(layout)
    except ValueError:
        return False
    return True


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
                    top_k=args.top_k, seed=args.seed, on_token=show,
                    kv_cache=not args.no_kv_cache)
    if printing:
        sys.stdout.write(decoder.decode(b"", final=True) + "\n")
        sys.stdout.flush()
    return 0
