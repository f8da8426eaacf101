"""Activation recompute (`recompute=1|attn`, nn/recompute.py) and the activation bytes that
`memory_report()` measures (nn/activations.py): the same gradients as without recompute
(float64, rtol 1e-9, against single), fewer bytes stashed for backward, and pipeline schedules
told apart by their activation peaks.

MPI tests: `mpiexec -n N python -m mpi4py -m pytest --with-mpi -m mpi tests/nn/test_recompute.py`
for N in 1, 2, 4, 8.
"""
import numpy as np
import pytest

import mpishard as ms
from conftest import assert_close, assert_dicts_close, group_comm
from mpishard.comm.mesh import parse_layout
from mpishard.nn.activations import MeteredTape, TapeMeter
from mpishard.nn.recompute import Recompute
from test_gpt_engine import CE, check_against_single, compare_with_single, make_case, make_gpt


def step(model, layout, params, x, t, comm=None):
    """One train_step: (engine, loss, full gradients)."""
    engine = ms.make_engine(model, layout, comm=comm)
    engine.load_checkpoint(params)
    value, grads = engine.train_step(engine.shard_batch(x), engine.shard_batch(t), CE)
    return engine, value, engine.gather_grads(grads)


# -- serial ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["1", "attn"])
@pytest.mark.parametrize("tied", [False, True])
def test_recompute_gives_singles_gradients(mode, tied):
    model = make_gpt(4, tied)
    params, x, t = make_case(model)
    _, ref_loss, ref_grads = step(model, "single", params, x, t)
    engine, value, grads = step(model, f"recompute={mode}", params, x, t)
    assert_close(value, ref_loss, what=f"recompute={mode} loss")
    assert_dicts_close(grads, ref_grads, what=f"recompute={mode}")
    assert engine.meter.current == 0 and sum(len(u.tape) for u in engine.layers) == 0


def test_recompute_cuts_the_activation_peak():
    """4 blocks: a block's input (B, T, D) stays instead of its internals, plus one block's
    internals during its backward: at least 2x fewer bytes (the issue's bound)."""
    model = make_gpt(4)
    params, x, t = make_case(model)
    peaks = {mode: step(model, f"recompute={mode}", params, x, t)[0].memory_report()
             for mode in ("0", "1", "attn")}
    for mode, report in peaks.items():
        print(f"recompute={mode}", report)
        assert report["total"] == sum(v for k, v in report.items() if k != "total")
    full, blocks, attn = (peaks[m]["activations_peak"] for m in ("0", "1", "attn"))
    print(f"activations_peak: none {full} B, attn {attn} B, blocks {blocks} B "
          f"({full / blocks:.2f}x less)")
    assert full >= 2 * blocks
    assert blocks < attn < full


def test_activation_peak_is_per_step_and_tapes_empty_after():
    model = make_gpt(2)
    params, x, t = make_case(model)
    engine, _, _ = step(model, "single", params, x, t)
    first = engine.memory_report()["activations_peak"]
    engine.train_step(x[:4], t[:4], CE)                  # half the rows: half the bytes, about
    second = engine.memory_report()["activations_peak"]
    print("activations_peak 8 rows", first, "4 rows", second)
    assert 0 < second < first and engine.meter.current == 0
    engine.predict(x)                                    # keeps nothing
    assert engine.meter.current == 0


def test_meter_counts_a_buffer_once():
    meter = TapeMeter()
    a, b = MeteredTape(meter), MeteredTape(meter)
    qkv = np.zeros((4, 6))
    a[0] = (qkv[:, :2], qkv[:, 2:4], qkv[:, 4:], 3)       # three views of one buffer
    b[0] = qkv                                           # and the buffer itself elsewhere
    assert meter.current == qkv.nbytes
    b[1] = np.zeros(5)
    assert meter.current == meter.peak == qkv.nbytes + 40
    a.pop(0)
    b.clear()
    assert (meter.current, meter.peak) == (0, qkv.nbytes + 40)
    assert a.pop(7, None) is None


def test_layout_option_and_refusals():
    assert parse_layout("recompute=attn").option("recompute") == "attn"
    assert parse_layout("dp=2,recompute=1").option("recompute") == "1"
    with pytest.raises(ValueError, match="recompute='2' not one of"):
        parse_layout("recompute=2")
    with pytest.raises(ValueError, match="recompute=1 recomputes transformer blocks"):
        ms.make_engine(ms.MLP([4, 8, 2]), "recompute=1")


