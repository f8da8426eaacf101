"""Pipeline schedules as plain data: validity, bubble, memory, broken schedules. No MPI."""
import argparse

import pytest

from mpishard.cli.schedule import add_schedule_arguments, plot_timeline, run_schedule_command
from mpishard.parallel.schedules import (Action, ScheduleError, ScheduleStats, ideal_bubble,
                                         make_schedule, render_timeline, simulate, validate)

PPS = range(1, 9)


def micro(pp):
    return sorted({1, 3, pp, 2 * pp})


def cases(name):
    if name == 'interleaved':
        return [(pp, m, v) for pp in PPS for m in (pp, 2 * pp, 3 * pp) for v in (2, 3)]
    return [(pp, m, 1) for pp in PPS for m in micro(pp)]


ALL = [(name,) + c for name in ('gpipe', '1f1b', 'interleaved') for c in cases(name)]


@pytest.mark.parametrize('name,pp,m,v', ALL)
def test_builtin_schedules_are_valid(name, pp, m, v):
    schedule = make_schedule(name, pp, m, v)
    assert len(schedule) == pp
    assert all(len(actions) == 2 * m * v for actions in schedule)
    stats = validate(schedule, pp, m, v)
    assert isinstance(stats, ScheduleStats)
    busy = (1.0 + 2.0) * m                      # default timings, per stage
    assert stats.makespan >= busy - 1e-12
    assert stats.bubble_fraction == pytest.approx(1 - busy / stats.makespan, abs=1e-12)


@pytest.mark.parametrize('pp,m,v', cases('gpipe'))
def test_gpipe_holds_every_microbatch(pp, m, v):
    stats = validate(make_schedule('gpipe', pp, m), pp, m)
    assert stats.peak_live_activations == [m] * pp


@pytest.mark.parametrize('pp,m,v', cases('1f1b'))
def test_1f1b_peak_live_is_min_m_pp_minus_s(pp, m, v):
    stats = validate(make_schedule('1f1b', pp, m), pp, m)
    assert stats.peak_live_activations == [min(m, pp - s) for s in range(pp)]


@pytest.mark.parametrize('t_backward', [1.0, 2.0, 3.5])
@pytest.mark.parametrize('name', ['gpipe', '1f1b'])
@pytest.mark.parametrize('pp,m,v', cases('1f1b'))
def test_bubble_matches_textbook_formula(name, pp, m, v, t_backward):
    stats = simulate(make_schedule(name, pp, m), pp, m, t_forward=1.0, t_backward=t_backward)
    expected = (pp - 1) / (m + pp - 1)
    print(f"{name} pp={pp} m={m} t_b={t_backward}: bubble {stats.bubble_fraction} vs {expected}")
    assert abs(stats.bubble_fraction - expected) < 1e-9
    assert abs(ideal_bubble(pp, m) - expected) < 1e-15
    assert stats.makespan == pytest.approx((m + pp - 1) * (1.0 + t_backward), rel=1e-12)


@pytest.mark.parametrize('t_backward', [1.0, 2.0])
@pytest.mark.parametrize('pp,m,v', [c for c in cases('interleaved') if c[0] >= 2])
def test_interleaved_bubble_smaller_than_1f1b(pp, m, v, t_backward):
    inter = simulate(make_schedule('interleaved', pp, m, v), pp, m, v, t_backward=t_backward)
    plain = simulate(make_schedule('1f1b', pp, m), pp, m, t_backward=t_backward)
    print(f"pp={pp} m={m} v={v}: interleaved {inter.bubble_fraction:.4f}, "
          f"1f1b {plain.bubble_fraction:.4f}, ideal {ideal_bubble(pp, m, v):.4f}")
    assert inter.bubble_fraction < plain.bubble_fraction
    assert inter.bubble_fraction <= ideal_bubble(pp, m, v) + 1e-9


def test_interleaved_follows_megatron_order():
    schedule = make_schedule('interleaved', 2, 4, 2)
    labels = [f"{a.kind}{a.microbatch}{'ab'[a.chunk]}" for a in schedule[0]]
    assert labels == ['F0a', 'F1a', 'F0b', 'F1b', 'F2a', 'B0b', 'F3a', 'B1b', 'F2b', 'B0a',
                      'F3b', 'B1a', 'B2b', 'B3b', 'B2a', 'B3a']


def test_t_comm_delays_each_hop():
    pp, m = 4, 4
    base = simulate(make_schedule('gpipe', pp, m), pp, m, t_backward=1.0)
    slow = simulate(make_schedule('gpipe', pp, m), pp, m, t_backward=1.0, t_comm=0.5)
    # forward fill and backward drain each cross pp-1 links
    assert slow.makespan == pytest.approx(base.makespan + 2 * (pp - 1) * 0.5)


