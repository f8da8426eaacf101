"""`plan` and `bench`: the communication model checked against the running engine.

    pytest -m "not mpi" tests/cli/test_plan_bench.py                # formulas, plan CLI, bench
    mpiexec -n {2,4,8} python -m mpi4py -m pytest --with-mpi -m mpi tests/cli/test_plan_bench.py

The MPI test runs one `train_step` and one optimizer step per layout and requires the bytes the
engine counted (`engine.comm_bytes`, per kind, per phase, on every rank) to equal
`costs.rank_costs.step_comm` (the sum of every strategy file's `step_comm`) exactly: all group
sizes here are powers of two, for which the engine's per-call ring formulas give integers.
The model widths are chosen so that fsdp pads (12 and 6 rows do not divide by 4 or 8), tp
leaves an odd last layer replicated, and a pipeline boundary falls after a column-parallel
layer (a tp-sharded activation is sent).
"""
import itertools
import json
import re
from pathlib import Path

import numpy as np
import pytest

import mpishard as ms
from mpishard import cli
from mpishard.cli import plan
from mpishard.comm.mesh import rank_of
from mpishard.costs import rank_costs as costs
from mpishard.costs.call_counts import step_calls
from mpishard.costs.rank_costs import rank_view
from mpishard.models.gpt.costs import gpt_flops
from mpishard.models.mlp.costs import model_flops

from conftest import RTOL32, assert_close, engine_lines, group_comm, run_mpi

ROOT = Path(__file__).resolve().parents[2]
BATCH = 16
ODD = [12, 16, 8, 6]          # 3 layers: under tp the last is replicated
EVEN = [10, 16, 8, 16, 6]     # 4 layers: interleaved pp=2 x 2 virtual stages, tp=4

CASES = [  # (ranks, layout, dims, dtype)
    (2, "dp=2", ODD, np.float64),
    (2, "tp=2", ODD, np.float64),
    (2, "pp=2", ODD, np.float64),
    (2, "fsdp=2", ODD, np.float64),
    (2, "fsdp=2,zero=1", ODD, np.float64),
    (2, "fsdp=2,zero=2", ODD, np.float32),
    (4, "dp=2,tp=2", ODD, np.float32),
    (4, "tp=2,pp=2", ODD, np.float64),
    (4, "fsdp=2,tp=2", ODD, np.float64),
    (4, "fsdp=4,zero=2", ODD, np.float64),
    (4, "tp=4", EVEN, np.float64),
    (4, "dp=2,pp=2,microbatches=4", ODD, np.float64),
    (4, "fsdp=2,pp=2,zero=3,microbatches=2,schedule=gpipe", ODD, np.float64),
    (4, "pp=2,tp=2,schedule=interleaved,microbatches=2", EVEN, np.float64),
    (8, "fsdp=8", ODD, np.float64),
    (8, "dp=2,fsdp=2,tp=2", ODD, np.float64),
    (8, "fsdp=2,pp=2,tp=2,zero=1", ODD, np.float64),
    (8, "dp=2,fsdp=2,pp=2,zero=2,microbatches=4", EVEN, np.float64),
]


def check_step_bytes(comm, model, layout, params, x, t, loss, dtype=np.float64) -> float:
    """One train_step and one AdamW step of `layout`: the bytes the engine counted, per kind
    and phase, equal the plan's on this rank. Returns the step's loss."""
    eng = ms.make_engine(model, layout, dtype=dtype, comm=comm)
    eng.load_checkpoint(params)
    opt = ms.optim.AdamW(eng, lr=1e-3)
    xl, tl = eng.shard_batch(x), eng.shard_batch(t)
    want = costs.step_comm(model, ms.parse_layout(layout), comm.Get_rank(), BATCH,
                           np.dtype(dtype).itemsize)

    eng.reset_comm_stats()
    value, grads = eng.train_step(xl, tl, loss)
    got_step = {k: v for k, v in eng.comm_bytes.items() if v}
    eng.reset_comm_stats()
    opt.step(grads)
    got_opt = {k: v for k, v in eng.comm_bytes.items() if v}
    print(f"{model!r} {layout} rank {comm.Get_rank()}: train_step {got_step} (plan "
          f"{want['train_step']}), optimizer {got_opt} (plan {want['optimizer']})")
    assert got_step == want["train_step"], f"{layout} rank {comm.Get_rank()}"
    assert got_opt == want["optimizer"], f"{layout} rank {comm.Get_rank()}"
    return value