# -- under MPI -------------------------------------------------------------------------------------
TWO = ["dp=2,recompute=1", "dp=2,recompute=attn", "pp=2,schedule=1f1b,microbatches=4,recompute=1",
       "pp=2,schedule=interleaved,recompute=1", "fsdp=2,zero=3,recompute=1",
       "fsdp=2,zero=3,prefetch=1,recompute=1", "fsdp=2,zero=2,recompute=attn",
       # communication inside the recomputed units is re-issued: the cp ring, Ulysses'
       # all_to_all (tp below: its vocabulary must divide by tp)
       "cp=2,recompute=1", "cp=2,recompute=attn", "cp=2,cp_kind=ulysses,recompute=attn"]
TP = ["tp=2,recompute=1", "tp=2,sequence_parallel=1,recompute=1",
      "tp=2,sequence_parallel=1,recompute=attn", "tp=2,pp=2,recompute=1"]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("layout", TWO)
def test_recompute_layouts_equal_single(layout):
    check_against_single(group_comm(2), layout, n_layers=4)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("layout", TP)
def test_recompute_under_tensor_parallelism_equals_single(layout):
    """tp/sp all-reduces, all-gathers and reduce-scatters inside a block run again in its
    backward, the same on every tp rank."""
    n = 4 if "pp=2" in layout else 2
    model = ms.GPT(vocab_size=16, seq_len=8, d_model=16, n_heads=4, n_layers=4)
    params, x, t = make_case(model)
    compare_with_single(group_comm(n), layout, model, params, x, t, f"GPT {layout}")


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("layout", ["dp=2,pp=2,recompute=1", "fsdp=2,pp=2,recompute=1"])
def test_four_rank_recompute_layouts_equal_single(layout):
    check_against_single(group_comm(4), layout, n_layers=4)


@pytest.mark.mpi(min_size=2)
def test_pipeline_schedules_differ_in_activation_bytes():
    """pp=2, m=4: GPipe stashes all 4 microbatches on every stage, 1F1B at most pp - stage
    on stage `stage`; recompute on top keeps only block inputs."""
    comm = group_comm(2)
    model = make_gpt(4)
    params, x, t = make_case(model)
    peaks = {}
    for layout in ("pp=2,microbatches=4,schedule=gpipe", "pp=2,microbatches=4,schedule=1f1b",
                   "pp=2,microbatches=4,schedule=1f1b,recompute=1"):
        engine, _, _ = step(model, layout, params, x, t, comm)
        peaks[layout] = engine.memory_report()["activations_peak"]
        print(f"{layout} stage {engine.stats['stage']}: activations_peak {peaks[layout]} B, "
              f"peak_stashed {engine.stats['peak_stashed']}")
    gpipe, f1b, f1b_rc = peaks.values()
    stage = comm.Get_rank()
    if stage == 0:                                       # 4 microbatches in flight vs 2
        assert gpipe > 1.5 * f1b
    else:                                                # 4 vs 1
        assert gpipe > 3 * f1b
    assert f1b > f1b_rc


def wrapped_attention(chunks) -> list:
    """Names of the units recompute=attn wrapped, found through the Composite tree."""
    found = []

    def walk(unit):
        for sub in getattr(unit, "units", ()):
            if isinstance(sub, Recompute):
                found.append(type(sub.inner).__name__)
            walk(sub)
    for chunk in chunks:
        for unit in chunk:
            walk(unit)
    return found


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("layout, want", [("cp=2,recompute=attn", "RingAttention"),
                                          ("cp=2,cp_kind=ulysses,recompute=attn",
                                           "UlyssesAttention"),
                                          ("tp=2,recompute=attn", "CausalSelfAttention")])
def test_recompute_attn_wraps_the_attention_core_of_every_layout(layout, want):
    """recompute=attn wraps whatever unit is the attention core, cp's ring and Ulysses units
    too (not only CausalSelfAttention): one Recompute per block."""
    model = ms.GPT(vocab_size=16, seq_len=8, d_model=16, n_heads=2, n_layers=2)
    engine = ms.make_engine(model, layout, comm=group_comm(2))
    assert wrapped_attention(engine.chunks) == [want, want]
