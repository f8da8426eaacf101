"""The planner's step-time model (costs/step_time.py, costs/call_counts.py) and its
calibration and validation (cli/calibrate.py, cli/plan_time.py).

    pytest -m "not mpi" tests/costs/test_step_time.py                  # pure: exact values
    mpiexec -n 4 python -m mpi4py -m pytest --with-mpi -m mpi tests/costs/test_step_time.py

The MPI tests hold call_counts.step_calls to the engine's own call counters on every rank
(MLP and GPT layouts at 4 ranks) and run a (shortened) calibration and validation.
"""
import json
import os

import numpy as np
import pytest

import mpishard as ms
from mpishard import cli
from mpishard.cli import calibrate as cal_cli
from mpishard.costs import calibration as cal_mod
from mpishard.costs.calibration import rank_count_note
from mpishard.cli import calibrate_steps as cal_steps
from mpishard.cli.plan import candidate_layouts, plan_report
from mpishard.cli.plan_time import validate, validation_report
from mpishard.comm.mesh import parse_layout
from mpishard.costs.call_counts import step_calls
from mpishard.costs.rank_costs import check_fit, rank_memory, rank_view, step_comm_total
from mpishard.costs.step_time import (LEND_AFTER, bubble, bubble_factor, call_seconds,
                                         comm_terms, elementwise_seconds, gemms,
                                         group_spans_nodes, interpolate, lent, op_seconds,
                                         optimizer_seconds, predict_rank, predict_step,
                                         ranking_seconds,
                                         representative_ranks)

from conftest import group_comm

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "examples")
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send")
OPS = ("pass", "relu", "gelu", "tanh", "sigmoid", "layernorm", "xent", "embedding", "adamw",
       "softmax")


def flat(alpha=1e-4, beta=1e9, gflops=10.0, op=0.0, fixed=0.0):
    """A calibration with one rate for everything."""
    return {"version": 2, "gemm": [[1.0, gflops]], "bgemm": [[1.0, gflops]],
            "concurrency": 1.0, "ops": {k: [[1.0, op]] for k in OPS},
            "fixed": {k: fixed for k in ("mlp_layer", "mlp_base", "gpt_block", "gpt_base",
                                         "optimizer_tensor")},
            "collectives": {k: {"2": [alpha, beta], "4": [alpha, beta]} for k in KINDS}}


def load(name):
    with open(os.path.join(EXAMPLES, name)) as f:
        return json.load(f)


def test_interpolate_is_log_log_and_flat_beyond_the_ends():
    curve = [[1.0, 10.0], [100.0, 1000.0]]
    assert interpolate(curve, 10.0) == pytest.approx(100.0, rel=1e-12)
    assert interpolate(curve, 0.5) == 10.0 and interpolate(curve, 1e6) == 1000.0
    ops = {"pass": [[100.0, 2e-9], [1e4, 2e-9]]}
    assert op_seconds(ops, "pass", 1000) == pytest.approx(2e-6, rel=1e-12)
    assert op_seconds(ops, "pass", 10) == pytest.approx(2e-7, rel=1e-12)   # the smallest call
    assert op_seconds(ops, "identity", 1000) == 0.0


def test_call_seconds_alpha_beta_and_measured_points():
    cal = {"collectives": {"all_reduce": {"2": [1e-5, 1e9], "8": [2e-5, 1e9]},
                           "send": {"2": [[0, 1e-3], [1000, 2e-3], [3000, 6e-3]]}}}
    assert call_seconds(cal, "all_reduce", 2, 1e6) == pytest.approx(1.01e-3, rel=1e-12)
    assert call_seconds(cal, "all_reduce", 4, 0) == 1e-5          # nearest: 2
    assert call_seconds(cal, "all_reduce", 6, 0) == 2e-5          # nearest: 8
    assert call_seconds(cal, "all_gather", 2, 0) == 1e-5          # falls back to all_reduce
    assert call_seconds(cal, "send", 2, 500) == pytest.approx(1.5e-3, rel=1e-12)
    assert call_seconds(cal, "send", 2, 2000) == pytest.approx(4e-3, rel=1e-12)
    assert call_seconds(cal, "send", 2, 5000) == pytest.approx(1e-2, rel=1e-12)
    inter = dict(cal, collectives_inter={"all_reduce": {"2": [1.0, 1.0]}})
    assert call_seconds(inter, "all_reduce", 2, 0, inter=True) == 1.0