def check_decoder_step(comm, model, layout) -> None:
    """A decoder's train_step and AdamW step under `layout` on random tokens: the bytes
    (check_step_bytes) and the calls per kind the engine counted equal the plan's."""
    rng = np.random.default_rng(3)
    x, t = (rng.integers(0, model.vocab_size, (BATCH, 8)) for _ in range(2))
    check_step_bytes(comm, model, layout, model.init(seed=1), x, t, "cross_entropy")
    engine = ms.make_engine(model, layout, comm=comm)
    engine.load_checkpoint(model.init(seed=1))
    opt = ms.optim.AdamW(engine, lr=1e-3)
    engine.reset_comm_stats()
    opt.step(engine.train_step(engine.shard_batch(x), engine.shard_batch(t),
                               "cross_entropy")[1])
    got = {k: v for k, v in engine.comm_calls.items() if v}
    want = step_calls(rank_view(model, engine.layout, comm.Get_rank(), 8, BATCH))
    print(f"{model!r} {layout} rank {comm.Get_rank()}: calls {got} (plan {want})")
    assert got == want


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("n,layout,dims,dtype", CASES, ids=[c[1] for c in CASES])
def test_comm_bytes_match_the_plan(n, layout, dims, dtype):
    comm = group_comm(n)
    model = ms.MLP(dims, activation="tanh")
    params = model.init(seed=1)
    rng = np.random.default_rng(5)
    x, t = rng.standard_normal((BATCH, dims[0])), rng.standard_normal((BATCH, dims[-1]))
    loss = check_step_bytes(comm, model, layout, params, x, t, ms.losses.MSE(), dtype)

    ref = ms.SingleDevice(model)          # and it was the real step
    ref.load_checkpoint(params)
    ref_loss, _ = ref.train_step(x, t, ms.losses.MSE())
    rtol = RTOL32 if np.dtype(dtype) == np.float32 else 1e-9
    assert_close(loss, ref_loss, rtol=rtol, what=f"{layout} loss")


GPT_CASES = [  # (ranks, layout, tied): a batch row is one sequence of seq_len tokens
    (2, "dp=2", False),
    (2, "dp=2,overlap=1", True),
    (2, "fsdp=2,zero=1", False),
    (2, "fsdp=2,zero=2", True),
    (2, "fsdp=2,zero=3", False),
    (2, "fsdp=2,zero=3", True),
    (2, "fsdp=2,zero=3,prefetch=1,recompute=1", False),
    (2, "pp=2", False),
    (2, "pp=2", True),
    (2, "pp=2,schedule=gpipe,microbatches=4,recompute=1", False),
    (2, "pp=2,schedule=interleaved", False),
    (2, "pp=2,schedule=interleaved", True),
    (4, "dp=2,pp=2", False),
    (4, "fsdp=2,pp=2,zero=3,microbatches=4", False),
    (4, "fsdp=2,pp=2,zero=3,microbatches=4", True),
    (4, "fsdp=2,pp=2,zero=2", True),
    (2, "tp=2", True),                          # vocab 13: padded to 14 over tp
    (4, "fsdp=2,tp=2,zero=3", False),
    (4, "tp=2,pp=2,sequence_parallel=1", True),
    (4, "fsdp=4,zero=2", False),
    (8, "dp=2,fsdp=2,pp=2,zero=3", False),
]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("n,layout,tied", GPT_CASES,
                         ids=[f"{c[1]}-tied" if c[2] else c[1] for c in GPT_CASES])
