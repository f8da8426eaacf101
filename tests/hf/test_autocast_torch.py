"""compute_dtype="bfloat16" per unit against torch.autocast("cpu", dtype=torch.bfloat16): a
Linear, the attention core, a whole GPT block and the loss, forward and the gradients of the
input and of every weight (nn/autocast.py's policy, float32 masters).

How close, and why. Both sides round the same float32 values to bfloat16 at the same places;
what differs is the order in which a GEMM sums its float32 products (OpenBLAS here, oneDNN in
torch), a difference of a few float32 ulps (2^-23 relative) of a sum. Rounding that sum to
bfloat16 (8 significant bits) gives the same result unless the sum lies within those few
float32 ulps of a rounding boundary; then the two differ by one bfloat16 ulp of the value,
at most 2^-7 |y| (2^-8 to 2^-7 of it, by where |y| lies in its binade). So:

- one matmul (Linear: y, dx, dW; db is a float32 column sum rounded once, the same bound):
  every element within one bf16 ulp of its own value: 2^-7 |ref| elementwise;
- a chain (attention: 2 matmuls forward, 4 backward; a block: 4 projections, 2 attention
  matmuls, LayerNorm between): the same flips, rare, and the float32 steps between (softmax,
  LayerNorm, GELU and their backward) summed in other orders. One flip at the largest element
  is 2^-7 max|ref| = 2 units of 2^-8 max|ref|; a flip upstream reaches the output scaled by
  the gains in between, below 1 at these scales (weights of std 0.02, unit activations). So
  CHAIN = 2 units of 2^-8 max|ref| bounds the max error (observed: at most 0.68, a weight
  gradient's single flip; most results are bit-equal);
- and the rounding happens: the mean error of the float32 run (no autocast) against torch is
  at least CLOSER = 4 times ours (observed: 7.8x at the least, LayerNorm's scale gradient,
  where float32 sums dominate; elsewhere 20x to exact).
"""
import math
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

from torch_autocast_gpt import attention, block, params_to_torch  # noqa: E402

from mpishard.models.gpt.spec import GPT  # noqa: E402
from mpishard.models.gpt.units import Block  # noqa: E402
from mpishard.nn.layers import Linear, LocalAccess, attach_autocast  # noqa: E402
from mpishard.nn.losses import CrossEntropy  # noqa: E402
from mpishard.nn.transformer import CausalSelfAttention  # noqa: E402
from mpishard.parallel.precision import Precision  # noqa: E402

BF16 = Precision(np.float32, compute_dtype="bfloat16").autocast()
CHAIN = 2
CLOSER = 4


def store_of(params):
    params = {n: np.asarray(a, np.float32) for n, a in params.items()}
    return SimpleNamespace(params=params, grads={n: np.zeros_like(a) for n, a in params.items()})


def units(make, params, policy):
    """A unit built by make(access) over its own store, with `policy` attached."""
    store = store_of(params)
    unit = make(LocalAccess(store))
    attach_autocast([[unit]], policy)
    return unit, store


def run(make, params, x, dy, policy):
    """Our forward and backward: (y, dx, grads)."""
    unit, store = units(make, params, policy)
    y = unit.forward(x.copy())
    dx = unit.backward(dy.copy())
    return y, dx, store.grads


