"""mesh.py: layout parsing and rank order (serial), and the per-axis communicators (MPI, any
world size).

Rank order is the documented contract: row-major over (dp, fsdp, ep, pp, cp, tp), tp innermost.
"""
import itertools

import numpy as np
import pytest
from mpi4py import MPI

import mpishard as ms
from mpishard.comm import mesh

from conftest import group_comm, world


# -- parsing (serial) --------------------------------------------------------------------------
def test_single_and_empty():
    for text in ("single", "", "  single "):
        layout = ms.parse_layout(text)
        assert layout.world_size == 1
        assert layout.active_axes == ()
        assert str(layout) == "single"


def test_sizes_and_options():
    layout = ms.parse_layout(" dp=2, tp=4 ,pp=3,microbatches=6,schedule=1f1b ")
    assert layout.sizes == {"dp": 2, "fsdp": 1, "ep": 1, "pp": 3, "cp": 1, "tp": 4}
    assert layout.world_size == 24
    assert layout.active_axes == ("dp", "pp", "tp")       # outermost first, not input order
    assert layout.option("microbatches") == 6 and layout.option("schedule") == "1f1b"
    assert layout.option("zero", 3) == 3
    assert layout.data_parallel_size == 2
    assert ms.parse_layout(layout) is layout


def test_data_parallel_size_counts_every_data_axis():
    assert ms.parse_layout("dp=2,fsdp=3,ep=2,tp=2").data_parallel_size == 12


@pytest.mark.parametrize("text,pattern", [
    ("dp=2,xx=2", r"unknown axis or option 'xx'.*'dp'"),
    ("dp=2,dp=4", r"'dp' given twice"),
    ("tp=2,tp=2", r"'tp' given twice"),
    ("dp=two", r"size of axis 'dp' must be an integer, got 'two'"),
    ("dp=0", r"size of axis 'dp' must be >= 1, got 0"),
    ("dp", r"expected 'name=value', got 'dp'"),
    ("pp=2,schedule=zigzag", r"schedule='zigzag' not one of"),
    ("pp=2,microbatches=x", r"option 'microbatches' must be int"),
    ("dp=2,bucket_mb=inf", r"option 'bucket_mb' must be a finite number, got 'inf'"),
    ("fsdp=2,bucket_mb=nan", r"option 'bucket_mb' must be a finite number, got 'nan'"),
])
def test_bad_layouts_name_the_problem(text, pattern):
    with pytest.raises(ValueError, match=pattern):
        ms.parse_layout(text)


def test_layout_must_be_a_string():
    with pytest.raises(TypeError, match="layout must be a string"):
        ms.parse_layout(4)


def test_world_size_check_names_the_numbers():
    with pytest.raises(ValueError, match=r"'dp=2,tp=3' needs dp=2\*tp=3 = 6 ranks, but the "
                                         r"world size is 4"):
        mesh.check_world_size(ms.parse_layout("dp=2,tp=3"), 4)
    mesh.check_world_size(ms.parse_layout("dp=2,tp=3"), 6)


# -- rank order (serial) -----------------------------------------------------------------------
def test_documented_order_dp2_tp2():
    layout = ms.parse_layout("dp=2,tp=2")
    got = [(c["dp"], c["tp"]) for c in (mesh.coordinates(layout, r) for r in range(4))]
    assert got == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert mesh.group_ranks(layout, 0, "tp") == [0, 1]
    assert mesh.group_ranks(layout, 0, "dp") == [0, 2]
    assert mesh.group_ranks(layout, 3, ("tp", "dp")) == [0, 1, 2, 3]


@pytest.mark.parametrize("text", ["dp=2,fsdp=2,pp=3,tp=2", "ep=3,tp=2", "pp=4", "dp=5"])
def test_coordinates_round_trip_and_tp_innermost(text):
    layout = ms.parse_layout(text)
    n = layout.world_size
    coords = [mesh.coordinates(layout, r) for r in range(n)]
    assert [mesh.rank_of(layout, c) for c in coords] == list(range(n))
    # every coordinate tuple appears once
    assert len({tuple(c.values()) for c in coords}) == n
    # row-major over AXES: the coordinate tuples come out sorted in AXES order
    keys = [tuple(c[a] for a in mesh.AXES) for c in coords]
    assert keys == sorted(keys)
    # each axis' groups partition the ranks; group sizes are the axis sizes
    for axis in mesh.AXES:
        groups = {tuple(mesh.group_ranks(layout, r, axis)) for r in range(n)}
        assert sorted(itertools.chain(*groups)) == list(range(n))
        assert all(len(g) == layout.size(axis) for g in groups)
    if layout.size("tp") > 1:   # tp peers are consecutive ranks
        assert mesh.group_ranks(layout, 0, "tp") == list(range(layout.size("tp")))


