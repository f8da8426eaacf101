"""The device-double layout suite through the NCCL path (tests/nccl_double.py's stand-in).

The GPT layouts of tests/integration/test_device_double_gpt.py, and a few of four ranks, run
with `gpu_comm="nccl"` on the device double and the strict NCCL stand-in: each layout's
train_step equals the numpy single reference (float64, rtol 1e-9: loss, gathered gradients,
gathered predict logits), the stand-in counted the NCCL calls the layout's communication
needs (so the NCCL path was really taken), and no float array was staged through host memory
for MPI (only what NCCL lacks may be). MPI tests: `mpiexec -n N python -m mpi4py -m pytest
--with-mpi -m mpi tests/comm/test_nccl_layouts.py` for N in 2, 4.
"""
import pytest
from conftest import group_comm, single_reference
from test_device_double_gpt import CE, LAYOUTS, case, check_step, tiny_gpt
from test_nccl import nccl_backend

import mpishard as ms

FOUR = [("dp=2,tp=2", 4), ("pp=2,dp=2,microbatches=2", 4), ("fsdp=4", 4), ("tp=2,cp=2", 4),
        ("dp=2,cp=2", 4), ("cp=4", 4), ("pp=4,microbatches=4", 4)]
NEEDS = {"dp": ("allReduce",), "tp": ("allReduce",), "fsdp": ("allGather", "reduceScatter"),
         "pp": ("send", "recv", "groupEnd"), "cp": ("send", "recv", "groupEnd")}


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("layout,n", LAYOUTS[1:] + FOUR)
def test_gpt_layouts_through_nccl(layout, n):
    comm = group_comm(n)
    backend, xp, nccl = nccl_backend(comm)
    assert backend.comm_path == "nccl"
    model = tiny_gpt() if "pp=4" not in layout else ms.GPT(
        vocab_size=16, seq_len=8, d_model=16, n_heads=2, n_layers=4)   # a block per stage
    params, x, t = case(model)
    ref, want_loss, want = single_reference(model, params, x, t, CE)

    engine = ms.make_engine(model, layout, comm=comm, device=backend, timeout=20)
    engine.load_checkpoint(params)
    x_dev, t_dev = engine.shard_batch(x), engine.shard_batch(t)
    nccl.calls.clear()
    loss, grads = engine.train_step(x_dev, t_dev, CE)
    calls = dict(nccl.calls)
    print(f"GPT {layout} rank {engine.device_id}: NCCL calls {calls}, staged {backend.staged}")
    axes = {part.split("=")[0] for part in layout.split(",") if not part.startswith(
        ("microbatches", "sequence_parallel", "cp_kind"))}
    for axis in axes:
        for name in NEEDS[axis]:
            assert calls.get(name, 0) > 0, f"{layout}: no NCCL {name} for {axis}"
    assert backend.staged == {"to_host": 0, "to_device": 0}     # every float array by NCCL

    check_step(f"GPT {layout} nccl", engine, backend, (loss, grads), (ref, want_loss, want), x,
               x_dev)
    engine.close()
