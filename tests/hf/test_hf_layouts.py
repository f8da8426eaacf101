"""ms.hf.load_into on every layout (MPI at 1, 2 and 4 ranks): transformers' float64 logits at
rtol 1e-9, the same parameters as load + load_checkpoint, and each rank reading exactly the
bytes of the slices it holds (a vocabulary padded under tp reads no padding).

Run: `mpiexec -n N python -m mpi4py -m pytest --with-mpi -m mpi tests/hf/test_hf_layouts.py`
for N in 1, 2, 4; a k-rank layout runs on `group_comm(k)`. Each rank builds the same reference
model from the same seed into its own directory.
"""
import numpy as np
import pytest

import mpishard as ms
from conftest import assert_close, assert_dicts_close, group_comm
from hf_models import gpt2, hf_logits, llama, tokens

pytest.importorskip("transformers")

LAYOUTS = [("single", 1), ("dp=2", 2), ("fsdp=2", 2), ("tp=2", 2), ("pp=2", 2), ("cp=2", 2),
           ("tp=2,pp=2", 4), ("fsdp=4", 4), ("dp=2,tp=2", 4)]


def held_bytes(engine) -> int:
    """Bytes of the regions of the full parameters this rank's blocks hold (no padding)."""
    store, total = engine.store, 0
    for name in store.local_names:
        itemsize = np.dtype(np.float64).itemsize
        for region, _ in store.block_pieces(name):
            total += itemsize * int(np.prod([b - a for a, b in region]))
    return total


def check_layout(tmp_path, build, layout, n, what, **kw):
    comm = group_comm(n)
    d, ref = build(tmp_path / f"r{comm.Get_rank()}", **kw)
    model = ms.hf.read_model(d)
    engine = ms.make_engine(model, layout, comm=comm)
    nbytes = ms.hf.load_into(engine, d)
    assert nbytes == held_bytes(engine), f"{what} {layout}: read {nbytes} bytes"
    _, params = ms.hf.load(d)
    if n > 1 and layout not in ("dp=2", "cp=2"):
        full = sum(a.nbytes for a in params.values())
        assert nbytes < full, f"{what} {layout}: read {nbytes} of {full} bytes"
    assert_dicts_close(engine.gather_params(), params, rtol=0, what=f"{what} {layout} params")
    x = tokens(ref, rows=4, T=8)
    y = engine.gather_batch(engine.predict(engine.shard_batch(x)))
    assert_close(y, hf_logits(ref, x), what=f"{what} {layout} logits vs transformers")
    engine.close()


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("layout,n", LAYOUTS)
@pytest.mark.parametrize("tied", [True, False])
def test_gpt2_on_every_layout(tmp_path, layout, n, tied):
    check_layout(tmp_path, gpt2, layout, n, f"gpt2 tied={tied}", tied=tied)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("layout,n", LAYOUTS)
@pytest.mark.parametrize("tied,kv", [(False, 2), (True, 2), (False, 1)])
def test_llama_on_every_layout(tmp_path, layout, n, tied, kv):
    """kv=2 kv heads split over tp=2; kv=1 replicated over tp (its gradients reduced)."""
    check_layout(tmp_path, llama, layout, n, f"llama tied={tied} kv={kv}", tied=tied,
                 num_key_value_heads=kv)


@pytest.mark.mpi(min_size=2)
def test_a_wrong_engine_model_is_refused_on_every_rank(tmp_path):
    comm = group_comm(2)
    d, _ = gpt2(tmp_path / f"r{comm.Get_rank()}")
    other = ms.GPT(vocab_size=97, seq_len=16, d_model=32, n_heads=4, n_layers=3, tied=True)
    engine = ms.make_engine(other, "tp=2", comm=comm)
    with pytest.raises(ValueError, match="holds GPT\\(.*n_layers=2.*the engine runs"):
        ms.hf.load_into(engine, d)
    engine.close()


@pytest.mark.mpi(min_size=2)
def test_a_bad_file_on_one_rank_is_refused_on_every_rank(tmp_path):
    """Rank 1's copy lacks a tensor: both ranks raise its error, before any tensor is read."""
    from safetensors.numpy import load_file, save_file

    comm = group_comm(2)
    d, _ = gpt2(tmp_path / f"r{comm.Get_rank()}")
    model = ms.hf.read_model(d)
    if comm.Get_rank() == 1:
        f = f"{d}/model.safetensors"
        save_file({k: v for k, v in load_file(f).items() if k != "transformer.ln_f.bias"}, f,
                  metadata={"format": "pt"})
    engine = ms.make_engine(model, "dp=2", comm=comm)
    with pytest.raises(ValueError, match="missing .*ln_f.bias"):
        ms.hf.load_into(engine, d)
    engine.close()
