"""compute_dtype="bfloat16" on a Llama against transformers' LlamaForCausalLM (float32 weights,
eager attention) under torch.autocast("cpu", dtype=torch.bfloat16): the logits.

Tolerance. The matmuls round as autocast's do (tests/hf/test_autocast_torch.py: bit-equal
but for one-ulp flips of the GEMMs' summation order). The elementwise steps between them
differ: transformers runs the rotary turn (cos and sin cast to bf16) and SwiGLU's silu(gate)
* up in bfloat16, rounding after each op, where we compute them in float32 and round once, at
the next matmul's input. Each such op moves a value by at most one bf16 ulp, 2^-7 of
itself, and a logit by the gains after it. We allow MAX_ULPS = 4 units of 2^-8 max|logits|
(observed 1.1) and require our mean error to be below the float32 run's by RATIO = 1.5
(observed 2.5x; bit-equal logits 64%), so the test fails if nothing is rounded.

Run: `pytest -q tests/hf/test_hf_autocast.py` (needs the hf extra: transformers, torch CPU).
"""
import numpy as np
import pytest
import torch

import mpishard as ms
from hf_models import llama, tokens

transformers = pytest.importorskip("transformers")

MAX_ULPS, RATIO = 4, 1.5


def test_llama_bf16_logits_follow_transformers_autocast(tmp_path):
    d, ref = llama(tmp_path, dtype=torch.float32, attn_implementation="eager")
    model, params = ms.hf.load(d)
    x = tokens(ref, rows=2, T=16)
    ours = {}
    for compute in ("bfloat16", None):
        e = ms.SingleDevice(model, dtype=np.float32, compute_dtype=compute)
        e.load_checkpoint({k: np.asarray(v, np.float32) for k, v in params.items()})
        ours[compute] = e.predict(x)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want = ref(torch.as_tensor(x)).logits.float().numpy()
    unit = 2.0 ** -8 * float(np.abs(want).max())
    err = np.abs(ours["bfloat16"] - want)
    err_f32 = np.abs(ours[None] - want)
    print(f"llama bf16 logits vs transformers autocast: max {err.max() / unit:.2f} ulps of "
          f"the scale (bound {MAX_ULPS}), mean {err.mean() / unit:.3f}; float32's mean "
          f"{err_f32.mean() / unit:.3f}; bit-equal {(err == 0).mean():.2f}")
    assert err.max() <= MAX_ULPS * unit
    assert err_f32.mean() >= RATIO * err.mean(), "float32 is as close: nothing was rounded"