def test_gpt_comm_bytes_match_the_plan(n, layout, tied):
    """The same for ms.GPT (4 blocks, vocab 13 and d_model 6 make fsdp pad)."""
    model = ms.GPT(vocab_size=13, seq_len=8, d_model=6, n_heads=2, n_layers=4, tied=tied)
    rng = np.random.default_rng(5)
    x, t = (rng.integers(0, 13, (BATCH, 8)) for _ in range(2))
    check_step_bytes(group_comm(n), model, layout, model.init(seed=1), x, t, "cross_entropy")


def both_heads(cases):
    """Each (ranks, layout) untied and tied."""
    return [(n, lay, tied) for n, lay in cases for tied in (False, True)]


GPT_TP_CP_CASES = both_heads([  # (ranks, layout): vocab 12, 4 heads, so tp and Ulysses divide
    (2, "tp=2"), (2, "tp=2,sequence_parallel=1"), (2, "cp=2"), (2, "cp=2,cp_kind=ulysses"),
    (2, "cp=2,recompute=1"), (2, "tp=2,sequence_parallel=1,recompute=1"),
    (4, "dp=2,tp=2"), (4, "tp=2,pp=2"), (4, "tp=2,cp=2"),
    (4, "tp=2,pp=2,sequence_parallel=1,schedule=gpipe,microbatches=4"),
    (4, "tp=2,cp=2,cp_kind=ulysses,sequence_parallel=1"), (4, "fsdp=2,tp=2,zero=3"),
    (4, "fsdp=2,tp=2,zero=1,sequence_parallel=1"), (4, "cp=2,pp=2,recompute=1"),
    (8, "dp=2,tp=2,cp=2"), (8, "dp=2,tp=2,cp=2,cp_kind=ulysses,sequence_parallel=1"),
    (8, "fsdp=2,cp=2,tp=2,zero=3"), (8, "tp=2,cp=2,pp=2,sequence_parallel=1")])


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("n,layout,tied", GPT_TP_CP_CASES,
                         ids=[f"{c[1]}-tied" if c[2] else c[1] for c in GPT_TP_CP_CASES])
def test_gpt_tp_sp_cp_comm_bytes_match_the_plan(n, layout, tied):
    """GPT under tp (Megatron f/g, vocab-parallel embedding and loss), sequence_parallel
    (gathers, scatters, split gradients), cp (ring sends, Ulysses all_to_alls) and their
    compositions: the engine's bytes equal the plan's, and the step equals single's."""
    model = ms.GPT(vocab_size=12, seq_len=8, d_model=8, n_heads=4, n_layers=2, tied=tied)
    rng = np.random.default_rng(7)
    x, t = (rng.integers(0, 12, (BATCH, 8)) for _ in range(2))
    params = model.init(seed=2)
    loss = check_step_bytes(group_comm(n), model, layout, params, x, t, "cross_entropy")
    ref = ms.SingleDevice(model)
    ref.load_checkpoint(params)
    assert_close(loss, ref.train_step(x, t, "cross_entropy")[0], rtol=1e-9,
                 what=f"{layout} loss")


