"""Every strategy composed on an N-D mesh against the single-device reference (float64).

For each layout: forward output, loss and every gradient after one step, then 5 AdamW steps
with clipping give the same losses and parameters as `single` (rtol 1e-9).
"""
import numpy as np
import pytest

import mpishard as ms
from conftest import assert_close, assert_dicts_close, group_comm, run_mpi, single_reference

MLP_LAYOUTS = [
    # (world size, layout)
    (8, "dp=2,tp=2,pp=2"),
    (8, "fsdp=2,tp=2,pp=2"),
    (8, "dp=2,tp=4"),
    (8, "tp=2,pp=4"),
    (8, "dp=4,pp=2"),
    (8, "fsdp=4,tp=2"),
    (8, "dp=2,fsdp=2,tp=2"),
    (8, "fsdp=2,pp=2,tp=2,schedule=gpipe,microbatches=4"),
    (8, "dp=2,pp=2,tp=2,schedule=interleaved,virtual_stages=2,microbatches=2,stages=2+1+2+1"),
    (8, "fsdp=2,tp=2,pp=2,zero=1"),
    (8, "dp=2,fsdp=2,pp=2,zero=2"),
    (4, "dp=2,pp=2"),
    (4, "fsdp=2,tp=2"),
    (4, "tp=2,pp=2,schedule=gpipe"),
    (2, "fsdp=2,zero=3"),
]


def _data(rng, batch, d_in, d_out, classes=False):
    x = rng.standard_normal((batch, d_in))
    if classes:
        return x, rng.integers(0, d_out, size=batch).astype(np.int64)
    return x, rng.standard_normal((batch, d_out))


def _train(engine, x, t, loss, steps, clip=0.5):
    opt = ms.optim.AdamW(engine, lr=0.01, weight_decay=0.01)
    losses = []
    xl, tl = engine.shard_batch(x), engine.shard_batch(t)
    for _ in range(steps):
        value, grads = engine.train_step(xl, tl, loss)
        ms.optim.clip_grad_norm(engine, grads, max_norm=clip)
        opt.step(grads)
        losses.append(value)
    return losses


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("n,layout", MLP_LAYOUTS, ids=[lt for _, lt in MLP_LAYOUTS])
def test_layout_matches_single(n, layout):
    comm = group_comm(n)
    rng = np.random.default_rng(7)
    # 6 layers: tp pairs (0,1) (2,3) (4,5); hidden sizes divide by 4; widths not divisible by
    # fsdp in every dim (7, 5) so fsdp padding is exercised.
    model = ms.MLP([7, 16, 16, 8, 8, 12, 5], activation="gelu")
    params = model.init(seed=3)
    x, t = _data(rng, 16, 7, 5, classes=True)
    loss = ms.losses.CrossEntropy()

    ref, ref_loss, ref_grads = single_reference(model, params, x, t, loss)
    ref_y = ref.predict(x)

    eng = ms.make_engine(model, layout, comm=comm)
    eng.load_checkpoint(params)
    value, grads = eng.train_step(eng.shard_batch(x), eng.shard_batch(t), loss)
    assert_close(value, ref_loss, what=f"{layout} loss")
    assert_dicts_close(eng.gather_grads(grads), ref_grads, what=f"{layout} grad")
    y = eng.gather_batch(eng.predict(eng.shard_batch(x)))
    assert_close(y, ref_y, what=f"{layout} forward")
    full = eng.gather_params()
    for k in params:
        assert np.array_equal(full[k], params[k]), f"{layout}: gather_params {k} not bit-exact"

    # 5 AdamW steps with clipping
    ref2 = ms.SingleDevice(model)
    ref2.load_checkpoint(params)
    ref_losses = _train(ref2, x, t, loss, 5)
    eng2 = ms.make_engine(model, layout, comm=comm)
    eng2.load_checkpoint(params)
    losses = _train(eng2, x, t, loss, 5)
    assert_close(np.array(losses), np.array(ref_losses), what=f"{layout} loss curve")
    assert_dicts_close(eng2.gather_params(), ref2.gather_params(), what=f"{layout} params")


@pytest.mark.mpi(min_size=4)
def test_moe_ep_dp_matches_single():
    comm = group_comm(4)
    rng = np.random.default_rng(11)
    model = ms.MoE(d_model=6, d_hidden=8, n_experts=4, top_k=2, capacity_factor=2.0)
    params = model.init(seed=5)
    x, t = _data(rng, 16, 6, 6)
    loss = ms.losses.MSE()
    ref_model = ms.MoE(d_model=6, d_hidden=8, n_experts=4, top_k=2, capacity_factor=2.0,
                       groups=4)  # the same token groups (and drops) as 4 data-parallel ranks
    ref = ms.SingleDevice(ref_model)
    ref.load_checkpoint(params)
    ref_losses = _train(ref, x, t, loss, 5)
    eng = ms.make_engine(model, "ep=2,dp=2", comm=comm)
    eng.load_checkpoint(params)
    losses = _train(eng, x, t, loss, 5)
    assert_close(np.array(losses), np.array(ref_losses), what="ep=2,dp=2 loss curve")
    assert_dicts_close(eng.gather_params(), ref.gather_params(), what="ep=2,dp=2 params")