# -- communicators (MPI) -----------------------------------------------------------------------
def layouts_for(n):
    """Every two-axis split of n ranks, plus the one-axis ones."""
    out = [f"dp={n}", f"tp={n}"]
    out += [f"dp={a},tp={n // a}" for a in range(2, n) if n % a == 0]
    out += [f"fsdp={a},pp={n // a}" for a in range(2, n) if n % a == 0]
    return out


@pytest.mark.mpi(min_size=1)
def test_axis_communicators_match_group_ranks():
    comm = world()
    n, rank = comm.Get_size(), comm.Get_rank()
    for text in layouts_for(n):
        dm = ms.DeviceMesh(comm, text)
        layout = dm.layout
        assert dm.coords == mesh.coordinates(layout, rank)
        for axes in [(a,) for a in mesh.AXES] + [("dp", "tp"), ("dp", "fsdp", "ep"), None,
                                                 ("tp", "dp", "tp")]:     # repeated: once
            sub = dm.comm(axes)
            members = sub.allgather(rank)      # world ranks, in group-rank order
            want = list(range(n)) if axes is None else dm.group_ranks(axes)
            assert members == want, (text, axes)
            if axes is not None:
                assert sub.Get_size() == dm.size(axes)
                assert sub.Get_rank() == dm.coord(axes)
                assert dm.comm(tuple(reversed(axes))) is sub     # cached, order-free


@pytest.mark.mpi(min_size=1)
def test_the_whole_world_s_group_is_the_mesh_s_own_and_close_frees_every_group():
    """No call of the engine's is left on the caller's communicator (a pending one there is
    MPICH's "Builtin communicator ... has pending references" at exit): the whole world's
    group is split off it, the same members in the same order; close() frees every group."""
    comm = world()
    dm = ms.DeviceMesh(comm, f"dp={comm.Get_size()}")
    whole, dp = dm.comm(None), dm.comm("dp")
    assert whole is not comm and MPI.Comm.Compare(whole, comm) == MPI.CONGRUENT
    assert whole is dp                      # the world's group is the dp group here
    dm.close()
    assert whole == MPI.COMM_NULL and dm.closed
    with pytest.raises(ms.CommUnusable, match="closed"):
        dm.comm("dp")
    dm.close()                              # twice: nothing more


@pytest.mark.mpi(min_size=1)
def test_unknown_axis_raises_on_every_rank():
    comm = world()
    dm = ms.DeviceMesh(comm, f"dp={comm.Get_size()}")
    with pytest.raises(ValueError, match=r"unknown mesh axis 'xx'"):
        dm.comm("xx")
    with pytest.raises(ValueError, match=r"unknown mesh axis 'model'"):
        dm.comm(("dp", "model"))


@pytest.mark.mpi(min_size=4)
def test_describe_lists_the_groups():
    comm = group_comm(4)
    text = ms.DeviceMesh(comm, "dp=2,tp=2").describe()
    assert "dp=2 groups: [0,2] [1,3]" in text
    assert "tp=2 groups: [0,1] [2,3]" in text
    assert np.all(np.array(comm.allgather(text)) == text)


@pytest.mark.parametrize("layout,axis", [("dp=2,prefetch=1", "fsdp"), ("tp=2,microbatches=2", "pp"),
                                         ("dp=2,zero=2", "fsdp"), ("tp=2,overlap=1", "dp")])
def test_option_without_its_axis_is_refused(layout, axis):
    with pytest.raises(ValueError, match=f"applies to the {axis}"):
        ms.parse_layout(layout)


def test_prefetch_with_zero1_or_2_is_refused_at_parse_time():
    for zero in (1, 2):
        with pytest.raises(ValueError, match="prefetch=1 needs zero=3"):
            ms.parse_layout(f"fsdp=2,zero={zero},prefetch=1")


def test_mlp_dims_must_be_integers():
    with pytest.raises(ValueError, match="must be integers"):
        ms.MLP([4.5, 2])
