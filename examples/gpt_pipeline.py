"""A tiny GPT in pipeline stages (1F1B and GPipe), each schedule against single.

    mpiexec -n 2 python -m mpi4py examples/gpt_pipeline.py
    mpiexec -n 4 python -m mpi4py examples/gpt_pipeline.py

The layouts are `pp=N,microbatches=4,schedule=1f1b` and the same with `schedule=gpipe`, N the
world size (at most the 4 blocks). The pipeline's layers are the GPT's blocks, balanced over
the stages; the embedding (tokens and positions) lives on the first stage, ln_f and the head
on the last. The 8 rows of a step are cut into 4 microbatches; the (B, T, D) activations go
down the stages with send/receive and their gradients come back up. GPipe runs every forward
before any backward, so each stage stashes the activations of all 4 microbatches; 1F1B starts
the backward of a microbatch as soon as the last stage has its loss, so stage s stashes at
most N - s. (A tied head is refused under pp: the embedding and the head live on different
stages.)

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

SEQ, D_MODEL, HEADS, LAYERS, ROWS, STEPS, LR, RTOL = 16, 32, 4, 4, 8, 3, 1e-2, 1e-9
MICROBATCHES = 4


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
        say(f"{layout:<34} step {step}  loss {loss:.10f}  single {want:.10f}")
    logits = engine.gather_batch(engine.predict(x_local))
    worst = max(worst, relative(logits, single.predict(x)))
    full = engine.gather_params()
    worst = max([worst] + [relative(full[k], single.params[k]) for k in single.params])
    return engine, worst, calls, activations


def main():
    comm = MPI.COMM_WORLD
    n = comm.Get_size()
    say = print if comm.Get_rank() == 0 else (lambda *a, **k: None)
    model = ms.GPT(vocab_size=256, seq_len=SEQ, d_model=D_MODEL, n_heads=HEADS,
                   n_layers=LAYERS)
    params = model.init(seed=0)
    x, t = text_batch(ROWS, SEQ)
    say(f"GPT pipeline pp={n}, 1F1B and GPipe over {MICROBATCHES} microbatches: {model!r}, "
        f"batch {x.shape}")

    worst, ok = {}, True
    for schedule in ("1f1b", "gpipe"):
        layout = f"pp={n},microbatches={MICROBATCHES},schedule={schedule}"
        engine, worst[layout], calls, activations = check(model, params, layout, x, t, say)
        ok &= worst[layout] <= RTOL
        stages = comm.gather((holds(engine.local_names), engine.stats["peak_stashed"],
                              activations), root=0)    # control data (pickle)
        say(f"{layout}: collectives per train_step "
            f"{', '.join(f'{k} {v}' for k, v in sorted(calls.items()))}")
        for stage, (names, stashed, act) in enumerate(stages or []):
            say(f"  stage {stage}: {names}; stashed at most {stashed} microbatch(es), "
                f"{act:,} bytes of activations")
    for layout, w in worst.items():
        say(f"{layout}: max relative difference from single {w:.2e}")
    ok = comm.allreduce(bool(ok), op=MPI.LAND)
    say(f"max relative difference from single device: {max(worst.values()):.2e} "
        f"({'OK' if ok else 'FAIL'}, tolerance {RTOL:g})")
    return 0 if ok else 1


def holds(names):
    """'embed, block_0, block_1' from a stage's parameter names, in model order."""
    parts = []
    for name in names:
        part = name.split("/")[0]
        if part not in parts:
            parts.append(part)
    order = ["embed"] + [f"block_{i}" for i in range(LAYERS)] + ["ln_f", "head"]
    return ", ".join(sorted(parts, key=order.index))


if __name__ == "__main__":
    sys.exit(main())
