"""FSDP / ZeRO stages 1-3 against the single-device reference, memory and communication.

    mpiexec -n 4 python -m mpi4py -m pytest --with-mpi -m mpi tests/parallel/test_fsdp.py

The models' widths (5, 7, 3, ...) do not divide by the fsdp sizes, so every shard is padded.
Memory and communication are checked against formulas written from the shapes alone.
"""
import math
from pathlib import Path

import numpy as np
import pytest

import mpishard as ms
import mpishard.train.optim  # noqa: F401  (ms.optim)
from mpishard.parallel import placement as pl
from mpishard.parallel import plan_params

from conftest import assert_close, assert_dicts_close, group_comm, run_mpi

ROOT = Path(__file__).resolve().parents[2]
BATCH = 16
# (layout without zero=, ranks, dims): fsdp alone, fsdp+tp, HSDP (dp+fsdp), fsdp+pp
CASES = [("fsdp=2", 2, [5, 7, 3]), ("fsdp=4", 4, [5, 7, 3]), ("fsdp=8", 8, [5, 7, 3]),
         ("fsdp=2,tp=2", 4, [5, 6, 4, 3]), ("dp=2,fsdp=2", 4, [5, 7, 3]),
         ("fsdp=2,pp=2,microbatches=2,schedule=1f1b", 4, [5, 7, 6, 3])]
ZEROS = [1, 2, 3]


def problem(dims, seed=0):
    model = ms.MLP(dims, activation="tanh")
    rng = np.random.default_rng(seed + 1)
    x = rng.standard_normal((BATCH, dims[0]))
    t = rng.standard_normal((BATCH, dims[-1]))
    return model, model.init(seed), x, t


def engine(model, params, layout, n):
    e = ms.make_engine(model, layout, comm=group_comm(n))
    e.load_checkpoint(params)
    return e


def reference(model, params):
    ref = ms.SingleDevice(model)
    ref.load_checkpoint(params)
    return ref