def test_alpha_beta_fit_through_measured_points():
    line = [[x, 1e-3 + x / 1e9] for x in (32.0, 65536.0, 1048576.0, 4194304.0)]
    alpha, beta = cal_mod.fit_alpha_beta(line)
    assert alpha == pytest.approx(1e-3, rel=1e-9) and beta == pytest.approx(1e9, rel=1e-9)
    flat_then_less = [[32.0, 2e-3], [1e6, 1e-3]]         # no bandwidth term to see
    assert cal_mod.fit_alpha_beta(flat_then_less) == [pytest.approx(1.2e-3), 1e15]


def test_single_is_flops_over_rate():
    model = ms.MLP([64, 32, 16])
    got = predict_step(model, parse_layout("single"), 8, flat(), itemsize=4)
    flops = 3 * 2 * 8 * 32 * 16 + 2 * 2 * 8 * 64 * 32        # layer 0 has no dx
    assert got["gemm_s"] == pytest.approx(flops / 10e9, rel=1e-12)
    assert got["step_s"] == pytest.approx(flops / 10e9, rel=1e-12)
    assert got["comm_s"] == 0.0 and got["bubble"] == 0.0


def test_elementwise_counts_each_array_once():
    model = ms.MLP([64, 32, 16])              # relu, then the identity on the last layer
    cal = flat()
    cal["ops"].update(relu=[[1.0, 3e-9]], adamw=[[1.0, 7e-9]], **{"pass": [[1.0, 1e-9]]})
    cal["fixed"].update(mlp_layer=1e-4, mlp_base=2e-4, optimizer_tensor=5e-5)
    view = rank_view(model, parse_layout("single"), 0, 4, 8)
    want = (8 * 32 * (3e-9 + 2 * 1e-9)                     # layer 0: relu, bias both ways
            + 8 * 16 * (2 + 3) * 1e-9                      # layer 1: bias, MSE
            + 2 * 1e-4 + 2e-4                              # per layer, per step
            + (64 * 32 + 32 + 32 * 16 + 16) * 7e-9         # AdamW over every element
            + 4 * 5e-5)                                    # per optimizer tensor
    assert elementwise_seconds(view, cal) == pytest.approx(want, rel=1e-12)


def test_fsdp_copies_a_pass_per_pack_and_gather():
    model = ms.MLP([64, 32, 16])
    cal = flat()
    cal["ops"]["pass"] = [[1.0, 1e-9]]
    dp = elementwise_seconds(rank_view(model, parse_layout("dp=2"), 0, 4, 8), cal)
    zero1 = elementwise_seconds(rank_view(model, parse_layout("fsdp=2,zero=1"), 0, 4, 8), cal)
    zero2 = elementwise_seconds(rank_view(model, parse_layout("fsdp=2,zero=2"), 0, 4, 8), cal)
    zero3 = elementwise_seconds(rank_view(model, parse_layout("fsdp=2,zero=3"), 0, 4, 8), cal)
    full = 64 * 32 + 32 + 32 * 16 + 16                     # every tensor, padded (even here)
    assert zero2 - dp == pytest.approx(2 * full * 1e-9, rel=1e-9)
    # ZeRO-1's full gradient buffer: one += (1 microbatch) and two zero fills more
    assert zero1 - zero2 == pytest.approx(3 * full * 1e-9, rel=1e-9)
    uses = 64 * 32 * 2 + 32 * 2 + 32 * 16 * 3 + 16 * 2   # gets + gradients: W0 1+1, W1 2+1
    assert zero3 - dp == pytest.approx(uses * 1e-9, rel=1e-9)


def test_data_parallel_halves_compute_and_adds_comm():
    model = ms.MLP([64, 32, 16])
    one = predict_step(model, parse_layout("single"), 8, flat(), itemsize=4)
    two = predict_step(model, parse_layout("dp=2"), 8, flat(), itemsize=4)
    assert two["gemm_s"] == pytest.approx(one["gemm_s"] / 2, rel=1e-12)
    assert two["comm_s"] > 0


