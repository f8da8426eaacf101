"""Receive buffers start at the page offset of what is sent into them (comm/placement.py).

    mpiexec -n 2 python -m mpi4py -m pytest --with-mpi -m mpi tests/comm/test_placement.py
"""
import mmap
import re
from pathlib import Path

import numpy as np
import pytest

import mpishard as ms
from mpishard.comm.placement import HUGE, MIN_BYTES, PAGE, empty_at, page_offset
from mpishard.comm.pool import ResultPool

from conftest import world

OFFSETS = [0, 16, 48, 1040, PAGE - 16]


@pytest.mark.parametrize("offset", OFFSETS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int64])
def test_empty_at_starts_at_the_offset(offset, dtype):
    a = empty_at(np, (3, 5000), dtype, offset)
    assert a.shape == (3, 5000) and a.dtype == dtype and a.flags.c_contiguous
    assert a.flags.aligned and a.flags.writeable
    assert a.ctypes.data % PAGE == offset
    assert page_offset(a) == offset
    a[...] = 7                                   # the whole array is usable memory
    assert a.sum() == 7 * a.size


def test_empty_at_rounds_down_to_the_dtype_alignment_and_takes_an_int_shape():
    a = empty_at(np, 4000, np.float64, 1044)
    assert a.shape == (4000,) and a.ctypes.data % PAGE == 1040