def padded_rows(rows, n):
    return -(-rows // n) * n


# -- plan (no MPI) ------------------------------------------------------------------------------
def test_plan_shards_parameters_only_under_zero3():
    model = ms.MLP([5, 6, 4, 3])
    for zero in (1, 2):
        plan = plan_params(model, ms.parse_layout(f"fsdp=4,zero={zero}"))
        assert all(info.placement.is_replicated_on("fsdp") for info in plan.values())
    for layout in ("fsdp=4", "fsdp=4,zero=3", "fsdp=2,tp=2"):
        plan = plan_params(model, ms.parse_layout(layout))
        assert all(info.placement.shards[-1] == pl.Shard("fsdp", 0, pad=True)
                   for info in plan.values()), layout


# -- numbers against single ---------------------------------------------------------------------
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("zero", ZEROS)
@pytest.mark.parametrize("base,n,dims", CASES)
def test_matches_single(base, n, dims, zero):
    model, params, x, t = problem(dims)
    ref = reference(model, params)
    e = engine(model, params, f"{base},zero={zero}", n)
    what = f"{base},zero={zero}"
    assert_dicts_close(e.gather_params(), params, what=f"{what} params")
    xl, tl = e.shard_batch(x), e.shard_batch(t)
    assert_close(e.gather_batch(e.predict(xl)), ref.predict(x), what=f"{what} predict")

    loss_ref, g_ref = ref.train_step(x, t, ms.losses.MSE())
    loss, grads = e.train_step(xl, tl, ms.losses.MSE())
    assert_close(loss, loss_ref, what=f"{what} loss")
    assert_dicts_close(e.gather_grads(grads), g_ref, what=f"{what} grads")

    # this rank's gradient block is exactly its slice of single's, with zero padding
    sizes = {a: e.mesh.size(a) for a in e.layout.sizes}
    for name, g in grads.items():
        placement = e.grad_placements[name]
        assert g.shape == pl.local_shape(e.full_shapes[name], placement, sizes)
        ranges, _ = pl.local_slices(e.full_shapes[name], placement, sizes, e.mesh.coords)
        want = pl.shard_array(g_ref[name], placement, sizes, e.mesh.coords)
        assert_close(g, want, what=f"{what} local {name}")
        real = tuple(slice(0, b - a) for a, b in ranges)
        pad = np.ones(g.shape, dtype=bool)
        pad[real] = False
        assert not np.any(g[pad]), f"{name}: padding of the gradient block is not zero"

    # the forward/backward API gives the same (under pp the output lives on the last stage)
    y = e.forward(xl)
    assert_close(e.gather_batch(y), ref.forward(x), what=f"{what} forward")
    dy = None if y is None else ms.losses.MSE()(y, tl)[1]
    assert_dicts_close(e.gather_grads(e.backward(dy)), g_ref, what=f"{what} backward")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("zero", ZEROS)
@pytest.mark.parametrize("base,n", [("fsdp=2", 2), ("dp=2,fsdp=2", 4)])
def test_gradient_accumulation(base, n, zero):
    """Two micro-steps (grad_scale 1/2, sync on the last) give the full batch's gradient.
    ZeRO-1 communicates nothing before the sync (like dp); ZeRO-2/3 reduce-scatter each
    micro-step but leave the dp all-reduce to the sync."""
    model, params, x, t = problem([5, 7, 3])
    _, g_ref = reference(model, params).train_step(x, t, ms.losses.MSE())
    e = engine(model, params, f"{base},zero={zero}", n)
    xl, tl = e.shard_batch(x), e.shard_batch(t)
    half = xl.shape[0] // 2
    e.train_step(xl[half:], tl[half:], "mse", grad_scale=0.5)   # a step to be forgotten
    e.reset_comm_stats()
    e.train_step(xl[:half], tl[:half], "mse", grad_scale=0.5, sync=False)
    if zero == 1:
        assert sum(e.comm_bytes.values()) == 0, dict(e.comm_bytes)
    else:
        assert e.comm_bytes["all_reduce"] == 0 and e.comm_bytes["reduce_scatter"] > 0
    _, grads = e.train_step(xl[half:], tl[half:], "mse", grad_scale=0.5, accumulate=True)
    assert_dicts_close(e.gather_grads(grads), g_ref, what=f"{base},zero={zero} accumulated")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("zero", ZEROS)
@pytest.mark.parametrize("base,n,dims", [c for c in CASES if c[1] <= 4])
def test_adamw_steps_match_single(base, n, dims, zero):
    """Three steps of clipped AdamW: parameters (and the clipping norm) equal single's."""
    model, params, x, t = problem(dims)
    ref = reference(model, params)
    e = engine(model, params, f"{base},zero={zero}", n)
    opts = [ms.optim.AdamW(m, lr=0.05, weight_decay=0.1) for m in (ref, e)]
    xl, tl = e.shard_batch(x), e.shard_batch(t)
    for step in range(3):
        ref.train_step(x, t, "mse")
        _, grads = e.train_step(xl, tl, "mse")
        norm_ref = ms.optim.clip_grad_norm(ref, ref.grads, max_norm=0.05)
        norm = ms.optim.clip_grad_norm(e, grads, max_norm=0.05)
        assert_close(norm, norm_ref, what=f"step {step} norm")
        assert norm_ref > 0.05                                 # clipping is active
        opts[0].step(ref.grads)
        opts[1].step(grads)
    assert_dicts_close(e.gather_params(), ref.gather_params(), what=f"{base},zero={zero} AdamW")


# -- prefetch=1: the next layer's all_gather issued before the current layer computes -----------
# two or more layers per chunk, so every chunk has a next layer to prefetch
PREFETCH_CASES = [("fsdp=2", 2, [5, 7, 6, 3]), ("fsdp=4", 4, [5, 7, 6, 3]),
                  ("fsdp=8", 8, [5, 7, 6, 3]), ("fsdp=2,tp=2", 4, [5, 6, 4, 3]),
                  ("dp=2,fsdp=2", 4, [5, 7, 6, 3]),
                  ("fsdp=2,pp=2,microbatches=2,schedule=1f1b", 4, [5, 7, 6, 4, 3]),
                  ("fsdp=2,pp=2,microbatches=2,schedule=interleaved", 4,
                   [5, 7, 6, 4, 6, 5, 4, 7, 3]),
                  ("fsdp=2,pp=2,tp=2,microbatches=2,schedule=gpipe", 8, [5, 6, 4, 6, 4, 3])]


def expected_prefetches(e, forward_passes, backward_passes):
    """Tensors a replayed plan prefetches: in a forward pass every layer's parameters but the
    first layer's; in a backward pass every gathering layer's weight but the last layer's (a
    Linear's backward gathers only its weight, the model's first layer nothing: no dx)."""
    total = 0
    for chunk in e.chunks:
        layers = [layer for layer in chunk if layer.param_names]
        total += forward_passes * sum(len(layer.param_names) for layer in layers[1:])
        gathering = [layer for layer in layers if layer.need_dx]
        total += backward_passes * max(len(gathering) - 1, 0)
    return total


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("base,n,dims", PREFETCH_CASES)
def test_prefetch_matches_no_prefetch_and_single(base, n, dims):
    """prefetch=1 gives bit-identical predictions, losses, gradients and 3 clipped AdamW steps
    to prefetch=0 (and single's within rtol 1e-9), with the same collectives and bytes; and
    it does prefetch: after the first pass of each chunk, every next layer."""
    model, params, x, t = problem(dims)
    ref = reference(model, params)
    e0, e1 = (engine(model, params, f"{base},prefetch={p}", n) for p in (0, 1))
    opts = [ms.optim.AdamW(m, lr=0.05, weight_decay=0.1) for m in (ref, e0, e1)]
    xl, tl = e1.shard_batch(x), e1.shard_batch(t)
    y0, y1 = (e.gather_batch(e.predict(xl)) for e in (e0, e1))   # records the forward plans
    assert np.array_equal(y1, y0), "predict differs"
    assert_close(y1, ref.predict(x), what=f"{base} prefetch predict")
    for step in range(3):
        loss_ref, _ = ref.train_step(x, t, "mse")
        for e in (e0, e1):
            e.reset_comm_stats()
        (l0, g0), (l1, g1) = (e.train_step(xl, tl, "mse") for e in (e0, e1))
        assert dict(e1.comm_bytes) == dict(e0.comm_bytes), step     # same collectives, earlier
        assert dict(e1.comm_calls) == dict(e0.comm_calls), step
        assert l1 == l0, (step, l1, l0)
        assert_close(l1, loss_ref, what=f"{base} step {step} loss")
        for name in g0:
            assert np.array_equal(g1[name], g0[name]), f"step {step} {name}: grads differ"
        assert_dicts_close(e1.gather_grads(g1), ref.grads, what=f"{base} step {step} grads")
        norms = [ms.optim.clip_grad_norm(m, m.grads, max_norm=0.05) for m in (ref, e0, e1)]
        assert norms[2] == norms[1] and norms[0] > 0.05
        for opt, m in zip(opts, (ref, e0, e1)):
            opt.step(m.grads)
    for name in e0.params:
        assert np.array_equal(e1.params[name], e0.params[name]), f"{name}: params differ"
    assert_dicts_close(e1.gather_params(), ref.gather_params(), what=f"{base} prefetch AdamW")
    m = e1.layout.option("microbatches", e1.layout.size("pp")) if e1.layout.size("pp") > 1 else 1
    counts = e1.access.prefetcher.counts      # predict recorded the forward plans, the first
    want = expected_prefetches(e1, 3 * m, 3 * m - 1)   # backward pass the backward plans
    assert (counts["issued"], counts["used"], counts["wasted"]) == (want, want, 0), counts
    assert want > 0


@pytest.mark.mpi(min_size=2)
def test_prefetch_memory_is_two_layers():
    """gathered_peak: one layer's gathered weight + bias without prefetch, the largest pair of
    consecutive layers with it (the next layer is gathered while the current one is used)."""
    n = 2
    model, params, x, t = problem(MEM_DIMS)
    layer = [shape_bytes(w, padded_rows(w[0], n)) + shape_bytes(b, padded_rows(b[0], n))
             for w, b in zip(*[iter(model.param_shapes().values())] * 2)]
    peaks = {}
    for p in (0, 1):
        e = engine(model, params, f"fsdp={n},prefetch={p}", n)
        for _ in range(2):                       # the first step records the plans
            e.train_step(e.shard_batch(x), e.shard_batch(t), "mse")
        peaks[p] = e.memory_report()["gathered_peak"]
        assert e.access.live_bytes == 0, "gathered bytes left alive after the step"
    assert peaks[0] == max(layer)
    assert peaks[1] == max(a + b for a, b in zip(layer, layer[1:])) <= 2 * max(layer)


@pytest.mark.mpi(min_size=2)
def test_prefetch_departing_from_the_plan_gives_the_same_numbers():
    """A plan that does not match the pass (here: corrupted to prefetch every parameter of
    the chunk at its first gather) costs bytes, never numbers: unused prefetches are completed
    and dropped at the pass's end, and the next step relearns the plan."""
    model, params, x, t = problem([5, 7, 6, 3])
    e0, e1 = (engine(model, params, f"fsdp=2,prefetch={p}", 2) for p in (0, 1))
    xl, tl = e1.shard_batch(x), e1.shard_batch(t)
    for e in (e0, e1):
        e.train_step(xl, tl, "mse")                              # records the plans
    pre = e1.access.prefetcher
    names = tuple(reversed(list(e1.params)))
    for key, (order, _) in pre.plans.items():
        pre.plans[key] = (order, {0: names})
    for step in range(2):
        for e in (e0, e1):
            e.reset_comm_stats()
        before = pre.counts["wasted"]
        (l0, g0), (l1, g1) = (e.train_step(xl, tl, "mse") for e in (e0, e1))
        assert l1 == l0 and all(np.array_equal(g1[k], g0[k]) for k in g0), step
        wasted = pre.counts["wasted"] - before
        extra = e1.comm_bytes["all_gather"] - e0.comm_bytes["all_gather"]
        if step == 0:
            assert wasted > 0 and extra > 0, (wasted, extra)
        else:                                                    # relearned
            assert wasted == 0 and extra == 0, (wasted, extra)
    assert e1.access.live_bytes == 0 and not pre.pending


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("zero", [1, 2])
def test_prefetch_needs_zero3(zero):
    """ZeRO-1/2 keep parameters replicated: nothing to prefetch, so prefetch=1 is refused."""
    model, params, _, _ = problem([5, 7, 3])
    with pytest.raises(ValueError, match=f"prefetch=1 needs zero=3, got zero={zero}"):
        ms.make_engine(model, f"fsdp=2,zero={zero},prefetch=1", comm=group_comm(2))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("axis", [0, 1])
def test_all_gather_async_matches_all_gather(axis):
    """engine.all_gather_async (Iallgather) returns what all_gather does and counts the same
    bytes under 'all_gather'."""
    e = ms.make_engine(ms.MLP([4, 3]), "fsdp=2", comm=group_comm(2))
    r = e.mesh.coord("fsdp")
    a = np.arange(12, dtype=np.float64).reshape(3, 4) * (r + 1)
    futures = [e.all_gather_async(a + k, axis=axis, group="fsdp") for k in range(3)]
    e.reset_comm_stats()
    want = [e.all_gather(a + k, axis=axis, group="fsdp") for k in range(3)]
    sync_bytes = e.comm_bytes["all_gather"]
    e.reset_comm_stats()
    e.all_gather_async(a, axis=axis, group="fsdp").result()
    assert e.comm_bytes["all_gather"] * 3 == sync_bytes > 0
    for f, w in zip(futures, want):                        # three in flight at once
        got = f.result()
        assert got.shape == w.shape == ((6, 4) if axis == 0 else (3, 8))
        assert np.array_equal(got, w)


# -- memory --------------------------------------------------------------------------------------
MEM_DIMS = [10, 30, 18, 5]      # rows 10, 30, 18 and biases 30, 18, 5: none divides by 4


def shape_bytes(shape, rows=None):
    rows = shape[0] if rows is None else rows
    return 8 * rows * math.prod(shape[1:])


@pytest.mark.mpi(min_size=4)
def test_memory_report():
    n = 4
    model, params, x, t = problem(MEM_DIMS)
    shapes = model.param_shapes()
    full = sum(shape_bytes(s) for s in shapes.values())                       # P
    padded = sum(shape_bytes(s, padded_rows(s[0], n)) for s in shapes.values())
    shard = {k: shape_bytes(s, padded_rows(s[0], n) // n) for k, s in shapes.items()}
    slices = sum(shard.values())                                              # one shard each
    reports, during = {}, {}
    for layout in ("dp=4", "fsdp=4,zero=1", "fsdp=4,zero=2", "fsdp=4,zero=3"):
        e = engine(model, params, layout, n)
        opt = ms.optim.AdamW(e, lr=0.01)
        seen = []   # gradient bytes the engine holds each time a layer's gradient is done
        sync = e.access.grad_ready          # the access policy reports each final gradient
        e.access.grad_ready = lambda name, e=e, seen=seen, sync=sync: (
            seen.append(e.memory_report()["grads"]), sync(name))
        e.train_step(e.shard_batch(x), e.shard_batch(t), "mse")
        opt.step(e.grads)
        reports[layout], during[layout] = e.memory_report(opt), max(seen)
        if e.device_id == 0:
            print(layout, reports[layout], "grads held during backward", during[layout])
    dp, z1, z2, z3 = reports.values()
    assert (dp["params"], dp["grads"], dp["optimizer"]) == (full, full, 2 * full)
    assert dp["gathered_peak"] == 0
    # ZeRO-1: optimizer state 1/N; full gradients still held during the backward
    assert (z1["params"], z1["grads"], z1["optimizer"]) == (padded, padded + slices, 2 * slices)
    assert during["fsdp=4,zero=1"] == padded + slices
    # ZeRO-2: gradients 1/N too, and never a full gradient held after a layer's backward
    assert (z2["params"], z2["grads"], z2["optimizer"]) == (padded, slices, 2 * slices)
    assert during["fsdp=4,zero=2"] == slices < full
    # ZeRO-3: everything 1/N, plus one layer's gathered weight and bias at a time
    assert (z3["params"], z3["grads"], z3["optimizer"]) == (slices, slices, 2 * slices)
    assert during["fsdp=4,zero=3"] == slices
    layer = [shape_bytes(s, padded_rows(s[0], n)) for s in shapes.values()]
    assert z3["gathered_peak"] == max(w + b for w, b in zip(layer[0::2], layer[1::2]))
    # the bound: at most 1/N of dp's plus one padded shard per tensor (param, grad,
    # and the two AdamW moments are each a tensor)
    held = {k: r["params"] + r["grads"] + r["optimizer"] for k, r in reports.items()}
    assert held["fsdp=4,zero=3"] <= held["dp=4"] / n + 4 * slices
    assert z1["optimizer"] <= dp["optimizer"] / n + 2 * slices
    assert z2["grads"] <= dp["grads"] / n + slices


# -- communication -------------------------------------------------------------------------------
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("dims,bias", [([8, 16, 8], False), (MEM_DIMS, True)])
def test_comm_bytes_per_step(n, dims, bias):
    """Bytes sent per rank in one step (train_step + the optimizer's after_optimizer_step),
    against the ring formulas. The 8-byte loss all-reduce is every layout's, and removed."""
    model = ms.MLP(dims, activation="tanh", bias=bias)
    params = model.init(0)
    rng = np.random.default_rng(0)
    x, t = rng.standard_normal((BATCH, dims[0])), rng.standard_normal((BATCH, dims[-1]))
    shapes = model.param_shapes()
    P = sum(shape_bytes(s) for s in shapes.values())
    Ppad = sum(shape_bytes(s, padded_rows(s[0], n)) for k, s in shapes.items())
    W0 = shape_bytes(shapes["layer_0/weights"], padded_rows(dims[0], n))
    Wpad = sum(shape_bytes(s, padded_rows(s[0], n)) for k, s in shapes.items() if "weights" in k)
    ring = (n - 1) / n
    loss = 2 * ring * 8
    sent = {}
    for layout in (f"dp={n}", f"fsdp={n},zero=1", f"fsdp={n},zero=2", f"fsdp={n},zero=3"):
        e = engine(model, params, layout, n)
        e.reset_comm_stats()
        e.train_step(e.shard_batch(x), e.shard_batch(t), "mse")
        e.after_optimizer_step()
        got = {k: v for k, v in e.comm_bytes.items() if v}
        got["all_reduce"] = got.get("all_reduce", 0) - loss
        sent[layout] = {k: v for k, v in got.items() if abs(v) > 1e-9}
    want = {f"dp={n}": {"all_reduce": 2 * ring * P},
            f"fsdp={n},zero=1": {"reduce_scatter": ring * Ppad, "all_gather": ring * Ppad},
            f"fsdp={n},zero=2": {"reduce_scatter": ring * Ppad, "all_gather": ring * Ppad},
            f"fsdp={n},zero=3": {"all_gather": ring * (Ppad + Wpad - W0),   # forward +
                                 "reduce_scatter": ring * Ppad}}     # backward but layer 0's
    for layout in want:
        assert sent[layout].keys() == want[layout].keys(), (layout, sent[layout])
        for k, v in want[layout].items():
            assert sent[layout][k] == pytest.approx(v, rel=1e-12), (layout, k)
    if not bias and all(d % n == 0 for d in dims):     # no padding: the chapter's ratios
        dp = sent[f"dp={n}"]["all_reduce"]            # (ZeRO-3: 1.5 less layer 0's weight)
        for z, ratio in ((1, 1.0), (2, 1.0), (3, 1.5 - W0 / (2 * P))):
            assert sum(sent[f"fsdp={n},zero={z}"].values()) == pytest.approx(ratio * dp)


# -- the example -----------------------------------------------------------------------------------
def test_example_runs_at_two_ranks():
    result = run_mpi(2, ROOT / "examples" / "fsdp_train.py", "--steps", "2", timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "zero=3" in result.stdout and "matches single" in result.stdout, result.stdout