def run_torch(f, params, x, dy):
    """torch's under autocast: (y, dx, grads); dy reaches y through y.float(), so a bf16 y
    gets dy rounded to bf16, as a float32 consumer's gradient would be."""
    p = params_to_torch(params)
    xt = torch.tensor(x, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = f(xt, p)
    (y.float() * torch.tensor(dy)).sum().backward()
    return (y.detach().float().numpy(), xt.grad.numpy(),
            {n: t.grad.numpy() for n, t in p.items()})


def compare(what, ours, full, ref, elementwise):
    """Max error against `ref` and its bound; the float32 result must exceed the bound."""
    if elementwise:                             # one bf16 ulp of each element: 2^-7 |ref|
        bound = 2.0 ** -7 * np.abs(ref)
        err, err_full = np.abs(ours - ref) - bound, np.abs(full - ref) - bound
        print(f"{what}: max |ours - torch| - ulp = {err.max():.3g} (<= 0), "
              f"float32 exceeds it by {err_full.max():.3g}")
        assert err.max() <= 0, what
        assert err_full.max() > 0, f"{what}: float32 is as close: nothing was rounded"
        return
    unit = 2.0 ** -8 * float(np.abs(ref).max())
    err, err_full = float(np.abs(ours - ref).max()), float(np.abs(full - ref).max())
    mean, mean_full = float(np.abs(ours - ref).mean()), float(np.abs(full - ref).mean())
    print(f"{what}: max |ours - torch| = {err / unit:.3f} bf16 ulps of max|ref| (bound "
          f"{CHAIN}), float32's {err_full / unit:.3f}; mean {mean / unit:.4f}, float32's "
          f"{mean_full / unit:.4f}")
    assert err <= CHAIN * unit, what
    assert mean_full >= CLOSER * mean, f"{what}: float32 is as close: nothing was rounded"


def check(make, f, params, x, dy, elementwise):
    ours = run(make, params, x, dy, BF16)
    full = run(make, params, x, dy, Precision(np.float32).autocast())
    ref = run_torch(f, params, x, dy)
    compare("y", ours[0], full[0], ref[0], elementwise)
    compare("dx", ours[1], full[1], ref[1], elementwise)
    for n in params:
        compare(f"d {n}", ours[2][n], full[2][n], ref[2][n], elementwise)


def normal(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def test_linear_matches_torch_autocast(rng):
    params = {"fc/weights": normal(rng, 48, 40) / 7, "fc/bias": normal(rng, 40)}
    x, dy = normal(rng, 3, 16, 48), normal(rng, 3, 16, 40)
    check(lambda a: Linear(a, "fc/weights", "fc/bias"),
          lambda xt, p: F.linear(xt, p["fc/weights"].t(), p["fc/bias"]),
          params, x, dy, elementwise=True)


def test_attention_core_matches_torch_autocast(rng):
    """Dh 16: the scale 1/4 is a power of two, exact in either order (we scale q before
    q k^T, the reference scales the bf16 scores after)."""
    x, dy = normal(rng, 2, 24, 3 * 64), normal(rng, 2, 24, 64)
    check(lambda a: CausalSelfAttention(4), lambda xt, p: attention(xt, 4), {}, x, dy,
          elementwise=False)


def test_gpt_block_matches_torch_autocast():
    g = GPT(vocab_size=32, seq_len=24, d_model=64, n_heads=4, n_layers=1)
    params = {n: a for n, a in g.init(seed=3).items() if n.startswith("block_0/")}
    rng = np.random.default_rng(5)
    x, dy = normal(rng, 2, 24, 64), normal(rng, 2, 24, 64)
    check(lambda a: Block(a, 0, 4), lambda xt, p: block(xt, p, 0, 4), params, x, dy,
          elementwise=False)


def test_loss_runs_in_float32_on_16_bit_logits(rng):
    """The loss is float32 on both sides (autocast's fp32 list): on the same bf16-rounded
    logits, ours equals torch's to float32 rounding, value and gradient."""
    logits = BF16.round(normal(rng, 4, 8, 50) * 3)
    t = rng.integers(0, 50, (4, 8))
    value, dy = CrossEntropy()(logits, t)
    lt = torch.tensor(logits, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = F.cross_entropy(lt.reshape(-1, 50), torch.tensor(t).reshape(-1))
    ref.backward()
    assert ref.dtype == torch.float32
    print(f"loss: ours {value:.7f} torch {ref.item():.7f}")
    assert math.isclose(value, ref.item(), rel_tol=1e-6)
    np.testing.assert_allclose(dy, lt.grad.numpy(), rtol=1e-5, atol=1e-8)