def test_plan_and_inspect_know_gpt(capsys):
    spec = "gpt:d_model=16,n_heads=2,n_layers=2,seq_len=8,vocab=13"
    assert cli.main(["plan", "--model", spec, "--world-size", "4", "--batch", "8",
                     "--top", "99"]) == 0
    out = capsys.readouterr().out
    print(out)
    assert "GPT(vocab_size=13, seq_len=8, d_model=16" in out and "fsdp=4,zero=3" in out
    assert "fsdp=2,tp=2,zero=3 " in out and "vocab_size=13 (" not in out   # V padded on tp
    assert "tp=4: layout 'tp=4': tp=4 does not divide the GPT's n_heads=2" in out
    assert cli.main(["plan", "--model", "gpt:d_model=16,n_heads=4,n_layers=2,seq_len=8,vocab=16",
                     "--world-size", "4", "--batch", "8", "--sort", "layout", "--top", "99"]) == 0
    out = capsys.readouterr().out
    for layout in ("cp=2,tp=2 ", "cp=4,cp_kind=ulysses ", "tp=4,sequence_parallel=1 "):
        assert any(ln.startswith(layout) for ln in out.splitlines()), layout
    assert "all_to_all" in out
    assert cli.main(["inspect", "--layout", "fsdp=2,pp=2,recompute=1", "--model", spec]) == 0
    out = capsys.readouterr().out
    assert "embed/tokens" in out and "head/weights" in out
    assert cli.main(["plan", "--model", "gpt:d_model=16,depth=2", "--world-size", "2"]) == 2
    assert "--model: unknown key 'depth'; known keys: d_model" in capsys.readouterr().err


def test_plan_and_inspect_price_a_compute_dtype(capsys, monkeypatch):
    """--compute-dtype bfloat16 --device gpu: a smaller peak than float32's, said in the
    header; on the CPU (emulated) a larger one; float64 with a 16-bit compute dtype is the
    engine flags' UsageError (exit 2)."""
    monkeypatch.delenv("MPISHARD_FUSED", raising=False)     # the GPU's fused kernels priced
    spec = "gpt:d_model=32,n_heads=4,n_layers=2,seq_len=64,vocab=256"

    def peak(*flags):
        assert cli.main(["inspect", "--layout", "single", "--model", spec, "--dtype",
                         "float32", "--batch", "8", *flags]) == 0
        out = capsys.readouterr().out
        line = out.splitlines()[-1].split()
        return out, float(line[-2]) * {"KiB": 1, "MiB": 1024}[line[-1]]
    _, wide = peak()
    out, gpu = peak("--compute-dtype", "bfloat16", "--device", "gpu")
    assert "bfloat16 compute on the GPU" in out and gpu < 0.8 * wide
    assert peak("--compute-dtype", "bfloat16")[1] > wide                # rounded copies
    assert cli.main(["plan", "--model", spec, "--world-size", "2", "--batch", "8",
                     "--compute-dtype", "float16", "--device", "gpu"]) == 0
    assert "float32 (float16 compute on the GPU)" in capsys.readouterr().out
    assert cli.main(["plan", "--model", spec, "--world-size", "2", "--dtype", "float64",
                     "--compute-dtype", "bfloat16"]) == 2
    assert "--compute-dtype bfloat16 needs --dtype float32" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["plan", "--world-size", "2"],
                                     ["inspect", "--layout", "tp=2"]])
def test_both_gpt_spellings_name_the_same_model(capsys, command):
    """--model gpt:KEY=VALUE,... and --model gpt --gpt KEY=VALUE,... (issue 31, defect 12)."""
    sizes = "d_model=16,n_heads=2,n_layers=1,seq_len=8,vocab=16"
    assert cli.main([*command, "--model", "gpt:" + sizes]) == 0
    prefixed = capsys.readouterr().out
    assert cli.main([*command, "--model", "gpt", "--gpt", sizes]) == 0
    assert capsys.readouterr().out == prefixed and "GPT(vocab_size=16, seq_len=8" in prefixed
    assert cli.main([*command, "--model", "gpt:d_model=16", "--gpt", "d_model=32"]) == 2
    assert "--model/--gpt: d_model is given twice" in capsys.readouterr().err
    assert cli.main([*command, "--model", "12,16,6", "--gpt", "d_model=32"]) == 2
    assert "--gpt applies to --model gpt" in capsys.readouterr().err