BAD = [
    ("dp=2,dp=2", ms.MLP([4, 8, 4]), "given twice"),
    ("dp=2,xx=2", ms.MLP([4, 8, 4]), "unknown axis"),
    ("ep=2", ms.MLP([4, 8, 4]), "MoE"),
    ("tp=2", ms.MLP([4, 5, 6, 4]), "does not divide the hidden size 5"),
    ("dp=4", ms.MLP([4, 8, 4]), "needs dp=4 = 4 ranks, but the world size is 2"),
]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("layout,model,needle", BAD, ids=[b[0] for b in BAD])
def test_bad_layouts_raise_everywhere(layout, model, needle):
    comm = group_comm(2)
    with pytest.raises(ValueError, match=needle) as err:
        ms.make_engine(model, layout, comm=comm)
    msgs = comm.allgather(str(err.value))
    assert len(set(msgs)) == 1, msgs
    print(msgs[0])


PLAN_LAYOUTS = [(8, "dp=2,tp=2,pp=2"), (8, "fsdp=2,tp=2,pp=2"), (8, "fsdp=4,tp=2,zero=2"),
                (4, "fsdp=4,zero=1"), (4, "tp=2,pp=2"), (2, "dp=2")]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("n,layout", PLAN_LAYOUTS, ids=[lt for _, lt in PLAN_LAYOUTS])
def test_inspect_plan_matches_running_engine(n, layout):
    """What `inspect --layout` predicts per rank is what the running engine holds."""
    from mpishard.costs.rank_costs import rank_memory

    comm = group_comm(n)
    model = ms.MLP([7, 16, 16, 8, 5], activation="relu")
    eng = ms.make_engine(model, layout, comm=comm)
    eng.load_checkpoint(model.init(seed=0))
    opt = ms.optim.AdamW(eng, lr=1e-3)
    x, t = _data(np.random.default_rng(0), 16, 7, 5)
    _, grads = eng.train_step(eng.shard_batch(x), eng.shard_batch(t), ms.losses.MSE())
    opt.step(grads)
    held = eng.memory_report(opt)
    plan = rank_memory(model, ms.parse_layout(layout), comm.Get_rank(), itemsize=8,
                       optimizer="adamw")
    print(layout, comm.Get_rank(), held, {k: v for k, v in plan.items() if k != "shapes"})
    assert held["params"] == plan["parameters"]
    assert held["grads"] == plan["gradients"]
    assert held["optimizer"] == plan["optimizer"]
    for name, shape in plan["shapes"].items():
        assert tuple(eng.params[name].shape) == shape, name


def test_inspect_cli_prints_mesh_shards_and_memory():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "mpishard", "inspect", "--layout",
                          "dp=2,tp=2,pp=2", "--model", "64,256,256,10"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "tp=2 groups: [0,1] [2,3] [4,5] [6,7]" in text
    assert "dp=2 groups: [0,4] [1,5] [2,6] [3,7]" in text
    assert "layer_0/weights                    64x256 -> 64x128 on ranks 0,1,4,5" in text
    assert "memory per rank" in text
    bad = subprocess.run([sys.executable, "-m", "mpishard", "inspect", "--layout", "tp=3",
                          "--model", "64,256,10"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2
    assert bad.stderr.strip().count("\n") == 0 and "does not divide" in bad.stderr


def test_inspect_refuses_a_schedule_the_engine_refuses():
    """inspect --layout prints only layouts the engine builds: interleaved 1F1B needs
    microbatches to be a multiple of pp (make_schedule), which plan_params alone misses."""
    from mpishard.cli.inspect import layout_report

    model = ms.MLP([8, 8, 8, 8, 4])
    with pytest.raises(ValueError, match=r"microbatches \(3\) to be a multiple of pp \(2\)"):
        layout_report(model, ms.parse_layout("pp=2,schedule=interleaved,microbatches=3"))
    report = layout_report(model, ms.parse_layout("pp=2,schedule=interleaved,microbatches=4"))
    assert "memory per rank" in report


def test_cli_digits_dp_tp_pp_matches_single(tmp_path):
    """The CLI trains digits under dp=2,tp=2,pp=2 to the same loss curve and accuracy as
    single (float64)."""
    import json

    args = ["-m", "mpishard", "train", "--dataset", "digits", "--model", "64,32,32,10",
            "--optimizer", "adamw", "--lr", "0.003", "--batch", "32", "--steps", "40",
            "--clip", "1.0", "--dtype", "float64", "--no-progress"]
    runs = {}
    for n, layout in ((1, "single"), (8, "dp=2,tp=2,pp=2")):
        path = tmp_path / f"{n}.json"
        r = run_mpi(n, *args, "--layout", layout, "--metrics-json", path, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        runs[layout] = json.loads(path.read_text())
    a, b = runs["single"], runs["dp=2,tp=2,pp=2"]
    assert len(a["loss_history"]) == len(b["loss_history"]) == 40
    assert_close(np.array(b["loss_history"]), np.array(a["loss_history"]), what="loss curve")
    assert b["test_accuracy"] == a["test_accuracy"]
