"""A tiny GPT under Megatron tensor parallelism, without and with sequence parallelism.

    mpiexec -n 2 python -m mpi4py examples/gpt_tensor_sequence_parallel.py
    mpiexec -n 4 python -m mpi4py examples/gpt_tensor_sequence_parallel.py

The layouts are `tp=N` and `tp=N,sequence_parallel=1` with N the world size (N must divide
the 4 heads, the vocabulary of 256 bytes and the 16 positions). Under `tp` each rank holds
whole heads: the qkv weights (D, 3D/N) column-parallel, the attention projection (D/N, D)
row-parallel, the MLP's fc (D, F/N) and proj (F/N, D) likewise, the embedding and the head
split over the vocabulary (the full (B, T, V) logits never exist on one rank in training).
Each column/row pair costs one all-reduce forward and one backward. With
`sequence_parallel=1` the LayerNorm and residual regions are split along the sequence over
the same ranks: an all-gather before each column layer and a reduce-scatter after each row
layer replace the all-reduce (the adjoint of an all-gather is a reduce-scatter), so the
LayerNorm/residual activations a rank keeps shrink by N.

The model trains with AdamW for a few steps on windows of this file's own text; the same
steps run on `ms.SingleDevice`. The script exits non-zero if, at any step, the loss or any
gathered gradient, or at the end the gathered logits or parameters, differ from single's by
more than 1e-9 relative (float64). Rank 0 alone prints.
"""
import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

import mpishard as ms

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
    say(f"GPT tensor parallel tp={n}, without and with sequence_parallel=1: {model!r}, "
        f"batch {x.shape}")
    single = ms.SingleDevice(model)
    single.load_checkpoint(params)
    single.train_step(x, t, ms.losses.CrossEntropy())
    single_activations = single.memory_report()["activations_peak"]

    worst, ok = {}, True
    for layout in (f"tp={n}", f"tp={n},sequence_parallel=1"):
        engine, worst[layout], calls, activations = check(model, params, layout, x, t, say)
        ok &= worst[layout] <= RTOL
        shapes = {k: tuple(engine.params[k].shape) for k in
                  ("block_0/attn/qkv/weights", "block_0/attn/proj/weights", "head/weights")}
        say(f"{layout}: rank 0 holds {shapes}")
        say(f"{layout}: collectives per train_step "
            f"{', '.join(f'{k} {v}' for k, v in sorted(calls.items()))}; activations kept "
            f"{activations:,} bytes per rank (single {single_activations:,})")
    for layout, w in worst.items():
        say(f"{layout}: max relative difference from single {w:.2e}")
    ok = MPI.COMM_WORLD.allreduce(bool(ok), op=MPI.LAND)
    say(f"max relative difference from single device: {max(worst.values()):.2e} "
        f"({'OK' if ok else 'FAIL'}, tolerance {RTOL:g})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
