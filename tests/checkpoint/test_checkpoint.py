"""Checkpoints: reshard on load, exact resume, crash consistency, corruption, safetensors, CLI.

    pytest -m "not mpi" tests/checkpoint/test_checkpoint.py
    mpiexec -n 4 python -m mpi4py -m pytest --with-mpi -m mpi tests/checkpoint/test_checkpoint.py

The cross-layout test saves under dp=2,tp=2 on a group of 4 ranks and restores on the same
ranks under pp=2 and tp=2 (groups of 2), fsdp=4 (ZeRO-3 and ZeRO-2), single (each rank alone)
and dp=2,tp=2 again. The serial tests run mpiexec in subprocesses (a rank killed mid-save, the
train --checkpoint-dir/--resume CLI, the example).
"""
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

import mpishard as ms
from mpishard.checkpoint import Checkpointer, CheckpointError, LazyArray, resume
from mpishard.train.data import synthetic_classification
from mpishard.train.lr import cosine_schedule
from mpishard.train.optim import SGD, AdamW
from mpishard.train.trainer import Trainer

from conftest import assert_close, assert_dicts_close, group_comm, run_mpi, world

ROOT = Path(__file__).resolve().parents[2]
DIMS = [6, 8, 8, 3]          # fsdp=4 pads W0's 6 rows and the 3-wide bias; tp=2 divides 8
STEPS, CUT = 10, 4


def make_trainer(layout, comm, steps=STEPS, optimizer="adamw", dims=DIMS):
    """AdamW (or SGD with momentum) + cosine schedule + clipping + accumulation, float64."""
    data = synthetic_classification(128, 32, d_in=dims[0], n_classes=dims[-1], seed=3)
    model = ms.MLP(dims, activation="tanh")
    e = ms.SingleDevice(model) if layout == "single" else \
        ms.make_engine(model, layout, comm=comm)
    e.load_checkpoint(model.init(seed=5))
    opt = AdamW(e, lr=0.02, weight_decay=0.05) if optimizer == "adamw" else \
        SGD(e, lr=0.05, momentum=0.9, weight_decay=0.01)
    return Trainer(e, opt, data, batch=16, steps=steps, accumulate=2, clip=0.5,
                   schedule=cosine_schedule(0.02, steps, warmup_steps=2), progress=False,
                   log_every=0, seed=11)


def shared_tmpdir(comm):
    return comm.bcast(tempfile.mkdtemp(prefix="mpishard-ckpt-") if comm.Get_rank() == 0
                      else None, root=0)


def host_params(engine):
    return {k: np.array(engine.backend.to_host(v)) for k, v in engine.gather_params().items()}


def assert_same_checkpoint(got_path, want_path):
    """Every parameter and optimizer-state tensor identical bit for bit, same step/extra."""
    got, want = ms.checkpoint.load(got_path), ms.checkpoint.load(want_path)
    assert list(got) == list(want) and got.step == want.step and got.extra == want.extra
    for name in want:
        assert np.array_equal(np.asarray(got[name]), np.asarray(want[name])), name
        g, w = got.optimizer_state(name), want.optimizer_state(name)
        assert sorted(g) == sorted(w), name
        for key in w:
            assert np.array_equal(np.asarray(g[key]), np.asarray(w[key])), (name, key)