def test_inspect_says_which_dtype_it_assumes(capsys):
    assert cli.main(["inspect", "--layout", "dp=2", "--model", "4,8,2"]) == 0
    assert "dtype  float64 assumed (make_engine's default; --dtype float32 for train's)" \
        in capsys.readouterr().out
    assert cli.main(["inspect", "--layout", "dp=2", "--model", "4,8,2", "--dtype", "float32"]) == 0
    assert "dtype  float32 assumed (train's default" in capsys.readouterr().out


# -- the formulas against the closed forms in the strategy docstrings (serial) ------------------
@pytest.mark.parametrize("n", [2, 4, 8])
def test_dp_is_a_gradient_all_reduce_plus_the_loss(n):
    model = ms.MLP([12, 16, 8, 6])
    got = costs.step_comm(model, ms.parse_layout(f"dp={n}"), n - 1, batch=8 * n, itemsize=4)
    p = model.num_params() * 4
    assert got == {"train_step": {"all_reduce": 2 * (n - 1) / n * (p + 8)}, "optimizer": {}}


@pytest.mark.parametrize("n", [2, 4])
def test_fsdp_stages_cost_what_fsdp_py_says(n):
    """fsdp.py's table, for a bias-free model whose rows divide by N (no padding):
    zero=1/2 cost what dp costs, zero=3 1.5 times that less the first layer's weight, which
    no backward gathers (the loss all_reduce aside)."""
    model = ms.MLP([16, 32, 8, 4], bias=False)
    loss = 2 * (n - 1) / n * 8

    def total(layout):
        c = costs.step_comm_total(model, ms.parse_layout(layout), 0, batch=4 * n, itemsize=8)
        return sum(c.values()) - loss

    dp = total(f"dp={n}")
    assert dp == 2 * (n - 1) / n * model.num_params() * 8
    assert total(f"fsdp={n},zero=1") == dp
    assert total(f"fsdp={n},zero=2") == dp
    assert total(f"fsdp={n},zero=3") == 1.5 * dp - (n - 1) / n * 16 * 32 * 8


def test_tp_and_pp_terms():
    model = ms.MLP([12, 16, 8, 6])      # layer 0 column, 1 row, 2 replicated
    rows, s = 16, 8
    tp = costs.step_comm_total(model, ms.parse_layout("tp=2"), 0, batch=rows, itemsize=s)
    # only the row layer's forward all-reduce (the first layer needs no dL/dx), rows x 8
    assert tp == {"all_reduce": 2 * (2 - 1) / 2 * rows * 8 * s}
    # pp=2 puts layer 0 on stage 0 (most parameters); its 16-wide output goes forward and
    # its gradient comes back; under tp=2 the column layer's output is the 8-wide block
    for layout, width in (("pp=2", 16), ("pp=2,tp=2", 8)):
        first = costs.step_comm(model, ms.parse_layout(layout), 0, rows, s)["train_step"]
        last_rank = rank_of(ms.parse_layout(layout), {"pp": 1})
        last = costs.step_comm(model, ms.parse_layout(layout), last_rank, rows, s)["train_step"]
        assert first["send"] == last["send"] == rows * width * s
        assert last["broadcast"] == 4 and "broadcast" not in first   # the loss, from the last


def test_every_strategy_owns_its_cost_model():
    """plan and inspect only add up strategy_costs: each strategy file exposes memory and
    step_comm, and a strategy whose axis is absent costs nothing."""
    model = ms.MLP([12, 16, 8, 6])
    view = costs.rank_view(model, ms.parse_layout("single"), 0, itemsize=8, batch=16)
    for strategy in costs.strategy_costs(model):
        assert strategy.memory(view, 2) == {}, strategy
        assert not any(v for kinds in strategy.step_comm(view).values()
                       for v in kinds.values()), strategy
    assert costs.step_comm(model, ms.parse_layout("single"), 0, 16) == {"train_step": {},
                                                                        "optimizer": {}}