def test_step_factor_scales_compute_of_its_kind_only():
    mlp = ms.MLP([64, 32, 16])
    gpt = ms.GPT(vocab_size=16, seq_len=8, d_model=16, n_heads=2, n_layers=1)
    base = flat(op=1e-9, fixed=1e-5)
    scaled = dict(base, step_factor={"mlp": 2.0, "gpt": 3.0})
    for model, factor in ((mlp, 2.0), (gpt, 3.0)):
        one, two = (predict_step(model, parse_layout("dp=2"), 8, cal, itemsize=4)
                    for cal in (base, scaled))
        for key in ("gemm_s", "elementwise_s", "compute_s"):
            assert two[key] == pytest.approx(factor * one[key], rel=1e-12)
        assert two["comm_s"] == pytest.approx(one["comm_s"], rel=1e-12)
        assert two["step_s"] == pytest.approx(factor * one["compute_s"] + one["comm_s"],
                                              rel=1e-12)


def test_optimizer_factor_scales_the_optimizer_only():
    model = ms.MLP([64, 32, 16])
    base = flat(op=1e-9, fixed=1e-5)
    one = predict_step(model, parse_layout("dp=2"), 8, base, itemsize=4)
    two = predict_step(model, parse_layout("dp=2"), 8, dict(base, step_factor={"mlp": 2.0},
                                              optimizer_factor={"mlp": 5.0}), itemsize=4)
    view = rank_view(model, parse_layout("dp=2"), 0, 4, 8)
    optimizer = optimizer_seconds(view, base)
    assert optimizer > 0 and one["optimizer_s"] == pytest.approx(optimizer, rel=1e-12)
    assert two["optimizer_s"] == pytest.approx(5.0 * optimizer, rel=1e-12)
    assert two["gemm_s"] == pytest.approx(2.0 * one["gemm_s"], rel=1e-12)
    assert two["elementwise_s"] == pytest.approx(
        2.0 * (one["elementwise_s"] - optimizer) + 5.0 * optimizer, rel=1e-12)


def test_step_factor_is_the_median_of_three_timings_with_their_range():
    cal = flat(op=1e-9, fixed=1e-5)
    rows = {kind: predict_rank(model, parse_layout("dp=1"), 0, batch, cal, 4)
            for kind, (model, batch) in cal_steps.REFERENCE_STEPS.items()}
    predicted = {kind: (r["compute_s"] - r["optimizer_s"], r["optimizer_s"])
                 for kind, r in rows.items()}
    samples = [{kind: (f * p[0], g * p[1]) for kind, p in predicted.items()}
               for f, g in ((1.3, 1.1), (1.05, 1.2), (1.28, 1.15))]
    got = cal_steps.measure_step_factor(samples, dict(cal, step_factor={"mlp": 9.0}), 4)
    # the median: 1.05 is outvoted
    assert got["step_factor"] == pytest.approx({"mlp": 1.28, "gpt": 1.28}, rel=1e-12)
    assert got["optimizer_factor"] == pytest.approx({"mlp": 1.15, "gpt": 1.15}, rel=1e-12)
    assert got["step_factor_range"] == {kind: [pytest.approx(1.05, rel=1e-12),
                                               pytest.approx(1.3, rel=1e-12)]
                                        for kind in ("mlp", "gpt")}
    assert got["optimizer_factor_range"] == {kind: [pytest.approx(1.1, rel=1e-12),
                                                    pytest.approx(1.2, rel=1e-12)]
                                             for kind in ("mlp", "gpt")}


def test_mesh_factor_scales_steps_of_the_calibrated_rank_count_only():
    model = ms.MLP([64, 32, 32, 16])
    base = flat(op=1e-9, fixed=1e-5)
    cal = dict(base, ranks=2, mesh_factor={"mlp": 1.5, "gpt": 9.0})
    for layout, factor in (("single", 1.0), ("dp=2", 1.5), ("tp=2", 1.5), ("pp=2", 1.5),
                           ("dp=2,pp=2", 1.0)):                 # 4 ranks: not calibrated
        one, two = (predict_step(model, parse_layout(layout), 8, c, itemsize=4)
                    for c in (base, cal))
        assert two["mesh_factor"] == pytest.approx(factor, rel=1e-12), layout
        assert two["step_s"] == pytest.approx(factor * one["step_s"], rel=1e-12), layout
        assert two["compute_s"] == pytest.approx(one["compute_s"], rel=1e-12)


