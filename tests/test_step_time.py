"""The planner's step-time model (parallel/step_time.py): pure, no MPI."""
import json
import os

import numpy as np
import pytest

import mpishard as ms
from mpishard.cli.plan import plan_report
from mpishard.parallel.step_time import bubble, gemms, predict_step, shape_class
from mpishard.comm.mesh import parse_layout
from mpishard.parallel.costs import rank_view

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "examples", "calibration.example.json")


def flat(alpha=1e-4, beta=1e9, gflops=10.0):
    kinds = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send")
    return {"gemm_gflops": {"small": gflops, "medium": gflops, "large": gflops},
            "memory_gbs": 1e9, "call_s": 0.0,
            "collectives": {k: {"2": [alpha, beta], "4": [alpha, beta]} for k in kinds}}


def test_single_is_flops_over_rate():
    model = ms.MLP([64, 32, 16])
    got = predict_step(model, "single", 8, flat(), itemsize=4)
    flops = 3 * 2 * 8 * 32 * 16 + 2 * 2 * 8 * 64 * 32        # layer 0 has no dx
    assert got["compute_s"] == pytest.approx(flops / 10e9, rel=1e-9)
    assert got["comm_s"] == 0.0 and got["bubble"] == 0.0


def test_data_parallel_halves_compute_and_adds_comm():
    model = ms.MLP([64, 32, 16])
    one = predict_step(model, "single", 8, flat(), itemsize=4)
    two = predict_step(model, "dp=2", 8, flat(), itemsize=4)
    assert two["compute_s"] == pytest.approx(one["compute_s"] / 2, rel=1e-9)
    assert two["comm_s"] > 0


def test_zero3_computes_with_the_gathered_weight():
    model = ms.MLP([64, 32, 16])
    a = rank_view(model, parse_layout("fsdp=2"), 0, 4, 8)
    b = rank_view(model, parse_layout("dp=2"), 0, 4, 8)
    assert gemms(a) == gemms(b)


def test_pipeline_bubble_is_the_simulated_one():
    assert bubble(parse_layout("pp=2,microbatches=4")) == pytest.approx(1 / 5)
    assert bubble(parse_layout("dp=2")) == 0.0
    assert shape_class(1e3) == "small" and shape_class(1e9) == "large"


def test_plan_marks_the_predicted_best_and_example_loads():
    with open(EXAMPLE) as f:
        cal = json.load(f)
    text = plan_report(ms.MLP([64, 32, 32, 16]), 4, 32, dtype=np.float32, calibration=cal)
    assert " * " in text or text.count("*") >= 1
    gpt = ms.GPT(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2)
    assert predict_step(gpt, "tp=2", 4, cal)["step_s"] > 0