def test_start_times_respect_dependencies():
    pp, m, v = 3, 6, 2
    stats = simulate(make_schedule('interleaved', pp, m, v), pp, m, v, t_comm=0.25)
    end = {(s, a): e for s, row in enumerate(stats.start_times) for a, _, e in row}
    for s, row in enumerate(stats.start_times):
        for (a, start, stop), nxt in zip(row, row[1:] + [None]):
            assert stop > start
            if nxt is not None:
                assert nxt[1] >= stop                       # one action at a time per stage
            k = a.chunk * pp + s
            if a.kind == 'F' and k > 0:
                assert start >= end[((k - 1) % pp, Action('F', a.microbatch, (k - 1) // pp))] + 0.25
            if a.kind == 'B' and k < pp * v - 1:
                assert start >= end[((k + 1) % pp, Action('B', a.microbatch, (k + 1) // pp))] + 0.25


# ---------------------------------------------------------------------------------- broken

def test_backward_before_forward_raises():
    schedule = [[Action('F', 0, 0), Action('B', 0, 0)], [Action('B', 0, 0), Action('F', 0, 0)]]
    with pytest.raises(ScheduleError, match='before its forward'):
        validate(schedule, 2, 1)


def test_missing_action_raises():
    schedule = make_schedule('1f1b', 2, 3)
    schedule[1].remove(Action('B', 2, 0))
    with pytest.raises(ScheduleError, match='stage 1 is missing'):
        validate(schedule, 2, 3)


def test_duplicate_and_out_of_range_actions_raise():
    schedule = make_schedule('gpipe', 2, 2)
    schedule[0].insert(1, Action('F', 0, 0))
    with pytest.raises(ScheduleError, match='twice'):
        validate(schedule, 2, 2)
    schedule = make_schedule('gpipe', 2, 2)
    schedule[0][0] = Action('F', 0, 1)
    with pytest.raises(ScheduleError, match='out of range'):
        validate(schedule, 2, 2)
    with pytest.raises(ScheduleError, match='3 stages'):
        validate(make_schedule('gpipe', 3, 2), 2, 2)


def test_deadlock_raises_naming_stuck_stages():
    # stage 0 wants B0 (from stage 1) before sending F1; stage 1 wants F1 before doing B0
    schedule = [[Action('F', 0, 0), Action('B', 0, 0), Action('F', 1, 0), Action('B', 1, 0)],
                [Action('F', 1, 0), Action('F', 0, 0), Action('B', 0, 0), Action('B', 1, 0)]]
    with pytest.raises(ScheduleError, match='deadlock') as info:
        validate(schedule, 2, 2)
    assert 'stage 0' in str(info.value) and 'stage 1' in str(info.value)
    assert issubclass(ScheduleError, ValueError)


def test_plain_tuples_are_accepted():
    schedule = [[tuple(a) for a in row] for row in make_schedule('1f1b', 3, 4)]
    assert validate(schedule, 3, 4).peak_live_activations == [3, 2, 1]


# ---------------------------------------------------------------------------------- bad input

@pytest.mark.parametrize('args,match', [
    (('pipedream', 2, 4), 'gpipe, 1f1b, interleaved'),
    (('1f1b', 0, 4), 'pp must be a positive integer, got 0'),
    (('gpipe', 2, 0), 'microbatches must be a positive integer, got 0'),
    (('gpipe', 2, 4, 2), 'virtual_stages == 1, got 2'),
    (('1f1b', 2, 4, 0), 'virtual_stages must be a positive integer, got 0'),
    (('interleaved', 2, 4, 1), 'virtual_stages >= 2, got 1'),
    (('interleaved', 4, 6, 2), r'microbatches \(6\).*pp \(4\)'),
])
def test_bad_arguments_raise_value_error(args, match):
    with pytest.raises(ValueError, match=match):
        make_schedule(*args)


def test_bad_types_and_timings():
    with pytest.raises(TypeError):
        make_schedule('1f1b', 2.0, 4)
    with pytest.raises(ValueError, match='t_forward'):
        simulate(make_schedule('1f1b', 2, 4), 2, 4, t_forward=0.0)


# ---------------------------------------------------------------------------------- drawing

def test_render_classic_gpipe_chart():
    chart = render_timeline(make_schedule('gpipe', 3, 2))
    assert chart.splitlines() == [
        'stage 0 | F0 F1 .. .. .. .. B1 B0',
        'stage 1 | .. F0 F1 .. .. B1 B0 ..',
        'stage 2 | .. .. F0 F1 B1 B0 .. ..',
    ]


def test_render_stats_and_width():
    stats = simulate(make_schedule('interleaved', 2, 2, 2), 2, 2, 2)
    chart = render_timeline(stats)
    assert 'F0a' in chart and 'B1b B1b' in chart          # backward spans two cells
    assert all(len(line) <= 20 for line in render_timeline(stats, width=20).splitlines())


def test_plot_timeline(tmp_path):
    pytest.importorskip('matplotlib')
    path = tmp_path / 'chart.png'
    plot_timeline(simulate(make_schedule('1f1b', 4, 8), 4, 8), str(path), title='1f1b')
    assert path.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'


def test_schedule_command(capsys, tmp_path):
    parser = add_schedule_arguments(argparse.ArgumentParser())
    args = parser.parse_args(['--pp', '4', '--microbatches', '8', '--schedule', 'interleaved',
                              '--virtual-stages', '2'])
    assert run_schedule_command(args) == 0
    out = capsys.readouterr().out
    assert 'stage 3 |' in out and 'bubble fraction' in out and '[11, 9, 7, 5]' in out
    args = parser.parse_args(['--pp', '4', '--microbatches', '6', '--schedule', 'interleaved'])
    assert run_schedule_command(args) == 2
    assert 'multiple of pp' in capsys.readouterr().err
