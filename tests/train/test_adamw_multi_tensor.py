"""AdamW on a GPU updates every block of a step in one launch of the multi-tensor kernel
(nn/cuda_ops.adamw_step), with the numbers of the one-block-at-a-time update.

The strict CPU stand-in for cupy (tests/device_double.py) cannot run CUDA C, so here the
launch is the kernel's numpy mirror (tests/cuda_mirror.adamw, which
tests/nn/test_cuda_kernels.py proves bit for bit equal to optim.AdamW's update, and the GPU
check's `kernels` part proves equal to the kernel on a GPU) applied to the double's memory,
and `cuda_ops.use` is switched on for the double. What this checks is the wiring: which
blocks go into the launch (all of them: parameters or fp32 masters of 16-bit parameters,
whole or sharded), their moments and steps, the masters rounded into the stored blocks after,
and that the result is the per-block path's bit for bit on single, dp, fsdp (ZeRO-1 and 3),
tp and pp, four steps with weight decay, float32 and bfloat16 parameters.

MPI tests: `mpiexec -n N python -m mpi4py -m pytest --with-mpi -m mpi
tests/train/test_adamw_multi_tensor.py` for N in 1, 2, 4.
"""
import numpy as np
import pytest
from conftest import group_comm
from cuda_mirror import adamw
from device_double import DeviceModule

import mpishard as ms
from mpishard.comm.backend import Backend
from mpishard.nn import cuda_ops

GPT = ms.GPT(vocab_size=16, seq_len=8, d_model=16, n_heads=2, n_layers=2)
LAYOUTS = [("single", 1), ("dp=2", 2), ("fsdp=2,zero=1", 2), ("fsdp=2", 2), ("tp=2", 2),
           ("pp=2,microbatches=2", 2)]


class Launches:
    """cuda_ops.adamw_step on the device double: the mirror on each block, and a record of
    the block count of every launch."""

    def __init__(self):
        self.blocks = []

    def __call__(self, xp, blocks, lr, betas, eps, weight_decay):
        self.blocks.append(len(blocks))
        hyper = cuda_ops.adamw_hyper(lr, betas, eps, weight_decay, [b[4] for b in blocks])
        for k, (p, g, m, v, _) in enumerate(blocks):
            assert cuda_ops.adamw_takes(p, g, m, v)
            adamw(*(xp.unwrap(a) for a in (p, g, m, v)), hyper, k)


def run(layout, comm, launches, monkeypatch, param_dtype):
    """(losses, {name: host block}, {name: {state key: host array}}) after 4 AdamW steps on
    the double, the multi-tensor path on when `launches` is given."""
    with monkeypatch.context() as patch:
        if launches is not None:
            patch.setattr(cuda_ops, "use", lambda xp: isinstance(xp, DeviceModule))
            patch.setattr(cuda_ops, "adamw_step", launches)
            patch.setattr(cuda_ops, "norm_takes", lambda xp, x, *params: False)  # AdamW's only
        device = Backend("gpu", comm, cuda_aware=False, array_module=DeviceModule())
        e = ms.make_engine(GPT, layout, comm=comm, device=device, dtype=np.float32,
                           param_dtype=param_dtype)
        e.load_checkpoint(GPT.init(seed=0))
        opt = ms.optim.AdamW(e, lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1)
        rng = np.random.default_rng(3)
        losses = []
        for _ in range(4):
            x, t = rng.permutation(16).reshape(2, 8), rng.integers(0, 16, (2, 8))
            loss, _ = e.train_step(e.shard_batch(x), e.shard_batch(t), ms.losses.CrossEntropy())
            opt.step()
            losses.append(loss)
        host = e.backend.to_host
        state = {n: {k: host(a) for k, a in s.items() if k != "step"} | {"step": s["step"]}
                 for n, s in opt.state.items()}
        return losses, {n: host(p) for n, p in e.params.items()}, state, len(opt.state)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("param_dtype", [None, "bfloat16"])
@pytest.mark.parametrize("layout,n", LAYOUTS, ids=[v for v, _ in LAYOUTS])
def test_one_launch_per_step_equals_the_blocks_one_by_one(layout, n, param_dtype,
                                                          monkeypatch):
    monkeypatch.setenv("MPISHARD_CPU_FUSED", "0")
    comm = group_comm(n)
    launches = Launches()
    want_losses, want_params, want_state, _ = run(layout, comm, None, monkeypatch, param_dtype)
    losses, params, state, blocks = run(layout, comm, launches, monkeypatch, param_dtype)
    assert launches.blocks == [blocks] * 4              # every block, one launch a step
    assert losses == want_losses
    assert params.keys() == want_params.keys() and state.keys() == want_state.keys()
    for name, block in want_params.items():
        assert params[name].dtype == block.dtype
        assert np.array_equal(params[name].view(np.uint8), block.view(np.uint8)), name
    for name, entry in want_state.items():
        assert entry.keys() == state[name].keys() and entry["step"] == state[name]["step"] == 4
        if param_dtype:
            assert "master" in entry, name
        for key, a in entry.items():
            if key != "step":
                assert np.array_equal(state[name][key], a), f"{name} {key}"


def test_what_the_kernel_takes():
    f32, f64 = np.ones((3, 4), np.float32), np.ones((3, 4))
    assert cuda_ops.adamw_takes(f32, f32, f32, f32) and cuda_ops.adamw_takes(f64, f64)
    assert not cuda_ops.adamw_takes(f32, f64)                    # mixed dtypes
    assert not cuda_ops.adamw_takes(f32, f32[:, ::2].copy().T)   # not C-contiguous
    assert not cuda_ops.adamw_takes(f32.astype(np.float16))