def test_mesh_factor_is_the_median_measured_dp_step_over_its_prediction():
    cal = flat(op=1e-9, fixed=1e-5)
    predicted = {kind: predict_step(model, parse_layout("dp=4"), batch * 4, cal, 4)["step_s"]
                 for kind, (model, batch) in cal_steps.REFERENCE_STEPS.items()}
    samples = [{kind: f * p for kind, p in predicted.items()} for f in (1.3, 1.96, 1.2)]
    # a factor already in the calibration does not enter the prediction it is measured over
    got = cal_steps.measure_mesh_factor(samples + [{}], dict(cal, mesh_factor={"mlp": 7.0}),
                                        4, 4)
    assert got["mesh_factor"] == pytest.approx({"mlp": 1.3, "gpt": 1.3}, rel=1e-12)
    assert got["mesh_factor_range"] == {kind: [pytest.approx(1.2, rel=1e-12),
                                               pytest.approx(1.96, rel=1e-12)]
                                        for kind in ("mlp", "gpt")}
    assert cal_steps.measure_mesh_factor([{}, {}], cal, 1, 4) == {}     # one rank


def test_zero3_computes_with_the_gathered_weight():
    model = ms.MLP([64, 32, 16])
    a = rank_view(model, parse_layout("fsdp=2"), 0, 4, 8)
    b = rank_view(model, parse_layout("dp=2"), 0, 4, 8)
    assert gemms(a) == gemms(b)


def test_gpt_attention_gemms_per_block():
    gpt = ms.GPT(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2)
    view = rank_view(gpt, parse_layout("tp=2"), 0, 4, 4)
    (flops, calls, curve), = [g for g in gemms(view) if g[2] == "bgemm"]
    assert flops == 2 * 4 * 2 * 16 * 16 * 8 and calls == 7 * 2        # 2 heads of 4, D_h 8
    ring = rank_view(gpt, parse_layout("cp=2"), 0, 4, 4)
    (flops, calls, _), = [g for g in gemms(ring) if g[2] == "bgemm"]
    assert flops == 2 * 4 * 4 * 8 * 8 * 8 and calls == 7 * 2 * 2      # 2 key blocks of 8


def test_comm_terms_one_group_each():
    model = ms.MLP([64, 32, 32, 16])          # tp: column, row, replicated last
    view = rank_view(model, parse_layout("dp=2,tp=2"), 0, 4, 16)
    terms = [(axes, kind, calls, nbytes) for axes, kind, calls, nbytes, _ in
             comm_terms(view, flat(alpha=1e-4, beta=1e9))]
    grads = (64 * 16 + 16 + 16 * 32 + 32 + 32 * 16 + 16) * 4     # column, row, last blocks
    assert terms == [(("tp",), "all_reduce", 1, 8 * 32 * 4),     # the row layer's output
                     (("dp",), "all_reduce", 1, grads),          # one bucket
                     (("dp",), "all_reduce", 1, 8)]              # the loss
    seconds = [s for *_, s in comm_terms(view, flat(alpha=1e-4, beta=1e9))]
    assert seconds == pytest.approx([1e-4 + 1024 / 1e9, 1e-4 + grads / 1e9, 1e-4 + 8 / 1e9])
    assert sum(t[3] for t in terms) == sum(step_comm_total(model, parse_layout("dp=2,tp=2"), 0,
                                                           16, 4).values())


def test_pipeline_bubble_and_shared_cores():
    assert bubble(parse_layout("pp=2,microbatches=4")) == pytest.approx(1 / 5)
    assert bubble(parse_layout("dp=2")) == 0.0
    assert bubble_factor(0.2) == pytest.approx(1.25)
    assert bubble_factor(0.2, 1.1) == pytest.approx(1 / 0.88)
    assert bubble_factor(0.2, 2.0) == 1.0          # the idle stage's core runs the others


