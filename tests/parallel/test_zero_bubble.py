"""Zero-bubble pipelining (schedule=zb1p, ZB-H1): the schedule data, the simulator, and the
engine's split backward (B: input gradient, W: weight gradients) against single in float64
(rtol 1e-9) for an MLP and a GPT at pp=2 and pp=4, with and without dp/fsdp/tp.

MPI tests:
`mpiexec -n N python -m mpi4py -m pytest --with-mpi -m mpi tests/parallel/test_zero_bubble.py`
for N in 1, 2, 4, 8 (a k-rank layout runs on `group_comm(k)`).
"""
import pytest

from conftest import group_comm
from mpishard.parallel.pipeline import pipeline_bubble
from mpishard.parallel.schedules import (Action, ScheduleError, make_schedule, render_timeline,
                                         simulate)
from test_gpt_engine import check_against_single as gpt_against_single
from test_pipeline import check_against_single


# -- the schedule (no MPI) -----------------------------------------------------------------------
@pytest.mark.parametrize("pp", [2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 4, 8, 12])
def test_zb1p_bubble_and_memory(pp, m):
    """With F = B = W the bubble is (p-1)/(3m+p-1) for m >= p (a third of 1F1B's idle time),
    and no stage holds more than pp microbatches: 1F1B's peak."""
    zb = simulate(make_schedule("zb1p", pp, m), pp, m, t_forward=1.0, t_backward=2.0)
    one = simulate(make_schedule("1f1b", pp, m), pp, m, t_forward=1.0, t_backward=2.0)
    assert max(zb.peak_live_activations) <= max(one.peak_live_activations) == min(pp, m)
    if m >= pp:
        assert zb.bubble_fraction == pytest.approx((pp - 1) / (3 * m + pp - 1), abs=1e-12)
        idle = lambda st: st.bubble_fraction * st.makespan                 # noqa: E731
        assert idle(zb) == pytest.approx(idle(one) / 3, abs=1e-9)
    assert zb.bubble_fraction <= one.bubble_fraction + 1e-12


def test_zb1p_chart():
    chart = render_timeline(make_schedule("zb1p", 4, 6)).splitlines()
    assert chart[0] == "stage 0 | F0 F1 F2 F3 .. .. .. B0 W0 F4 B1 W1 F5 B2 W2 B3 W3 B4 W4 B5 W5"
    assert chart[3] == "stage 3 | .. .. .. F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 F5 B5 W2 W3 W4 W5"


def test_split_schedules_are_checked():
    good = make_schedule("zb1p", 2, 2)
    w_first = [list(good[0]), list(good[1])]
    i = w_first[1].index(Action("W", 0, 0))
    w_first[1].insert(0, w_first[1].pop(i))
    with pytest.raises(ScheduleError, match="before its input gradient B"):
        simulate(w_first, 2, 2)
    missing = [list(good[0]), [a for a in good[1] if a != Action("W", 1, 0)]]
    with pytest.raises(ScheduleError, match="missing 1 action"):
        simulate(missing, 2, 2)
    with pytest.raises(ValueError, match="t_weight"):
        simulate(good, 2, 2, t_backward=2.0, t_weight=2.0)


# -- the engine against single (MPI) --------------------------------------------------------------
def assert_nothing_deferred(engine):
    assert all(not layer.in_flight() for layer in engine.layers), "a W pass was left behind"


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("pp,m,depth", [(2, 1, 2), (2, 2, 3), (2, 4, 4), (2, 8, 5)])
def test_mlp_two_stages_equal_single(pp, m, depth):
    engine = check_against_single(group_comm(pp), f"pp={pp},microbatches={m},schedule=zb1p",
                                  depth, "cross_entropy" if depth % 2 else "mse")
    assert_nothing_deferred(engine)


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("layout,depth", [("pp=4,microbatches=4,schedule=zb1p", 4),
                                          ("pp=4,microbatches=8,schedule=zb1p", 9),
                                          ("pp=4,microbatches=3,schedule=zb1p", 5),
                                          ("dp=2,pp=2,microbatches=4,schedule=zb1p", 4),
                                          ("tp=2,pp=2,microbatches=4,schedule=zb1p", 4),
                                          ("fsdp=2,pp=2,microbatches=2,schedule=zb1p", 3)])
def test_mlp_four_ranks_equal_single(layout, depth):
    rows = 24 if "microbatches=3" in layout else 16
    engine = check_against_single(group_comm(4), layout, depth, rows=rows)
    assert_nothing_deferred(engine)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("layout,kw", [("pp=2,schedule=zb1p", {}),
                                       ("pp=2,schedule=zb1p,microbatches=4", {"n_layers": 3}),
                                       ("pp=2,schedule=zb1p,microbatches=2", {"T": 6})])
def test_gpt_two_stages_equal_single(layout, kw):
    gpt_against_single(group_comm(2), layout, **kw)


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("layout,kw", [("pp=4,schedule=zb1p", {"n_layers": 4}),
                                       ("pp=4,schedule=zb1p,microbatches=8", {"n_layers": 4}),
                                       ("dp=2,pp=2,schedule=zb1p,microbatches=4", {}),
                                       ("fsdp=2,pp=2,schedule=zb1p", {"T": 6})])
def test_gpt_four_ranks_equal_single(layout, kw):
    gpt_against_single(group_comm(4), layout, **kw)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("pp", [2, 4, 8])
def test_zb1p_runs_its_schedule_with_its_bubble(pp):
    """The engine runs exactly the zb1p order; its peak stash (tapes + deferred W inputs) is
    the simulator's, pp on every stage; the executed order simulates to (p-1)/(3m+p-1)."""
    comm = group_comm(pp)
    m = 2 * pp
    engine = check_against_single(comm, f"pp={pp},microbatches={m},schedule=zb1p", 2 * pp)
    st = engine.stats
    assert st["actions"] == make_schedule("zb1p", pp, m)[engine.stage]
    actions = comm.allgather([tuple(a) for a in st["actions"]])           # control data
    peaks = comm.allgather(st["peak_stashed"])
    sim = simulate([[Action(*a) for a in row] for row in actions], pp, m)
    assert sim.peak_live_activations == peaks == [pp] * pp
    assert sim.bubble_fraction == pytest.approx((pp - 1) / (3 * m + pp - 1), abs=1e-12)
    measured = pipeline_bubble(engine)
    assert 0 <= measured < 1
    print(f"zb1p pp={pp} m={m} stage {engine.stage}: bubble measured {measured:.3f}, "
          f"simulated {sim.bubble_fraction:.3f}")
