"""Peak memory of ms.hf.load_into against load + load_checkpoint for a model split 4 ways
(MPI, 4 ranks): each rank's tracemalloc peak (numpy's allocations are traced) while filling an
engine. load_into holds the rank's blocks (and their gradients, which any
load allocates) plus one block in flight; load holds the whole model on every rank.

Run: `mpiexec -n 4 python -m mpi4py -m pytest --with-mpi -m mpi -s tests/hf/test_hf_memory.py`
(-s prints the numbers per rank).
"""
import tracemalloc

import numpy as np
import pytest

import mpishard as ms
from conftest import group_comm

MODEL = dict(vocab_size=1001, seq_len=64, d_model=128, n_heads=4, n_layers=4, tied=False)


def peak(fill) -> int:
    """Bytes: the tracemalloc peak over fill(), above what was allocated before it."""
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    fill()
    top = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return top - base


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("layout", ["fsdp=4", "tp=2,pp=2"])
def test_load_into_holds_a_share_where_load_holds_the_model(tmp_path, layout):
    comm = group_comm(4)
    model = ms.GPT(**MODEL)
    d = ms.hf.save(tmp_path / f"r{comm.Get_rank()}", model, model.init(seed=1),
                   dtype="float64")
    full = 8 * sum(int(np.prod(s)) for s in model.param_shapes().values())
    spec = ms.hf.read_model(d)
    engine = ms.make_engine(spec, layout, comm=comm)
    into = peak(lambda: ms.hf.load_into(engine, d))
    store = engine.store
    held = sum(int(a.nbytes) for a in [*store.params.values(), *store.grads.values()])
    ref = ms.make_engine(spec, layout, comm=comm)
    whole = peak(lambda: ref.load_checkpoint(ms.hf.load(d)[1]))
    print(f"hf memory {layout} rank {comm.Get_rank()}: model {full / 2**20:.2f} MiB, "
          f"params + grads held {held / 2**20:.2f} MiB, peak load_into {into / 2**20:.2f} MiB, "
          f"load + load_checkpoint {whole / 2**20:.2f} MiB")
    assert whole >= held + full                 # the whole model was in memory
    # what the engine keeps (its blocks and their gradients) and one block being copied
    assert into < held + full / 16, f"load_into peaked at {into} bytes, holding {held}"
    engine.close()
    ref.close()