def dir_digest(path):
    """sha256 of every file under `path` (to show that nothing was overwritten)."""
    out = {}
    for p in sorted(Path(path).rglob("*")):
        if p.is_file():
            out[str(p.relative_to(path))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


# -- the cross-layout resume the issue asks for -------------------------------------------------
@pytest.mark.mpi(min_size=4)
def test_save_dp2tp2_restore_under_other_layouts_and_world_sizes():
    comm4 = group_comm(4)
    r = comm4.Get_rank()
    comm2 = comm4.Split(r // 2, r)
    tmp = shared_tmpdir(comm4)
    a = os.path.join(tmp, "A")

    ref = make_trainer("dp=2,tp=2", comm4)
    m_ref = ref.fit()                                  # the uninterrupted run
    p_ref = host_params(ref.engine)

    first = make_trainer("dp=2,tp=2", comm4)
    first.total_steps = CUT                            # interrupted after CUT steps
    first.callbacks.append(Checkpointer(a, every=2))   # saves at 2, then over it at 4
    first.fit()
    p_cut = host_params(first.engine)
    ck = ms.checkpoint.load(a)
    assert ck.step == CUT and ck.layout == "dp=2,tp=2" and ck.world_size == 4
    assert ck.optimizer_type == "AdamW" and not os.path.exists(a + ".old")
    assert [p for p in os.listdir(tmp) if p != "A"] == []       # no tmp dir left behind

    for layout, comm in [("dp=2,tp=2", comm4), ("pp=2", comm2), ("tp=2", comm2),
                         ("fsdp=4", comm4), ("fsdp=4,zero=2", comm4), ("single", None)]:
        # reshard on load: the full parameters, bit for bit
        t = make_trainer(layout, comm)
        lazy = ms.checkpoint.load(a)
        t.engine.load_checkpoint(lazy)
        assert_dicts_close(host_params(t.engine), p_cut, rtol=0, what=f"load under {layout}")
        if layout in ("pp=2", "tp=2"):              # each rank read only the files it needs
            n_param_files = sum(len(e["chunks"]) for e in lazy.index["tensors"].values())
            assert 0 < len(lazy._open) < n_param_files

        # exact resume, optimizer state resharded too: saving it again gives the same bytes
        t = make_trainer(layout, comm)
        assert resume(t, a) == CUT and t.state.step == CUT
        group = r // (comm.Get_size() if comm is not None else 1)
        b = os.path.join(tmp, f"B-{layout}-{group}")
        ms.checkpoint.save(b, t.engine, t.optimizer, CUT, ck.extra)
        assert_same_checkpoint(b, a)

        # continuing gives the uninterrupted loss curve (bit-identical on the same layout)
        m = t.fit()
        rtol = 0.0 if layout == "dp=2,tp=2" else 1e-9
        assert len(m["loss_history"]) == STEPS
        assert_close(m["loss_history"], m_ref["loss_history"], rtol=rtol, what=f"{layout} curve")
        assert_close(m["grad_norm_history"], m_ref["grad_norm_history"], rtol=rtol,
                     what=f"{layout} grad norms")
        assert_dicts_close(host_params(t.engine), p_ref, rtol=rtol, what=f"{layout} params")
    comm4.Barrier()
    if r == 0:
        shutil.rmtree(tmp)


@pytest.mark.mpi(min_size=2)
def test_sgd_momentum_state_under_zero1_reshards_to_single():
    """ZeRO-1 shards only optimizer state (the parameter stays replicated): saved once per
    region, it restores into a single device and continues like an uninterrupted run."""
    comm = group_comm(2)
    tmp = shared_tmpdir(comm)
    a = os.path.join(tmp, "A")
    ref = make_trainer("single", None, optimizer="sgd")
    m_ref = ref.fit()
    t = make_trainer("fsdp=2,zero=1", comm, optimizer="sgd")
    t.total_steps = CUT
    t.callbacks.append(Checkpointer(a))
    t.fit()
    ck = ms.checkpoint.load(a)
    st = ck.optimizer_state("layer_0/weights")
    assert st["step"] == CUT and st["momentum_buffer"].shape == (6, 8)
    assert len(ck.index["optimizer"]["state"]["layer_0/weights"]["tensors"]
               ["momentum_buffer"]["chunks"]) == 2                    # one per fsdp rank
    assert len(ck.index["tensors"]["layer_0/weights"]["chunks"]) == 1  # replicated: once
    s = make_trainer("single", None, optimizer="sgd")
    resume(s, a)
    assert_close(s.fit()["loss_history"], m_ref["loss_history"], rtol=1e-9, what="sgd curve")
    comm.Barrier()
    if comm.Get_rank() == 0:
        shutil.rmtree(tmp)


@pytest.mark.mpi(min_size=2)
def test_moe_experts_are_saved_by_their_owner_and_reshard():
    """Under ep=2 each expert lives on one rank: it is written once, by its owner, and a
    restored AdamW run continues identically on ep=2, dp=2 and single."""
    comm = group_comm(2)
    model = ms.MoE(4, 6, 4, top_k=2, capacity_factor=None)
    rng = np.random.default_rng(0)
    x, t = rng.standard_normal((8, 4)), rng.standard_normal((8, 4))

    def make(layout, c):
        e = ms.SingleDevice(model) if layout == "single" else ms.make_engine(model, layout,
                                                                             comm=c)
        e.load_checkpoint(model.init(seed=1))
        return e, AdamW(e, lr=0.01)

    def steps(e, opt, k):
        out = []
        for _ in range(k):
            loss, grads = e.train_step(e.shard_batch(x), e.shard_batch(t), "mse")
            opt.step(grads)
            out.append(loss)
        return out

    tmp = shared_tmpdir(comm)
    path = os.path.join(tmp, "moe")
    ref = steps(*make("ep=2", comm), 4)
    e, opt = make("ep=2", comm)
    first = steps(e, opt, 2)
    ms.checkpoint.save(path, e, opt, step=2)
    ck = ms.checkpoint.load(path)
    assert ck.model().__class__ is ms.MoE and ck.model().capacity_factor is None
    assert all(len(ck.index["tensors"][n]["chunks"]) == 1 for n in ck)
    for layout, c in [("ep=2", comm), ("dp=2", comm), ("single", None)]:
        e, opt = make(layout, c)
        assert ms.checkpoint.restore(path, e, opt) == 2
        got = first + steps(e, opt, 2)
        assert_close(got, ref, rtol=0 if layout == "ep=2" else 1e-9, what=f"moe {layout}")
    comm.Barrier()
    if comm.Get_rank() == 0:
        shutil.rmtree(tmp)


# -- corruption: a clear error on every rank, nothing overwritten, no hang ---------------------
def _damage(good, bad, how):
    shutil.copytree(good, bad)
    index = json.loads(Path(bad, "index.json").read_text())
    chunks = index["tensors"]["layer_0/weights"]["chunks"]
    victim = Path(bad, max(chunks, key=lambda c: c["offset"][1])["file"])  # the last tp rank's
    if how == "altered":
        data = bytearray(victim.read_bytes())
        data[-1] ^= 0x01                                  # one bit of the last float
        victim.write_bytes(bytes(data))
    elif how == "truncated":
        victim.write_bytes(victim.read_bytes()[:-8])
    elif how == "missing shard":
        victim.unlink()
    elif how == "missing index":
        Path(bad, "index.json").unlink()
    elif how == "other model":
        index["model"]["dims"] = [6, 12, 8, 3]
        Path(bad, "index.json").write_text(json.dumps(index))


DAMAGE = {"altered": "corrupt", "truncated": "truncated", "missing shard": "is missing",
          "missing index": "not a checkpoint", "other model": "different model"}


@pytest.mark.mpi(min_size=1)
def test_damaged_checkpoints_raise_on_every_rank():
    comm = world()
    n, r = comm.Get_size(), comm.Get_rank()
    layout = f"tp={n}" if n <= 8 else f"dp={n}"
    dims = [6, 16, 8, 3]
    tmp = shared_tmpdir(comm)
    good = os.path.join(tmp, "good")
    t = make_trainer(layout, comm, steps=2, dims=dims)
    t.fit()
    ms.checkpoint.save(good, t.engine, t.optimizer, step=2)
    before = host_params(t.engine)
    for how, message in DAMAGE.items():
        bad = os.path.join(tmp, how.replace(" ", "-"))
        if r == 0:
            _damage(good, bad, how)
        comm.Barrier()
        digest = dir_digest(bad)
        e = make_trainer(layout, comm, steps=2, dims=dims)
        with pytest.raises(CheckpointError, match=message):
            ms.checkpoint.restore(bad, e.engine, e.optimizer)     # every rank raises
        assert_dicts_close(host_params(e.engine), host_params(make_trainer(
            layout, comm, steps=2, dims=dims).engine), rtol=0, what=f"{how}: engine untouched")
        assert e.optimizer.state == {}
        if how != "altered":                                      # found without reading data
            with pytest.raises(CheckpointError, match=message):
                ms.checkpoint.load(bad, model=e.engine.model)
        else:
            with pytest.raises(CheckpointError, match=message):   # collective verification
                ms.checkpoint.load(bad, comm=e.engine)
        assert dir_digest(bad) == digest
        comm.Barrier()
    # the good one is intact and still restores; a model of other dims is refused
    restored = make_trainer(layout, comm, steps=2, dims=dims)
    assert ms.checkpoint.restore(good, restored.engine, restored.optimizer) == 2
    assert_dicts_close(host_params(restored.engine), before, rtol=0, what="good restore")
    other = make_trainer(layout, comm, steps=2, dims=[6, 16, 4, 3])
    with pytest.raises(CheckpointError, match="different model"):
        ms.checkpoint.restore(good, other.engine, other.optimizer)
    with pytest.raises(ValueError, match="shape"):
        other.engine.load_checkpoint(ms.checkpoint.load(good))    # no collective: shapes
    # a save that cannot happen (a directory that is not a checkpoint) touches nothing
    if r == 0:
        os.mkdir(os.path.join(tmp, "notes"))
        Path(tmp, "notes", "keep.txt").write_text("mine")
    comm.Barrier()
    with pytest.raises(CheckpointError, match="not a checkpoint"):
        ms.checkpoint.save(os.path.join(tmp, "notes"), t.engine, t.optimizer, step=3)
    with pytest.raises(CheckpointError, match="JSON"):
        ms.checkpoint.save(good, t.engine, t.optimizer, step=3, extra={"x": object()})
    assert Path(tmp, "notes", "keep.txt").read_text() == "mine"
    assert ms.checkpoint.load(good).step == 2
    comm.Barrier()
    if r == 0:
        shutil.rmtree(tmp)


# -- serial: the lazy mapping ------------------------------------------------------------------
def _single_checkpoint(path, dims=(6, 8, 8, 3), seed=1, layout="single", **kw):
    model = ms.MLP(list(dims), activation="tanh")
    e = ms.SingleDevice(model)
    e.load_checkpoint(model.init(seed=seed))
    ms.checkpoint.save(path, e, **kw)
    return model, model.init(seed=seed)


def test_lazy_arrays_slice_like_numpy_and_read_only_what_is_asked(tmp_path):
    model, params = _single_checkpoint(tmp_path / "c", step=3, extra={"rng": [1, 2]})
    ck = ms.checkpoint.load(tmp_path / "c")
    assert ck.step == 3 and ck.extra == {"rng": [1, 2]} and set(ck) == set(params)
    w = ck["layer_0/weights"]
    assert isinstance(w, LazyArray) and w.shape == (6, 8) and w.dtype == np.float64
    assert ck._open == {}                                  # nothing read yet
    full = params["layer_0/weights"]
    for key in [np.s_[1:4, 2:7], np.s_[..., 3], np.s_[-1], np.s_[::2, ::-3], np.s_[5:1:-2, :],
                np.s_[2:2], np.s_[:, 7], np.s_[...]]:
        assert np.array_equal(w[key], full[key]), key
    assert np.array_equal(np.asarray(ck["layer_1/bias"]), params["layer_1/bias"])
    assert sorted(ck._open) == sorted(c["file"] for c in ck.index["tensors"]["layer_0/weights"]
                                      ["chunks"] + ck.index["tensors"]["layer_1/bias"]["chunks"])
    assert ck.model().dims == model.dims
    # the index is JSON, the shards plain .npy without pickled objects
    index = json.loads((tmp_path / "c" / "index.json").read_text())
    for f in index["files"]:
        np.load(tmp_path / "c" / f, allow_pickle=False)


def test_lazy_array_assembles_a_region_from_several_shards(tmp_path):
    """Chunks of uneven shapes written by hand: slices crossing chunk borders, and a slice
    inside one chunk opens (and hashes) only that chunk's file."""
    model, params = _single_checkpoint(tmp_path / "c")
    ck = ms.checkpoint.load(tmp_path / "c")
    index = ck.index
    full = params["layer_0/weights"]
    os.remove(tmp_path / "c" / index["tensors"]["layer_0/weights"]["chunks"][0]["file"])
    chunks, files = [], {}
    for i, (rows, cols) in enumerate([((0, 4), (0, 5)), ((0, 4), (5, 8)), ((4, 6), (0, 8))]):
        fname = f"part{i}.npy"
        np.save(tmp_path / "c" / fname, full[slice(*rows), slice(*cols)], allow_pickle=False)
        data = (tmp_path / "c" / fname).read_bytes()
        files[fname] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
        chunks.append({"file": fname, "offset": [rows[0], cols[0]]})
    index["tensors"]["layer_0/weights"]["chunks"] = chunks
    index["files"] = dict({k: v for k, v in index["files"].items()
                           if (tmp_path / "c" / k).exists()}, **files)
    (tmp_path / "c" / "index.json").write_text(json.dumps(index))
    ck = ms.checkpoint.load(tmp_path / "c")
    w = ck["layer_0/weights"]
    assert np.array_equal(w[:3, 6:], full[:3, 6:]) and sorted(ck._open) == ["part1.npy"]
    for key in [np.s_[2:6, 3:7], np.s_[3], np.s_[:, 4:6], np.s_[::-1, ::3], np.s_[...]]:
        assert np.array_equal(w[key], full[key]), key
    assert w.files_for([(0, 2), (6, 8)]) == ["part1.npy"]


def test_a_malformed_index_or_misfit_chunk_is_a_checkpoint_error(tmp_path):
    """An index with a missing field, a chunk outside its array or of another dtype: a
    CheckpointError when opened (never a KeyError, never uninitialised memory read back)."""
    _single_checkpoint(tmp_path / "c")
    w0 = "layer_0/weights"

    def edit(name, fn):
        d = tmp_path / name
        shutil.copytree(tmp_path / "c", d)
        index = json.loads((d / "index.json").read_text())
        fn(index)
        (d / "index.json").write_text(json.dumps(index))
        return d

    cases = {
        "no tensors": (lambda ix: ix.pop("tensors"), "malformed index.json.*tensors"),
        "no chunks": (lambda ix: ix["tensors"][w0].pop("chunks"), "malformed.*chunks"),
        "no sha256": (lambda ix: [f.pop("sha256") for f in ix["files"].values()],
                      "malformed.*sha256"),
        "step": (lambda ix: ix.update(step="ten"), "malformed"),
        "transposed": (lambda ix: ix["tensors"][w0].update(shape=[8, 6]),
                       r"shape \(6, 8\) at offset \(0, 0\) does not fit layer_0/weights of "
                       r"shape \(8, 6\)"),
        "offset": (lambda ix: ix["tensors"][w0]["chunks"][0].update(offset=[1, 0]),
                   "does not fit"),
        "dtype": (lambda ix: ix["tensors"][w0].update(dtype="float32"),
                  "holds float64, layer_0/weights is float32"),
        # numbers that are not integers (found by test_properties: a 0.0 offset reached a
        # numpy slice as a TypeError)
        "float offset": (lambda ix: ix["tensors"][w0]["chunks"][0].update(offset=[0.0, 0]),
                         r"offset of layer_0/weights's chunk .* must be a list of integers"),
        "bool offset": (lambda ix: ix["tensors"][w0]["chunks"][0].update(offset=[False, 0]),
                        "must be a list of integers"),
        "float shape": (lambda ix: ix["tensors"][w0].update(shape=[6.0, 8]),
                        "layer_0/weights's shape must be a list of integers"),
    }
    for name, (fn, message) in cases.items():
        with pytest.raises(CheckpointError, match=message):
            ms.checkpoint.load(edit(name, fn), verify=False)
    # a block rewritten with the same byte count but another dtype (verify=False: no sha256)
    d = edit("int64", lambda ix: None)
    block = d / json.loads((d / "index.json").read_text())["tensors"][w0]["chunks"][0]["file"]
    np.save(block, np.load(block).view(np.int64), allow_pickle=False)
    with pytest.raises(CheckpointError, match="holds int64"):
        ms.checkpoint.load(d, verify=False)
    w = ms.checkpoint.load(tmp_path / "c")[w0]                   # integers index, floats don't
    assert np.array_equal(w[np.int64(-1)], np.asarray(w)[-1])
    with pytest.raises(TypeError):
        w[1.5]


def test_load_while_a_save_swaps_the_directory(tmp_path, monkeypatch):
    """A save that completes between reading the index and checking the files (another job
    saving to the same path): load retries on the new checkpoint instead of pairing the old
    index with the new files (a false 'corrupt' or 'missing' error, or mixed data)."""
    from mpishard.checkpoint import reader as checkpoint_reader

    path = tmp_path / "ck"
    _single_checkpoint(path, seed=1, step=1)
    real, calls = checkpoint_reader.read_index, []

    def read_then_swap(p):
        index = real(p)
        if not calls:
            calls.append(p)
            _single_checkpoint(path, seed=2, step=2)             # same file names, new data
        return index

    monkeypatch.setattr(checkpoint_reader, "read_index", read_then_swap)
    ck = ms.checkpoint.load(path)
    assert calls and ck.step == 2
    want = ms.MLP([6, 8, 8, 3], activation="tanh").init(seed=2)
    for name in want:
        assert np.array_equal(np.asarray(ck[name]), want[name]), name


def test_a_rank_killed_mid_save_leaves_the_previous_checkpoint(tmp_path):
    """Rank 1 writes part of a shard and SIGKILLs itself during the second save: the job ends
    with an error, the first checkpoint still loads and verifies, the next save cleans up."""
    script = tmp_path / "crash.py"
    script.write_text(CRASH_SCRIPT)
    path = tmp_path / "ck"
    proc = run_mpi(2, script, path, env={"MPISHARD_TEST_CRASH_AFTER_SHARD": "1"}, killed=True)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "save 2 finished" not in proc.stdout
    assert (tmp_path / "ck.tmp-2").is_dir()                      # the half-written one
    assert not (tmp_path / "ck.tmp-2" / "index.json").exists()
    with pytest.raises(CheckpointError, match="not a checkpoint"):
        ms.checkpoint.load(tmp_path / "ck.tmp-2")
    ck = ms.checkpoint.load(path)
    ck.verify()
    assert ck.step == 1
    params = ms.MLP([8, 16, 4]).init(seed=1)
    for k in params:
        assert np.array_equal(np.asarray(ck[k]), params[k]), k
    _single_checkpoint(path, dims=(8, 16, 4), seed=2, step=3)    # a later save cleans up
    assert sorted(os.listdir(tmp_path)) == ["ck", "crash.py"]
    assert ms.checkpoint.load(path).step == 3


CRASH_SCRIPT = '''
import os, signal, sys
import mpishard as ms
from mpi4py import MPI

path = sys.argv[1]
model = ms.MLP([8, 16, 4])
engine = ms.make_engine(model, "tp=2", comm=MPI.COMM_WORLD)
engine.load_checkpoint(model.init(seed=1))
ms.checkpoint.save(path, engine, step=1)                   # complete
engine.load_checkpoint(model.init(seed=2))
if os.environ.get("MPISHARD_TEST_CRASH_AFTER_SHARD") and MPI.COMM_WORLD.Get_rank() == 1:
    def crash(fname, arr):                                  # half a shard, then die
        with open(fname, "wb") as f:
            f.write(b"\\x93NUMPY" + bytes(40))
            f.flush()
            os.fsync(f.fileno())
        os.kill(os.getpid(), signal.SIGKILL)
    ms.checkpoint.writer.write_block = crash
ms.checkpoint.save(path, engine, step=2)
print("save 2 finished", flush=True)
'''


def test_interrupted_swap_is_recovered(tmp_path):
    """A crash between the two renames leaves only P.old: load reads it, the next save puts
    it back first, then replaces it."""
    path = tmp_path / "ck"
    _single_checkpoint(path, step=1)
    os.rename(path, str(path) + ".old")                          # the crash window
    assert ms.checkpoint.load(path).step == 1
    _single_checkpoint(path, seed=2, step=2)
    assert sorted(os.listdir(tmp_path)) == ["ck"] and ms.checkpoint.load(path).step == 2
    os.mkdir(str(path) + ".old")                                  # crash after the swap
    shutil.copy(path / "index.json", str(path) + ".old")
    _single_checkpoint(path, seed=3, step=3)
    assert sorted(os.listdir(tmp_path)) == ["ck"] and ms.checkpoint.load(path).step == 3


# -- serial: safetensors ----------------------------------------------------------------------
def test_safetensors_export_import_round_trip(tmp_path):
    model, params = _single_checkpoint(tmp_path / "c")
    out = tmp_path / "m.safetensors"
    ms.checkpoint.export_safetensors(tmp_path / "c", out)
    back = ms.checkpoint.import_safetensors(out, model)
    assert_dicts_close(back, params, rtol=0, what="mpishard names")
    ms.checkpoint.export_safetensors(params, tmp_path / "t.safetensors", names="torch",
                                     model=model)
    from safetensors.numpy import load_file

    raw = load_file(tmp_path / "t.safetensors")
    assert sorted(raw) == ["0.bias", "0.weight", "2.bias", "2.weight", "4.bias", "4.weight"]
    assert raw["0.weight"].shape == (8, 6)                        # torch: (out, in)
    assert_dicts_close(ms.checkpoint.import_safetensors(tmp_path / "t.safetensors", model),
                       params, rtol=0, what="torch names")
    with pytest.raises(ValueError, match="shape"):
        ms.checkpoint.import_safetensors(out, ms.MLP([6, 8, 4, 3]))


def _numpy_mlp(params, x, act):
    for i in range(len(params) // 2):
        x = x @ params[f"layer_{i}/weights"] + params[f"layer_{i}/bias"]
        if i < len(params) // 2 - 1:
            x = act(x)
    return x


def test_import_a_torch_layout_written_with_numpy(tmp_path):
    """The layout safetensors.torch.save_file(nn.Sequential(Linear, ReLU, Linear,...)) writes,
    produced without torch: keys '0.weight' (out, in), '0.bias', '2.weight', ..."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    dims = [5, 7, 6, 2]
    tensors = {}
    for i, (a, b) in enumerate(zip(dims[:-1], dims[1:])):
        tensors[f"{2 * i}.weight"] = rng.standard_normal((b, a))
        tensors[f"{2 * i}.bias"] = rng.standard_normal(b)
    f = tmp_path / "torch_layout.safetensors"
    save_file(tensors, str(f))
    model = ms.MLP(dims, activation="relu")
    params = ms.checkpoint.import_safetensors(f, model)
    assert np.array_equal(params["layer_1/weights"], tensors["2.weight"].T)
    e = ms.SingleDevice(model)
    e.load_checkpoint(params)
    x = rng.standard_normal((4, 5))
    want = x
    for i in range(3):
        want = want @ tensors[f"{2 * i}.weight"].T + tensors[f"{2 * i}.bias"]
        want = np.maximum(want, 0) if i < 2 else want
    assert_close(e.predict(x), want, what="numpy-written torch layout")


def test_import_a_pytorch_written_mlp_gives_pytorch_outputs(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    nn = torch.nn

    def make_net(seed):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(5, 7), nn.GELU(approximate="tanh"), nn.Linear(7, 6),
                             nn.GELU(approximate="tanh"), nn.Linear(6, 3), nn.Sigmoid()).double()

    net = make_net(0)
    f = tmp_path / "torch.safetensors"
    save_file(net.state_dict(), str(f))
    model = ms.MLP([5, 7, 6, 3], activation="gelu", final_activation="sigmoid")
    e = ms.SingleDevice(model)
    e.load_checkpoint(ms.checkpoint.import_safetensors(f, model))
    x = np.random.default_rng(1).standard_normal((8, 5))
    with torch.no_grad():
        want = net(torch.from_numpy(x)).numpy()
    assert_close(e.predict(x), want, what="pytorch MLP")
    # and back: our export with torch names loads into the same nn.Sequential
    out = tmp_path / "ours.safetensors"
    ms.checkpoint.export_safetensors(e.gather_params(), out, names="torch", model=model)
    from safetensors.torch import load_file

    net2 = make_net(1)                                 # other weights until loaded
    net2.load_state_dict(load_file(str(out)))
    with torch.no_grad():
        assert_close(net2(torch.from_numpy(x)).numpy(), want, what="round trip to pytorch")


# -- serial: the CLI and the example -----------------------------------------------------------
def test_cli_train_checkpoint_resume_and_inspect(tmp_path):
    common = ["-m", "mpishard", "train", "--dataset", "synthetic-classification", "--model",
              "16,16,4", "--steps", "10", "--batch", "16", "--dtype", "float64", "--lr", "0.01",
              "--no-progress", "--log-every", "0"]
    ck = tmp_path / "ck"
    whole = run_mpi(2, *common, "--layout", "tp=2", "--metrics-json", str(tmp_path / "a.json"))
    assert whole.returncode == 0, whole.stderr
    # a first run of 5 steps under dp=2 (constant lr, so 5 then 10 steps = 10 steps), saving
    # at 2, 4 and at its end; then 10 steps resumed under tp=2
    part = run_mpi(2, *common, "--layout", "dp=2", "--checkpoint-dir", str(ck),
                   "--checkpoint-every", "2", "--steps", "5")
    assert part.returncode == 0, part.stderr
    resumed = run_mpi(2, *common, "--layout", "tp=2", "--checkpoint-dir", str(ck), "--resume",
                      "--metrics-json", str(tmp_path / "b.json"))
    assert resumed.returncode == 0, resumed.stderr
    a, b = (json.loads((tmp_path / f).read_text()) for f in ("a.json", "b.json"))
    assert b["steps"] == 10
    assert_close(b["loss_history"], a["loss_history"], rtol=1e-9, what="CLI resumed curve")
    r = subprocess.run([sys.executable, "-m", "mpishard", "inspect", str(ck)], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    for text in ("layer_0/weights", "(16, 16)", "float64", "tp=2 (2 ranks)", "step       10",
                 "AdamW"):
        assert text in r.stdout, (text, r.stdout)
    bad = run_mpi(2, *common, "--checkpoint-dir", str(tmp_path / "none"), "--resume")
    assert bad.returncode == 2 and "holds no checkpoint" in bad.stderr
    r = subprocess.run([sys.executable, "-m", "mpishard", "inspect", str(tmp_path)], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "not a checkpoint" in r.stderr


def test_example_checkpoint_reshard(tmp_path):
    r = run_mpi(4, str(ROOT / "examples" / "checkpoint_reshard.py"), "--out", str(tmp_path),
                timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "bit for bit" in r.stdout and (tmp_path / "model.safetensors").exists()