def test_a_bubble_lends_its_core_by_the_length_of_its_idle_spans():
    """lent(): spans under LEND_AFTER lend nothing, long ones nearly all (the measured
    1.00-1.03x at 0.6-2.4 ms bursts, 1.75x at 17 ms, 1.87x at 72 ms, of at most 2x)."""
    assert lent(0.0) == 0.0 and lent(LEND_AFTER) == 0.0
    assert lent(2.4e-3) < 0.1 and lent(17e-3) == pytest.approx(0.75) and lent(72e-3) > 0.9
    spans = [lent(t) for t in (1e-3, 5e-3, 20e-3, 100e-3, 1.0)]
    assert spans == sorted(spans) and spans[-1] < 1.0
    # b = 1/3: the idle time is half the compute, two spans of a quarter of it each
    assert bubble_factor(1 / 3, 2.0, compute_s=4e-3) == pytest.approx(1.5)       # 1 ms spans
    assert bubble_factor(1 / 3, 1.2, compute_s=68e-3) == pytest.approx(
        1 / ((1 + 0.2 * lent(17e-3)) * (2 / 3)))                                  # 17 ms
    assert bubble_factor(1 / 3, 2.0, compute_s=10.0) == 1.0                      # long: all
    assert bubble_factor(0.0, 2.0, compute_s=1e-3) == 1.0


def test_a_pipeline_is_ranked_by_its_step_with_the_idle_time_paid_in_full():
    """unlent_s (ranking_seconds) is step_s with bubble_factor's lending left out: equal to it
    without a pipeline, or with a rank per core (concurrency 1); larger for a pipeline on
    ranks that share cores, by exactly 1 / (1 - b) on the compute."""
    cal = load("calibration.example.json")
    model = ms.GPT(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2)
    flat = predict_step(model, parse_layout("dp=4"), 8, cal)
    assert ranking_seconds(flat) == flat["unlent_s"] == flat["step_s"]
    shared = dict(cal, concurrency=4.0)
    pipe = predict_step(model, parse_layout("dp=2,pp=2"), 256, shared)   # idle spans > 2 ms
    b, mesh = pipe["bubble"], pipe["mesh_factor"]
    assert b > 0 and ranking_seconds(pipe) > pipe["step_s"]
    assert pipe["unlent_s"] == pytest.approx(mesh * (pipe["compute_s"] / (1 - b) + pipe["comm_s"]))
    alone = predict_step(model, parse_layout("dp=2,pp=2"), 256, dict(cal, concurrency=1.0))
    assert alone["unlent_s"] == pytest.approx(alone["step_s"])
    assert ranking_seconds({"step_s": 0.5}) == 0.5          # a row without one


def test_groups_span_nodes_tp_innermost():
    assert not group_spans_nodes(parse_layout("dp=4,tp=8"), ("tp",), 8)
    assert group_spans_nodes(parse_layout("dp=4,tp=8"), ("dp",), 8)
    assert not group_spans_nodes(parse_layout("fsdp=2,tp=4"), ("fsdp",), 8)
    assert group_spans_nodes(parse_layout("fsdp=4,tp=4"), ("fsdp",), 8)
    assert not group_spans_nodes(parse_layout("dp=64"), ("dp",), None)


@pytest.mark.parametrize("model,batch,seq,world", [
    (ms.MLP([60, 36, 20, 12, 10]), 48, None, 6),
    (ms.GPT(vocab_size=60, seq_len=24, d_model=24, n_heads=6, n_layers=3), 24, 24, 8),
    (ms.GPT(vocab_size=64, seq_len=16, d_model=12, n_heads=3, n_layers=3, tied=True), 12, 16,
     12)], ids=["mlp-6", "gpt-8", "gpt-tied-12"])
def test_representative_ranks_bound_every_rank(model, batch, seq, world):
    cal = flat(op=1e-9, fixed=1e-5)
    checked = 0
    for text in candidate_layouts(world, None, seq):
        layout = parse_layout(text)
        try:
            check_fit(model, layout, batch)
        except ValueError:
            continue
        reps = representative_ranks(layout)
        for cost in (lambda r: rank_memory(model, layout, r, 4)["total"],
                     lambda r: sum(step_comm_total(model, layout, r, batch, 4).values()),
                     lambda r: predict_rank(model, layout, r, batch, cal)["step_s"]):
            values = [cost(r) for r in range(world)]
            assert max(values) == max(values[r] for r in reps), layout
        checked += 1
    assert checked > 10