def test_gpt_tp_sp_cp_terms():
    """The GPT cost models' closed forms (3 blocks; t = 2, so an all_reduce costs one
    activation and an all-gather or reduce-scatter half of one)."""
    model = ms.GPT(vocab_size=16, seq_len=16, d_model=8, n_heads=4, n_layers=3)
    rows, s, t_len, d = 4, 8, 16, 8
    act, loss = rows * t_len * d * s, 3 * rows * t_len * s     # (B, T, D); 3 x (B, T)

    def train(layout):
        return costs.step_comm(model, ms.parse_layout(layout), 0, rows, s)["train_step"]
    # per block f, g before/after qkv | proj and fc | proj, the head's f, the embedding
    assert train("tp=2") == {"all_reduce": (3 * 4 + 1 + 1) * act + loss}
    # the same activations as half an all_reduce each way, plus the split gradients
    split = (3 * 4 + 2) * d * s + t_len * d * s                 # LayerNorms, positions
    assert train("tp=2,sequence_parallel=1") == {"all_gather": 7 * act, "reduce_scatter":
                                                 7 * act, "all_reduce": split + loss}
    assert train("tp=2,recompute=1") == {"all_reduce": (3 * 6 + 1 + 1) * act + loss}
    p, kv = model.num_params() * s, 2 * rows * (t_len // 2) * d * s    # a (k, v) block
    grads = {"all_reduce": p + 8}                                # avg over cp, and the loss
    assert train("cp=2") == {"send": 3 * (1 + 3) * kv, **grads}  # forward c-1, backward 2c-1
    assert train("cp=2,cp_kind=ulysses") == {"all_to_all": 3 * 8 * act / 2 / 2, **grads}
    with pytest.raises(ValueError, match="do not divide"):
        train("cp=8,tp=4,sequence_parallel=1")       # 2 tokens per cp rank, tp=4


def test_gpt_candidates_add_cp_and_sequence_parallel():
    got = plan.candidate_layouts(8, seq_len=16)
    assert {"cp=8", "cp=8,cp_kind=ulysses", "dp=2,cp=2,tp=2,sequence_parallel=1",
            "cp=4,tp=2,cp_kind=ulysses,sequence_parallel=1"} <= set(got)
    assert set(plan.candidate_layouts(8)) < set(got)
    cps = {ms.parse_layout(x).size("cp") for x in plan.candidate_layouts(8, seq_len=4)}
    assert cps == {1, 2}                            # 2 cp divides seq_len / 2 = 2


def test_model_flops_counts_each_gemm():
    dims, b = [2, 3, 4], 5
    gemms = [2 * b * 2 * 3, 2 * b * 3 * 4]               # forward
    gemms += [2 * b * 2 * 3, 2 * b * 3 * 4]              # backward dW
    gemms += [2 * b * 3 * 4]                             # backward dx, none for layer 0
    assert model_flops(dims, b) == sum(gemms)


# -- plan: enumeration and the command (serial) ---------------------------------------------------
@pytest.mark.parametrize("world", [1, 6, 8])
def test_candidates_are_every_factorisation(world):
    got = plan.candidate_layouts(world)
    assert len(got) == len(set(got))
    want = set()
    for dp, nf, pp, tp in itertools.product(range(1, world + 1), repeat=4):
        if dp * nf * pp * tp == world:
            for z in ((1, 2, 3) if nf > 1 else (None,)):
                want.add((dp, nf, pp, tp, z))
    parsed = set()
    for text in got:
        lt = ms.parse_layout(text)
        assert lt.world_size == world
        parsed.add((lt.size("dp"), lt.size("fsdp"), lt.size("pp"), lt.size("tp"),
                    lt.option("zero")))
    assert parsed == want


def test_plan_table(capsys):
    rc = cli.main(["plan", "--model", "784,512,256,10", "--world-size", "8", "--batch", "64",
                   "--top", "6", "--sort", "memory"])
    out = capsys.readouterr().out
    assert rc == 0, out
    lines = out.splitlines()
    head = next(i for i, ln in enumerate(lines) if ln.startswith("layout "))
    body = lines[head + 1:head + 7]
    assert lines[head + 7] == ""
    model = ms.MLP([784, 512, 256, 10])
    rows, rejected = plan.plan_layouts(model, 8, 64)
    rows.sort(key=plan.SORT_KEYS["memory"])
    assert [ln.split()[0] for ln in body] == [r["layout"] for r in rows[:6]]
    mems = [r["memory"] for r in rows]
    assert mems == sorted(mems)
    # pp=4 and pp=8 need 4 and 8 layers; tp=8 divides 512 and fits
    assert {t for t, _ in rejected} == {x for x in plan.candidate_layouts(8)
                                       if ms.parse_layout(x).size("pp") > 3}
    assert "pp=8: pp=8 needs at least 8 layers, model has 3" in out
    assert any(r["layout"] == "tp=8" for r in rows)


def test_plan_filters_on_batch_and_microbatches():
    model = ms.MLP([12, 16, 8, 6])
    rows, rejected = plan.plan_layouts(model, 4, batch=6, microbatches=2)
    fits = {r["layout"] for r in rows}
    reasons = dict(rejected)
    assert "dp=4" in reasons and "does not divide by the 4 data-parallel" in reasons["dp=4"]
    assert "pp=2,tp=2,microbatches=2" in fits                     # 6 rows, 2 microbatches
    assert "microbatches=2 does not divide the local batch of 3" in \
        reasons["dp=2,pp=2,microbatches=2"]                       # 3 rows per dp rank


def test_plan_json(tmp_path, capsys):
    """--json writes every layout that fits and the rejected ones; with a calibration the
    predicted best, and with --validate (world size 1: this process is the MPI job) the
    predicted vs measured numbers that validation_report prints."""
    path = tmp_path / "plan.json"
    rc = cli.main(["plan", "--model", "784,512,256,10", "--world-size", "8", "--batch", "64",
                   "--top", "2", "--json", str(path)])
    assert rc == 0, capsys.readouterr()
    got = json.loads(path.read_text())
    rows, rejected = plan.plan_layouts(ms.MLP([784, 512, 256, 10]), 8, 64)
    assert sorted(r["layout"] for r in got["layouts"]) == sorted(r["layout"] for r in rows)
    assert [r["layout"] for r in got["rejected"]] == [t for t, _ in rejected]
    assert got["world_size"] == 8 and got["parameters"] == 535_818
    assert got["predicted_best"] is None and got["validate"] is None
    assert all(r["step_s"] is None and r["memory"] > 0 for r in got["layouts"])

    calibration = str(ROOT / "examples" / "calibration.example.json")
    rc = cli.main(["plan", "--model", "16,8,4", "--world-size", "1", "--batch", "8",
                   "--calibration", calibration, "--validate", "1", "--json", str(path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    got = json.loads(path.read_text())
    v = got["validate"]
    assert got["predicted_best"] == v["predicted_best"] == v["measured_best"] == "single"
    (row,) = v["layouts"]
    assert row["predicted_s"] == got["layouts"][0]["step_s"] > 0 and row["measured_s"] > 0
    assert v["median_abs_error"] == pytest.approx(abs(row["error"]))
    assert row["error"] == pytest.approx(row["predicted_s"] / row["measured_s"] - 1)
    assert v["best_gap"] == 0.0 and v["drift"] > 0
    assert f"median absolute error {100 * v['median_abs_error']:.1f}% over 1 layouts" in out


@pytest.mark.parametrize("argv,message", [
    (["--world-size", "0"], "--world-size must be > 0"),
    (["--model", "5"], "need at least two positive dims"),
    (["--microbatches", "0"], "--microbatches must be > 0"),
    (["--sort", "speed"], "invalid choice: 'speed'"),
    (["--activation", "swish"], "plan: "),
])
def test_plan_errors(capsys, argv, message):
    base = {"--model": "12,16,6", "--world-size": "2"}
    args = ["plan"]
    for k, v in base.items():
        if k not in argv:
            args += [k, v]
    rc = cli.main(args + argv)
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("mpishard: error:") and message in err, err
    assert len(err.strip().splitlines()) == 1


# -- bench under mpiexec (serial test, subprocess) ---------------------------------------------
def _launch(n, *args):
    """`mpiexec -n n python -m mpi4py -m mpishard args...`, the CompletedProcess."""
    return run_mpi(n, "-m", "mpishard", *args)


def test_bench_two_ranks():
    r = _launch(2, "bench", "--layout", "fsdp=2,zero=2", "--model", "12,16,8,6", "--batch",
                "16", "--steps", "3", "--warmup", "1")
    assert r.returncode == 0, r.stdout + r.stderr
    rows = {}
    for line in r.stdout.splitlines():
        line = line.rstrip()
        m = re.match(r"(\S.*?)\s{2,}(\S+(?: \S+)?)(?:\s{2,}(\S+))?$", line)
        if m:
            rows[m.group(1)] = (m.group(2), m.group(3))
    for name in ("step time (median)", "samples/s", "GFLOP/s (model)", "comm time fraction",
                 "comm bytes/step all_reduce", "comm bytes/step all_gather",
                 "comm bytes/step reduce_scatter", "comm bytes/step total"):
        assert name in rows, f"{name!r} missing from:\n{r.stdout}"
    assert rows["step time (median)"][0].endswith("ms") and "layout 'fsdp=2,zero=2'" in r.stdout
    for name, (measured, planned) in rows.items():
        if name.startswith("comm bytes/step"):
            assert measured == planned, f"{name}: measured {measured} != plan {planned}"


def test_bench_takes_train_s_16_bit_parameter_and_gradient_dtypes():
    """--param-dtype/--comm-dtype bfloat16 as train's: fsdp's gathers send half the plan's
    float32 bytes, and the header says the plan column does not model them."""
    r = _launch(2, "bench", "--layout", "fsdp=2,zero=2", "--model", "12,16,8,6", "--batch",
                "16", "--steps", "2", "--warmup", "1", "--param-dtype", "bfloat16",
                "--comm-dtype", "bfloat16")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "plan: float32 throughout (--param-dtype bfloat16, --comm-dtype bfloat16" in r.stdout
    gather = re.search(r"comm bytes/step all_gather\s+(\d+)\s+(\d+)", r.stdout)
    assert gather and 2 * int(gather.group(1)) == int(gather.group(2)), r.stdout


def test_bench_a_gpt_both_spellings():
    sizes = "d_model=16,n_heads=2,n_layers=1,seq_len=8,vocab=16"
    tables = []
    for model in (["--model", "gpt:" + sizes], ["--model", "gpt", "--gpt", sizes]):
        r = _launch(2, "bench", "--layout", "tp=2", *model, "--batch", "4", "--steps", "2",
                    "--warmup", "1")
        assert r.returncode == 0, r.stdout + r.stderr
        tables.append(r.stdout)
    flops = gpt_flops(ms.GPT(16, 8, 16, 2, 1), 4)
    for out in tables:
        assert "GPT(vocab_size=16, seq_len=8, d_model=16" in out and f"{flops:,} FLOP" in out
        total = [ln.split() for ln in out.splitlines() if ln.startswith("comm bytes/step total")]
        assert total and total[0][-1] == total[0][-2], out       # measured == plan


def test_bench_bad_input_exits_2_on_every_rank():
    r = _launch(2, "bench", "--layout", "tp=2", "--model", "12,15,6", "--steps", "1")
    assert r.returncode == 2, r.stdout + r.stderr
    assert engine_lines(r.stderr) == ["mpishard: error: tp=2 does not divide the hidden size 15 of "
                                "layer 0 (12 -> 15); Megatron splits it column-wise"]
