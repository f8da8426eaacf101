"""A tiny GPT under context parallelism: ring attention and Ulysses, each against single.

    mpiexec -n 2 python -m mpi4py examples/gpt_context_parallel.py
    mpiexec -n 4 python -m mpi4py examples/gpt_context_parallel.py

The layouts are `cp=N` (ring, the default `cp_kind`) and `cp=N,cp_kind=ulysses` with N the
world size (the 16 positions must split into 2N chunks; Ulysses also needs N to divide the 4
heads). `shard_batch` cuts the sequence, not the rows: with the sequence in 2N chunks, rank r
holds chunks r and 2N-1-r, so every rank has the same share of the causal mask's work.

- Ring: the keys and values of each rank's chunks travel around the cp ring over
  send/receive (the next block is sent while the current one is computed); each query chunk
  merges the blocks it may see with an online softmax (running max and log-sum-exp), so no
  rank ever builds scores for the whole sequence: the largest block is (B, H, T/2N, T/2N).
  The backward goes around the ring again, carrying the key/value gradients home.
- Ulysses (DeepSpeed): an all_to_all turns the sequence-sharded q, k, v into head-sharded
  ones (H/N heads, the whole sequence), attention runs locally, and the inverse all_to_all
  goes back; the adjoint of each all_to_all is the other one.

Everything outside attention is per token, so it runs on the local chunks unchanged; the
weights are replicated and their gradients averaged over cp. The model trains with AdamW for
a few steps on windows of this file's own text; the same steps run on `ms.SingleDevice`. The
script exits non-zero if, at any step, the loss or any gathered gradient, or at the end the
gathered logits (`gather_batch` restores the sequence order) or parameters, differ from
single's by more than 1e-9 relative (float64). Rank 0 alone prints.
"""
import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

import mpishard as ms
from mpishard.parallel.context_parallel import RingAttention
from mpishard.parallel.sequence_split import chunk_ids

SEQ, D_MODEL, HEADS, LAYERS, ROWS, STEPS, LR, RTOL = 16, 32, 4, 2, 8, 3, 1e-2, 1e-9


def text_batch(rows, seq):
    """`rows` windows of seq + 1 bytes of this file: inputs and next-byte targets."""
    data = np.frombuffer(Path(__file__).read_bytes(), dtype=np.uint8).astype(np.int64)
    starts = np.random.default_rng(0).integers(0, len(data) - seq - 1, rows)
    windows = np.stack([data[s:s + seq + 1] for s in starts])
    return windows[:, :-1], windows[:, 1:]


def relative(got, want):
    got, want = np.asarray(got), np.asarray(want)
    return float(np.abs(got - want).max()) / max(float(np.abs(want).max()), 1e-300)


def check(model, params, layout, x, t, say):
    """Train `layout` and single side by side; the worst relative difference and what the
    last step communicated and stashed."""
    ce = ms.losses.CrossEntropy()
    engine = ms.make_engine(model, layout, dtype=np.float64)
    engine.load_checkpoint(params)                 # every rank keeps only its shards
    single = ms.SingleDevice(model)
    single.load_checkpoint(params)
    opt, ref_opt = ms.optim.AdamW(engine, lr=LR), ms.optim.AdamW(single, lr=LR)
    x_local, t_local = engine.shard_batch(x), engine.shard_batch(t)
    worst = 0.0
    for step in range(STEPS):
        engine.reset_comm_stats()                  # keep the last step's counts
        loss, grads = engine.train_step(x_local, t_local, ce)
        calls = dict(engine.comm_calls)            # before gather_grads adds its own
        activations = engine.memory_report()["activations_peak"]
        want, ref_grads = single.train_step(x, t, ce)
        full = engine.gather_grads(grads)
        worst = max([worst, abs(loss - want) / abs(want)] +
                    [relative(full[k], ref_grads[k]) for k in ref_grads])
        opt.step(grads)
        ref_opt.step(ref_grads)
        say(f"{layout:<26} step {step}  loss {loss:.10f}  single {want:.10f}")
    logits = engine.gather_batch(engine.predict(x_local))
    worst = max(worst, relative(logits, single.predict(x)))
    full = engine.gather_params()
    worst = max([worst] + [relative(full[k], single.params[k]) for k in single.params])
    return engine, worst, calls, activations


def main():
    n = MPI.COMM_WORLD.Get_size()
    say = print if MPI.COMM_WORLD.Get_rank() == 0 else (lambda *a, **k: None)
    model = ms.GPT(vocab_size=256, seq_len=SEQ, d_model=D_MODEL, n_heads=HEADS,
                   n_layers=LAYERS)
    params = model.init(seed=0)
    x, t = text_batch(ROWS, SEQ)
    say(f"GPT context parallel cp={n}, ring and Ulysses: {model!r}, batch {x.shape}")
    say(f"cp={n}: the sequence in {2 * n} chunks of {SEQ // (2 * n)} positions; rank 0 holds "
        f"chunks {chunk_ids(0, n)}, rank {n - 1} chunks {chunk_ids(n - 1, n)}")

    worst, ok = {}, True
    for layout in (f"cp={n}", f"cp={n},cp_kind=ulysses"):
        engine, worst[layout], calls, activations = check(model, params, layout, x, t, say)
        ok &= worst[layout] <= RTOL
        say(f"{layout}: rank 0 is fed {engine.shard_batch(x).shape} tokens; collectives per "
            f"train_step {', '.join(f'{k} {v}' for k, v in sorted(calls.items()))}")
        rings = [u for layer in engine.layers for u in walk(layer)
                 if isinstance(u, RingAttention)]
        if rings:
            peak, full = max(u.peak_scores for u in rings), ROWS * HEADS * SEQ * SEQ
            say(f"{layout}: largest attention-score block {peak:,} elements per rank, "
                f"single's (B, H, T, T) {full:,} (1/{full // peak})")
    for layout, w in worst.items():
        say(f"{layout}: max relative difference from single {w:.2e}")
    ok = MPI.COMM_WORLD.allreduce(bool(ok), op=MPI.LAND)
    say(f"max relative difference from single device: {max(worst.values()):.2e} "
        f"({'OK' if ok else 'FAIL'}, tolerance {RTOL:g})")
    return 0 if ok else 1


def walk(layer):
    """A layer and the units inside it, depth first."""
    yield layer
    for unit in getattr(layer, "units", ()):
        yield from walk(unit)


if __name__ == "__main__":
    sys.exit(main())