def test_small_and_device_arrays_are_not_placed():
    small = np.empty(MIN_BYTES // 8 - 1)
    assert page_offset(small) == -1
    assert page_offset([1.0] * 10_000) == -1     # not a host array: nothing to read
    plain = empty_at(np, (10,), np.float32, -1)
    assert plain.base is None


def thp_eligible(address: int):
    """The kernel's THPeligible flag of the mapping holding `address` (/proc/self/smaps), or
    None where transparent huge pages are off or the kernel does not say."""
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not mode.exists() or "[never]" in mode.read_text():
        return None
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        span = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if span:
            inside = int(span[1], 16) <= address < int(span[2], 16)
        elif inside and line.startswith("THPeligible:"):
            return int(line.split()[1])
    return None


def mapped(a) -> bool:
    """Whether `a` lives in a mapping of its own (placement.huge_pages), not on the heap."""
    while isinstance(a, np.ndarray):
        a = a.base
    return isinstance(getattr(a, "obj", None), mmap.mmap)


def test_a_huge_buffer_starts_at_the_offset_past_a_2mib_boundary_in_advised_memory():
    a = empty_at(np, (3, HUGE // 8), np.float32, 1040, huge=True)      # 3 MiB
    assert a.shape == (3, HUGE // 8) and a.flags.c_contiguous and a.flags.writeable
    assert a.ctypes.data % HUGE == 1040 and page_offset(a) == 1040
    assert mapped(a)                                   # memory of its own, not the heap's
    a[...] = 7
    assert a.sum() == 7 * a.size
    if thp_eligible(a.ctypes.data) is not None:        # the whole first 2 MiB is advised
        assert thp_eligible(a.ctypes.data) == 1
    small = empty_at(np, HUGE // 4 - 1, np.float32, 16, huge=True)     # under 2 MiB: heap
    assert small.ctypes.data % PAGE == 16 and not mapped(small)
    plain = empty_at(np, (3, HUGE // 8), np.float32, 1040)             # not asked for
    assert not mapped(plain)


def test_the_pool_gives_huge_pages_to_the_buffers_it_keeps_and_heap_to_the_rest():
    """A shape's first two buffers are reused call after call; one made while the caller
    holds both (it keeps its results) replaces the oldest and comes from the heap, which
    reuses freed memory without faulting it in again."""
    pool = ResultPool(np)
    x = empty_at(np, HUGE // 4, np.float32, 48)
    first, second = pool.get(x.shape, x.dtype, x), pool.get(x.shape, x.dtype, x)
    third = pool.get(x.shape, x.dtype, x)
    assert [mapped(b) for b in (first, second, third)] == [True, True, False]
    assert {b.ctypes.data % PAGE for b in (first, second, third)} == {48}


def test_pool_places_a_new_buffer_at_its_input_offset_and_reuses_it():
    pool = ResultPool(np)
    for offset in OFFSETS:
        x = empty_at(np, (64, 100), np.float32, offset)
        out = pool.get(x.shape, x.dtype, x)
        assert out.ctypes.data % PAGE == offset
        address = out.ctypes.data
        del out
        assert pool.get(x.shape, x.dtype, x).ctypes.data == address   # nobody holds it
        pool.clear()


@pytest.mark.parametrize("rows", [64, HUGE // 400 + 1])       # on the heap, in huge pages
def test_pool_never_hands_an_input_a_buffer_at_the_slow_distance(rows):
    """Two arrays of one size allocated one after the other start 16 bytes apart in their
    pages: the result kept for the second must not receive for the first (a copy 1-31 bytes
    past its source within the page runs 2-4x slower), but is still reused for the second."""
    pool = ResultPool(np)
    first = empty_at(np, (rows, 100), np.float32, 1792)
    second = empty_at(np, (rows, 100), np.float32, 1792 + 16)
    kept = pool.get(second.shape, second.dtype, second).ctypes.data      # freed at once
    assert kept % PAGE == 1808
    out = pool.get(first.shape, first.dtype, first)
    assert out.ctypes.data != kept and out.ctypes.data % PAGE == 1792
    del out
    assert pool.get(second.shape, second.dtype, second).ctypes.data == kept
    again = pool.get(first.shape, first.dtype, first).ctypes.data        # its own, kept too
    assert again % PAGE == 1792 and again != kept
    assert pool.get(first.shape, first.dtype, first).ctypes.data == again
    far = empty_at(np, (rows, 100), np.float32, 1808 + 64)       # any other distance: reused
    assert pool.get(far.shape, far.dtype, far).ctypes.data in (kept, again)


@pytest.mark.parametrize("rows", [64, HUGE // 400 + 1])       # on the heap, in huge pages
def test_pool_never_hands_out_a_buffer_while_a_view_of_it_lives(rows):
    """A view of a placed buffer holds the byte buffer that owns the memory, not the pooled
    array: the pool must count that holder too, or it would overwrite the view's data."""
    pool = ResultPool(np)
    x = empty_at(np, (rows, 100), np.float32, 16)
    out = pool.get(x.shape, x.dtype, x)
    out[...] = 1.0
    view = out[1:, :3]
    address = out.ctypes.data
    del out
    again = pool.get(x.shape, x.dtype, x)
    assert again.ctypes.data != address
    again[...] = 2.0
    other = pool.get(x.shape, x.dtype, x)          # both held: a third (the view keeps the first)
    kept = other.ctypes.data
    assert kept not in (address, again.ctypes.data)
    np.testing.assert_array_equal(view, 1.0)
    del other
    assert pool.get(x.shape, x.dtype, x).ctypes.data == kept      # free again: reused


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("offset", OFFSETS)
def test_a_received_array_starts_at_the_senders_page_offset(offset):
    comm = world()
    n, me = comm.Get_size(), comm.Get_rank()
    engine = ms.make_engine(ms.MLP([2, 2]), f"dp={n}", comm=comm, dtype=np.float32)
    sent = empty_at(np, (32, 257), np.float32, (offset + 64 * me) % PAGE)   # 32 KiB
    sent[...] = np.arange(sent.size, dtype=np.float32).reshape(sent.shape) + me
    nxt, prev = (me + 1) % n, (me - 1) % n
    fut = engine.send_async(sent, nxt, tag=3)
    got = engine.receive(prev, tag=3)
    fut.result()
    np.testing.assert_array_equal(got, np.arange(sent.size).reshape(sent.shape) + prev)
    assert got.ctypes.data % PAGE == (offset + 64 * prev) % PAGE
    if me == 0:                                    # the blocking form, around the ring
        engine.send(nxt, sent, tag=4)
    got = engine.receive(prev, tag=4)
    if me != 0:
        engine.send(nxt, sent, tag=4)
    assert got.ctypes.data % PAGE == (offset + 64 * prev) % PAGE


@pytest.mark.mpi(min_size=2)
def test_broadcast_and_collective_results_start_at_the_inputs_page_offset():
    comm = world()
    n, me = comm.Get_size(), comm.Get_rank()
    engine = ms.make_engine(ms.MLP([2, 2]), f"dp={n}", comm=comm, dtype=np.float64)
    root = empty_at(np, (n * 8, 129), np.float64, 2064) if me == 0 else None
    if me == 0:
        root[...] = 3.0
    got = engine.broadcast(root, root=0, group="dp")
    np.testing.assert_array_equal(got, 3.0)
    assert got.ctypes.data % PAGE == 2064
    x = empty_at(np, (n * 8, 129), np.float64, 80)
    x[...] = me
    y = engine.all_to_all(x, group="dp")
    np.testing.assert_array_equal(y, np.repeat(np.arange(n), 8)[:, None] * np.ones(129))
    assert y.ctypes.data % PAGE == 80
    g = engine.all_gather(x, group="dp")
    assert g.ctypes.data % PAGE == 80 and g.shape == (n * n * 8, 129)
    s = engine.all_reduce(x, group="dp")
    assert s.ctypes.data % PAGE == 80
    np.testing.assert_array_equal(s, n * (n - 1) / 2)


@pytest.mark.mpi(min_size=2)
def test_a_received_array_is_freed_when_its_holder_lets_go():
    """No reference cycle keeps a received array (or its Future) alive until the garbage
    collector runs: receive_async's finish names its own Future, so a completed Future lets
    go of it (before, every 1 MiB receive in a loop took a fresh heap block: 2.3x slower)."""
    import gc
    import weakref

    comm = world()
    n, me = comm.Get_size(), comm.Get_rank()
    engine = ms.make_engine(ms.MLP([2, 2]), f"dp={n}", comm=comm, dtype=np.float32)
    sent = np.full(4096, me, dtype=np.float32)
    gc.disable()
    try:
        fut = engine.send_async(sent, (me + 1) % n, tag=5)
        got = engine.receive_async((me - 1) % n, tag=5)
        value = got.result()
        fut.result()
        assert value[0] == (me - 1) % n
        alive = weakref.ref(value), weakref.ref(got)
        del value, got
        assert [ref() for ref in alive] == [None, None]
    finally:
        gc.enable()


def test_a_data_parallel_bucket_of_2mib_and_up_lives_in_huge_pages():
    """The flat gradient buffer is reduced in place every step and read by every peer: it
    starts on a 2 MiB boundary in a mapping of its own; the gradients become views of it."""
    from types import SimpleNamespace

    from mpishard.parallel.data_parallel import Bucket
    rng = np.random.default_rng(0)
    grads = {"w0": rng.standard_normal((512, 600)), "w1": rng.standard_normal((300,))}
    want = {k: v.copy() for k, v in grads.items()}
    bucket = Bucket(SimpleNamespace(xp=np), grads, ("dp",), ["w0", "w1"], views=True)
    assert bucket.flat.nbytes >= HUGE and mapped(bucket.flat)
    assert bucket.flat.ctypes.data % HUGE == 0
    owner = bucket.flat                  # what memory reports count (parallel/store.py): the
    while getattr(owner, "base", None) is not None and hasattr(owner.base, "nbytes"):
        owner = owner.base               # bytes, not the mapping's spare address space
    assert owner.nbytes == bucket.flat.nbytes
    for k in grads:
        assert np.shares_memory(grads[k], bucket.flat)
        np.testing.assert_array_equal(grads[k], want[k])
    small = {"a": np.ones((10, 10)), "b": np.ones(5)}
    assert not mapped(Bucket(SimpleNamespace(xp=np), small, ("dp",), ["a", "b"], True).flat)
