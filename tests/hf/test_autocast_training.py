"""20 AdamW steps of a tiny GPT with compute_dtype="bfloat16" against the same GPT in torch
(same weights, same batches, torch.optim.AdamW with our defaults) under
torch.autocast("cpu", dtype=torch.bfloat16), and against our own float32 run.

Data: arithmetic sequences mod V (token i+1 = token i + 3), which the model learns (the loss
falls from 4.18 to about 1.8), so the gradients carry signal, not noise whose signs AdamW's
normalised first steps would amplify.

Tolerance. Per unit our bf16 results equal torch's but for rare one-ulp flips where the two
GEMMs' float32 sums straddle a bf16 rounding boundary (tests/hf/test_autocast_torch.py),
2^-8 of a gradient element. AdamW's update lr * m / sqrt(v) is scale-free, so a flip moves a
weight by about lr * 2^-8 = 4e-5 on its step; the loss moves by what those weights carry,
and the differences compound over the steps, chaotically: the same run with the xp softmax
instead of numba's (MPISHARD_CPU_FUSED=0) drifts 5.9e-4 instead of 9.8e-4. Rounding every
matmul (bf16 against float32) moves every element by up to 2^-9 of itself, every step. We
require the loss curves within LOSS_TOL = 2e-3 (relative, each step; observed 9.8e-4 at most,
2.2e-4 over the first 10 steps) of torch's, and the float32 run's curve further than that
from both somewhere (observed 1.4e-2 at most, 4.4e-3 at the last step; printed).
"""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from torch_autocast_gpt import gpt_loss, params_to_torch  # noqa: E402

import mpishard as ms  # noqa: E402

LOSS_TOL = 2e-3
STEPS, LR = 20, 1e-2
MODEL = dict(vocab_size=64, seq_len=16, d_model=32, n_heads=2, n_layers=2)   # Dh 16


def batches(n=STEPS, rows=4, seed=7):
    """(ids, targets) pairs of arithmetic sequences mod V with step 3, random starts."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        start = rng.integers(0, MODEL["vocab_size"], (rows, 1))
        ids = (start + 3 * np.arange(MODEL["seq_len"] + 1)[None]) % MODEL["vocab_size"]
        out.append((ids[:, :-1], ids[:, 1:]))
    return out


def ours(params, compute_dtype):
    g = ms.GPT(**MODEL)
    e = ms.make_engine(g, dtype=np.float32, compute_dtype=compute_dtype)
    e.load_checkpoint(params)
    opt = ms.optim.AdamW(e, lr=LR)
    losses = []
    for x, t in batches():
        loss, _ = e.train_step(x, t, ms.losses.CrossEntropy())
        opt.step()
        losses.append(loss)
    return np.array(losses)


def torch_autocast(params):
    p = params_to_torch(params)
    opt = torch.optim.AdamW(list(p.values()), lr=LR)      # betas, eps, decay: ours' defaults
    losses = []
    for x, t in batches():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = gpt_loss(torch.tensor(x), torch.tensor(t), p, MODEL["n_heads"],
                            MODEL["n_layers"])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return np.array(losses)


def test_bf16_training_follows_torch_autocast():
    params = ms.GPT(**MODEL).init(seed=0)
    bf16, f32, ref = ours(params, "bfloat16"), ours(params, None), torch_autocast(params)
    err = np.abs(bf16 - ref) / np.abs(ref)
    gap = np.minimum(np.abs(f32 - ref), np.abs(f32 - bf16)) / np.abs(ref)
    print(f"losses: torch autocast {ref[0]:.6f} -> {ref[-1]:.6f}; ours bf16 max rel diff "
          f"{err.max():.2e} (tol {LOSS_TOL}); float32 vs both: {gap.max():.2e} at most, "
          f"{gap[-1]:.2e} at the last step")
    assert err.max() <= LOSS_TOL
    assert gap.max() > LOSS_TOL, "float32 is as close as bf16: nothing was rounded"
    assert ref[-1] < ref[0] - 1.0, "it learns"