def test_plan_marks_the_predicted_best_and_examples_load():
    cal = load("calibration.example.json")
    assert cal["version"] == 2 and cal["ranks"] == 4
    text = plan_report(ms.MLP([64, 32, 32, 16]), 4, 32, dtype=np.float32, calibration=cal)
    assert sum(line.split()[1:2] == ["*"] for line in text.splitlines()) == 1
    gpt = ms.GPT(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2)
    assert predict_step(gpt, parse_layout("tp=2"), 4, cal)["step_s"] > 0


def test_plan_says_how_it_sorts_and_when_the_calibration_has_another_rank_count():
    cal = load("calibration.example.json")                       # measured at 4 ranks
    model = ms.MLP([64, 32, 32, 16])
    four = plan_report(model, 4, 32, dtype=np.float32, calibration=cal)
    assert "sorted by time" in four and "note:" not in four      # the default, calibrated
    assert "sorted by --layout auto's rule of thumb" in plan_report(model, 4, 32,
                                                                    dtype=np.float32)
    assert "sorted by memory" in plan_report(model, 4, 32, dtype=np.float32, sort="memory")
    two = plan_report(model, 2, 32, dtype=np.float32, calibration=cal)
    assert "note:   the calibration was measured at 4 ranks, these layouts have 2" in two
    assert rank_count_note(cal, 4) is None and rank_count_note({}, 2) is None


def test_old_calibration_format_is_refused(tmp_path):
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"gemm_gflops": {"small": 1.0}}))
    with pytest.raises(ValueError, match="plan --calibrate"):
        cal_mod.load_calibration(str(path))


def test_validation_report_numbers():
    results = [("c", 1.0, 1.2), ("a", 2.0, 1.0), ("b", 3.0, 1.5)]     # the ranking's order
    text = validation_report(results, drift=2.0)
    assert "median absolute error 100.0% over 3 layouts" in text
    assert "predicted best 'c' measured 20.0% slower than the measured best" in text
    assert "2.00x their calibrated rate" in text and "/ 2.00: median absolute error 0.0%" in text
    assert "calibrated rate" not in validation_report(results)


def test_extrapolation_command_marks_a_best_layout(capsys):
    """The paper table of docs/planning-and-tracing.md: an assumed H100 cluster, GPT-2 small, 64
    ranks."""
    assert load("calibration.h100-cluster.json")["assumed"] is True
    code = cli.main(["plan", "--model", "gpt:vocab=50257,seq_len=1024,d_model=768,n_heads=12,"
                     "n_layers=12,tied=1", "--world-size", "64", "--batch", "512",
                     "--calibration", os.path.join(EXAMPLES, "calibration.h100-cluster.json"),
                     "--top", "3"])
    out = capsys.readouterr().out
    assert code in (0, None)
    best = [line for line in out.splitlines() if line.split()[1:2] == ["*"]]
    assert len(best) == 1 and best[0].startswith(("dp=", "fsdp=")), out
    assert "124,439,808 parameters" in out and "ms" in best[0]


# -- MPI: the call counts against the engine, a short calibration and validation --------------
CALL_CASES = [
    ("784,512,512,10", 64, "dp=4"), ("784,512,512,10", 64, "dp=2,tp=2"),
    ("784,512,512,10", 64, "tp=4"), ("784,512,512,10", 64, "pp=2,tp=2"),
    ("784,512,512,10", 64, "fsdp=4,zero=1"), ("784,512,512,10", 64, "fsdp=4,zero=2"),
    ("784,512,512,10", 64, "fsdp=2,tp=2,zero=3"), ("784,512,512,10", 64, "dp=2,tp=2,bucket_mb=0"),
    ("64,32,32,32,16", 16, "pp=2,schedule=interleaved,microbatches=4,dp=2"),
    ("gpt", 16, "tp=4"), ("gpt", 16, "tp=4,sequence_parallel=1"), ("gpt", 16, "cp=2,tp=2"),
    ("gpt", 16, "cp=2,cp_kind=ulysses,dp=2"), ("gpt", 16, "pp=4"),
    ("gpt", 16, "fsdp=2,cp=2,zero=3"), ("gpt", 16, "tp=2,dp=2,recompute=1"),
    ("gpt", 16, "pp=2,fsdp=2,zero=2")]


