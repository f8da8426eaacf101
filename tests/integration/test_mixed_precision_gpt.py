"""Mixed precision on ms.GPT (parallel/precision.py): bfloat16 parameters and gradient traffic
with fp32 math and fp32 master weights, under dp=2 and fsdp=2.

- bytes per train_step halved, measured with engine.comm_bytes (all but the 8-byte float64
  loss all_reduce, which stays as it is);
- the integer token ids are never cast: the embedding gathers with int64 ids from a float32
  table (the casting access policy casts only parameters; LowPrecisionComm only float
  reductions);
- 30 AdamW steps on a learnable token pattern reach the float32 run's loss: the mean loss of
  the last 5 steps within 0.05 nats (measured 0.0047 under both layouts; 0.05 is 3% of the
  1.57-nat drop both runs make, 2.80 -> 1.23, so a bf16 run that stalled or diverged fails,
  one that merely rounds differently passes).

MPI tests: `mpiexec -n N python -m mpi4py -m pytest --with-mpi -m mpi
tests/integration/test_mixed_precision_gpt.py` for N in 1, 2, 4, 8 (2-rank groups side by side).
"""
import numpy as np
import pytest
from conftest import group_comm

import mpishard as ms
import mpishard.nn.functional as functional

CE = ms.losses.CrossEntropy()
F32 = np.dtype(np.float32)
MODEL = ms.GPT(vocab_size=16, seq_len=16, d_model=32, n_heads=2, n_layers=2)
LOSS_BYTES = 8                       # engine.global_mean: one float64 all_reduce, 2 ranks


def batch(step, rows=8):
    """Rows of (start + stride * i) mod 16: next-token prediction a small GPT can learn."""
    rng = np.random.default_rng(step)
    start, stride = rng.integers(0, 16, (rows, 1)), rng.integers(1, 4, (rows, 1))
    seq = (start + stride * np.arange(MODEL.seq_len + 1)) % MODEL.vocab_size
    return seq[:, :-1], seq[:, 1:]


def train(layout, comm, low, steps=30):
    """(bytes sent in the first train_step, the loss of every step) for `low` precision."""
    e = ms.make_engine(MODEL, layout, dtype=np.float32, comm=comm, param_dtype=low,
                       comm_dtype=low)
    e.load_checkpoint(MODEL.init(seed=0))
    opt, losses, sent = ms.optim.AdamW(e, lr=1e-2), [], None
    for step in range(steps):
        x, t = batch(step)
        e.reset_comm_stats()
        loss, _ = e.train_step(e.shard_batch(x), e.shard_batch(t), CE)
        sent = sent if sent is not None else float(sum(e.comm_bytes.values()))
        opt.step()
        losses.append(loss)
    return sent, losses


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("layout", ["dp=2", "fsdp=2"])
def test_gpt_bfloat16_halves_bytes_and_follows_float32(layout, monkeypatch):
    comm = group_comm(2)
    seen = []
    gather = functional.embedding_forward

    def spy(table, ids):
        seen.append((table.dtype, ids.dtype))
        return gather(table, ids)
    monkeypatch.setattr(functional, "embedding_forward", spy)
    runs = {low or "float32": train(layout, comm, low) for low in (None, "bfloat16")}
    (b32, l32), (b16, l16) = runs["float32"], runs["bfloat16"]
    tail32, tail16 = float(np.mean(l32[-5:])), float(np.mean(l16[-5:]))
    print(f"GPT {layout}: bytes per train_step float32 {b32:g}, bfloat16 {b16:g} (loss "
          f"all_reduce {LOSS_BYTES} in each); loss {l32[0]:.4f} -> last-5 mean float32 "
          f"{tail32:.4f}, bfloat16 {tail16:.4f} (|diff| {abs(tail16 - tail32):.4f}, tol 0.05)")
    assert b16 - LOSS_BYTES == (b32 - LOSS_BYTES) / 2
    assert l32[0] - tail32 > 1.0 and abs(tail16 - tail32) <= 0.05
    assert seen and all(ids == np.int64 and table == F32 for table, ids in seen), set(seen)
