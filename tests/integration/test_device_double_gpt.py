"""The GPT layouts on the strict CPU stand-in for cupy (tests/device_double.py), both modes.

Each layout's train_step on device arrays equals the numpy single reference (float64, rtol
1e-9: loss, gathered gradients, gathered predict logits), and the host<->device copies of one
step are counted and asserted:

- no array crosses the bus but for MPI staging (`other_arrays` zero): staged, every staged
  byte is one copy, and these are exactly the bytes the Backend handed to MPI (under dp=2: the
  gradients and the 8-byte loss, each way); CUDA-aware (and on one rank): zero staged bytes;
- what is inherent is one-element copies only (`scalars`): the range checks of the token ids
  (min, max) and of the labels (min, max; once before any collective, once in the loss), the
  loss itself read back as a float, and under a data/cp axis the loss uploaded for its
  all_reduce; at most a dozen 8-byte scalars down, one up;
- the token ids and labels go up once, in shard_batch, as int64 (never cast to a float dtype).

Generation with the KV cache runs on the device double too (greedy tokens and logits equal
numpy's). MPI tests: `mpiexec -n N python -m mpi4py -m pytest --with-mpi -m mpi
tests/integration/test_device_double_gpt.py` for N in 1, 2, 4, 8.
"""
import numpy as np
import pytest
from conftest import RTOL64, assert_close, group_comm, single_reference
from mpi4py import MPI
from test_device_double import MODES, check_staged, device_backend
from test_gpt_nn import perturbed

import mpishard as ms
from mpishard.cli.generate import generate_tokens, last_logits
from mpishard.nn.kv_cache import KVCache

CE = ms.losses.CrossEntropy()
NONE = {"to_host": 0, "to_device": 0}
LAYOUTS = [("single", 1), ("dp=2", 2), ("tp=2", 2), ("tp=2,sequence_parallel=1", 2),
           ("cp=2", 2), ("cp=2,cp_kind=ulysses", 2), ("pp=2,microbatches=2", 2),
           ("fsdp=2", 2)]


def tiny_gpt():
    """vocab 16 and T 8: tp=2 splits the vocabulary, cp=2 cuts the sequence into 4 chunks."""
    return ms.GPT(vocab_size=16, seq_len=8, d_model=16, n_heads=2, n_layers=2)


def case(model, rows=4, seed=0):
    rng = np.random.default_rng(seed)
    params = perturbed(model, seed, rng)
    x = rng.integers(0, model.vocab_size, (rows, model.seq_len))
    t = rng.integers(0, model.vocab_size, (rows, model.seq_len))
    return params, x, t


def upload(engine, xp, x, t):
    """shard_batch puts this rank's token ids and labels on the device: one int64 copy each."""
    xp.copies.reset()
    x_dev, t_dev = engine.shard_batch(x), engine.shard_batch(t)
    assert x_dev.dtype == np.int64 and t_dev.dtype == np.int64, "token ids stay integers"
    assert xp.copies.other_arrays == {"to_host": 0, "to_device": x_dev.nbytes + t_dev.nbytes}
    return x_dev, t_dev


def check_copies(layout, mode, engine, backend, xp, grads):
    c, staged = xp.copies, dict(backend.staged)
    print(f"GPT {layout} {mode} rank {engine.device_id}: host<->device per step {c.bytes} in "
          f"{c.calls} copies: staging {c.staging} (Backend {staged}), other arrays "
          f"{c.other_arrays}, scalars {c.scalars}; MPI bytes sent {dict(engine.comm_bytes)}")
    assert c.other_arrays == NONE                 # no array crosses but for MPI staging
    assert c.staging == staged                    # every staged byte is one copy, and no more
    for way in NONE:                              # the rest: one-element reads and writes
        assert c.bytes[way] == c.staging[way] + c.scalars[way]
    assert c.scalars["to_host"] <= 12 * 8 and c.scalars["to_device"] <= 8
    check_staged(layout, mode, engine.num_devices, staged, grads)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout,n", LAYOUTS, ids=[v for v, _ in LAYOUTS])
def test_gpt_train_step_on_device_arrays(layout, n, mode):
    comm = group_comm(n)
    backend, xp = device_backend(comm, mode)
    model = tiny_gpt()
    params, x, t = case(model)
    ref, want_loss, want = single_reference(model, params, x, t, CE)

    engine = ms.make_engine(model, layout, comm=comm, device=backend)
    engine.load_checkpoint(params)
    x_dev, t_dev = upload(engine, xp, x, t)
    xp.copies.reset()
    backend.staged.update(to_host=0, to_device=0)
    loss, grads = engine.train_step(x_dev, t_dev, CE)
    check_copies(layout, mode, engine, backend, xp, grads)
    check_step(f"GPT {layout} {mode}", engine, backend, (loss, grads), (ref, want_loss, want),
               x, x_dev)


def check_step(what, engine, backend, got, reference, x, x_dev):
    """The step's loss, gathered gradients and gathered predict logits equal the single
    reference's (float64, rtol 1e-9)."""
    (loss, grads), (ref, want_loss, want) = got, reference
    full = {k: backend.to_host(v) for k, v in engine.gather_grads(grads).items()}
    assert_close(loss, want_loss, rtol=RTOL64, what=f"{what} loss")
    for name in want:
        assert_close(full[name], want[name], rtol=RTOL64, what=f"{what} {name}")
    logits = backend.to_host(engine.gather_batch(engine.predict(x_dev)))
    assert_close(logits, ref.predict(x), rtol=RTOL64, what=f"{what} logits")


def test_kv_cache_generation_on_device_arrays():
    """Greedy decoding with the KV cache on the device double: the same tokens as numpy's,
    and the cached last-position logits equal numpy's recomputation (rtol 1e-9)."""
    model = ms.GPT(vocab_size=16, seq_len=16, d_model=16, n_heads=4, n_layers=2, d_ff=32)
    params = model.init(seed=1)
    backend, xp = device_backend(MPI.COMM_SELF, "staged")
    engines = {}
    for name, device in (("numpy", "cpu"), ("device", backend)):
        engines[name] = ms.make_engine(model, comm=MPI.COMM_SELF, device=device)
        engines[name].load_checkpoint(params)
    prompt = [3, 1, 4, 1, 5]
    want = generate_tokens(engines["numpy"], prompt, 24, temperature=0.0)
    assert generate_tokens(engines["device"], prompt, 24, temperature=0.0) == want
    cache, tokens = KVCache(model.seq_len), prompt + want[:6]
    last_logits(engines["device"], tokens[:-1], cache)                  # prefill
    got = last_logits(engines["device"], tokens[-1:], cache)            # one cached step
    assert_close(got, last_logits(engines["numpy"], tokens), rtol=RTOL64,
                 what="device KV-cache logits")