def _model(spec):
    if spec == "gpt":
        return ms.GPT(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=4)
    return ms.MLP([int(d) for d in spec.split(",")])


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("spec,batch,layout", CALL_CASES, ids=[c[2] for c in CALL_CASES])
def test_calls_match_the_engine(spec, batch, layout):
    comm = group_comm(4)
    model = _model(spec)
    engine = ms.make_engine(model, layout, dtype=np.float32, comm=comm)
    engine.load_checkpoint(model.init(seed=0))
    opt = ms.optim.AdamW(engine, lr=1e-4)
    rng = np.random.default_rng(0)
    if spec == "gpt":
        x, t = (rng.integers(0, 64, (batch, 16)) for _ in range(2))
        loss = ms.losses.CrossEntropy()
    else:
        x, t = rng.standard_normal((batch, model.d_in)), rng.standard_normal((batch, model.d_out))
        x, t, loss = x.astype(np.float32), t.astype(np.float32), ms.losses.MSE()
    engine.reset_comm_stats()
    opt.step(engine.train_step(engine.shard_batch(x), engine.shard_batch(t), loss)[1])
    got = {k: v for k, v in engine.comm_calls.items() if v}
    assert got == step_calls(rank_view(model, engine.layout, comm.Get_rank(), 4, batch)), layout


@pytest.mark.mpi(min_size=2)
def test_calibrate_and_validate_run(monkeypatch):
    comm = group_comm(2)
    monkeypatch.setattr(cal_mod, "WINDOW", 0.002)
    monkeypatch.setattr(cal_mod, "REPEATS", 1)
    cal = cal_cli.calibrate(None, np.float32, comm)
    assert set(cal["collectives"]) == set(KINDS) and set(cal["collectives"]["send"]) == {"2"}
    assert len(cal["gemm"]) == len(cal_mod.GEMM_SIDES) and cal["concurrency"] >= 1.0
    assert all(s >= 0 for points in cal["ops"].values() for _, s in points)
    for name in ("step_factor", "optimizer_factor"):
        assert set(cal[name]) == {"mlp", "gpt"} and all(
            lo <= cal[name][kind] <= hi and lo > 0
            for kind, (lo, hi) in cal[name + "_range"].items())
    assert set(cal["mesh_factor"]) == {"mlp", "gpt"} and all(    # the dp=2 steps timed
        lo <= cal["mesh_factor"][kind] <= hi and lo > 0
        for kind, (lo, hi) in cal["mesh_factor_range"].items())
    assert "host_heap" in cal
    model = ms.MLP([16, 8, 4])
    rows = [{"layout": text, "memory": 0} for text in ("dp=2", "tp=2", "fsdp=2,zero=1")]
    results = validate(model, rows, 8, np.float32, cal, top=2, comm=comm, rounds=2)
    assert len(results) == 2 and all(p > 0 and m > 0 for _, p, m in results)
    assert validate.drift > 0          # the reference GEMMs, re-timed each round


@pytest.mark.mpi(min_size=4)
def test_a_rank_alone_gets_the_cores_its_waiting_peers_leave():
    """concurrency: while rank 0 computes, the others wait as a pipeline stage in its bubble
    does and leave it the cores. With 4 ranks on 2 cores a 256-GEMM ran 2.0x faster alone
    than with every rank busy; when the others waited in a blocking collective, which MPICH
    spins in, 0.9x, and concurrency came out 1.00."""
    from mpi4py import MPI
    from mpishard.health.threads import node_share
    comm = MPI.COMM_WORLD
    cpus, _, sharing = node_share(comm)
    if sharing < 2 * len(cpus):
        pytest.skip("needs at least 2 ranks per core")
    a, w = (np.random.default_rng(0).standard_normal((256, 256)).astype(np.float32)
            for _ in range(2))
    alone = cal_cli.timed_alone(lambda: ms.nn.einsum("bd,df->bf", a, w), comm)
    shared = cal_mod.timed(lambda: ms.nn.einsum("bd,df->bf", a, w), comm)
    assert shared / alone > 1.3, (alone, shared)
