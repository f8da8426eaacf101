"""`--layout auto`'s choice (costs/choose.py, cli/auto_layout.choose_layout), no MPI.

The ranking on synthetic plan rows (each key in its place: memory limit, pipeline idle, bytes,
memory; predicted time with a calibration; the KV cache for generation), the choice on a real
model's plan against a brute-force minimum over plan_layouts' rows, the refusal when nothing
fits, and decode_bytes against what each strategy sends in a forward."""
import json
from pathlib import Path

import numpy as np
import pytest

from mpishard.cli.auto_layout import choose_layout
from mpishard.cli.model_flag import model_from_flag
from mpishard.cli.plan import explain_report, plan_layouts, plan_report
from mpishard.cli.plan_explain import count_text
from mpishard.cli.plan_time import ranked_first
from mpishard.cli.usage import UsageError
from mpishard.comm.mesh import parse_layout
from mpishard.costs.choose import add_calls, decode_bytes, generate_rows, rank_rows
from mpishard.costs.call_counts import step_calls
from mpishard.costs.rank_costs import rank_memory, rank_view
from mpishard.costs.step_time import bubble, ranking_seconds
from mpishard.costs.storage import storage_for

ROOT = Path(__file__).resolve().parents[2]
MB = 2 ** 20


def row(layout, memory, comm, step_s=None, bubble_=None, cached=True):
    r = {"layout": layout, "memory": memory, "comm": comm, "step_s": step_s, "cached": cached}
    if bubble_ is not None:
        r["bubble"] = bubble_
    return r


def test_rule_orders_by_idle_then_bytes_calls_and_updates_then_memory_under_the_limit():
    rows = [row("dp=4", 9 * MB, 5 * MB), row("tp=4", 3 * MB, 1 * MB),
            row("fsdp=4,zero=1", 8 * MB, 5 * MB), row("dp=2,fsdp=2", 1.8 * MB, 5 * MB),
            row("fsdp=4", 2 * MB, 1 * MB), row("pp=4", 1 * MB, 0.1 * MB),
            row("dp=2,tp=2", 20 * MB, 0.5 * MB)]
    ranked = rank_rows(rows, 10 * MB)
    assert ranked["rule"] == "rule"
    rows[0]["calls"], rows[2]["calls"], rows[3]["calls"] = 2, 3, 4   # equal bytes: calls
    rows[1]["calls"] = 60                 # 1 MiB + 60 x 100 kB > 5 MiB + 4 x 100 kB
    ranked = rank_rows(rows, 10 * MB)
    assert [r["layout"] for r in ranked["fit"]] == ["fsdp=4", "dp=4", "fsdp=4,zero=1",
                                                    "dp=2,fsdp=2", "tp=4", "pp=4"]
    assert [r["layout"] for r in ranked["over"]] == ["dp=2,tp=2"]
    assert ranked["fit"][-1]["bubble"] == pytest.approx(bubble(parse_layout("pp=4")))
    assert ranked["fit"][-1]["bubble"] > 0
    assert rank_rows(rows, 2.5 * MB)["best"]["layout"] == "fsdp=4"
    assert rank_rows(rows, 1.5 * MB)["best"]["layout"] == "pp=4"    # only a pipeline fits
    assert rank_rows(rows, 0.5 * MB)["best"] is None
    # the optimizer's update, 4 B per element: dp=4's 2 M elements weigh 8 MB, zero=1's 4 MB
    rows[0]["updated"], rows[2]["updated"] = 2e6, 1e6
    assert [r["layout"] for r in rank_rows(rows, 10 * MB)["fit"]] == \
        ["fsdp=4", "dp=2,fsdp=2", "tp=4", "fsdp=4,zero=1", "dp=4", "pp=4"]


def test_calibration_orders_by_predicted_time():
    rows = [row("dp=4", 4 * MB, 5 * MB, 0.030), row("tp=4", 3 * MB, 1 * MB, 0.050),
            row("pp=4", 1 * MB, 0.1 * MB, 0.020)]
    ranked = rank_rows(rows, 10 * MB, calibrated=True)
    assert [r["layout"] for r in ranked["fit"]] == ["pp=4", "dp=4", "tp=4"]
    assert rank_rows(rows, 2 * MB, calibrated=True)["best"]["layout"] == "pp=4"
    rows[2]["unlent_s"] = 0.040       # on shared cores, with its idle time paid in full
    ranked = rank_rows(rows, 10 * MB, calibrated=True)
    assert [r["layout"] for r in ranked["fit"]] == ["dp=4", "pp=4", "tp=4"]


def test_validate_runs_the_rows_in_the_rankings_order():
    """plan --validate's K (plan_time.ranked_first): by unlent_s where a row has one, then
    memory, as --layout auto ranks; not by the step with lending."""
    rows = [row("dp=4", 4 * MB, 0, 0.030), row("pp=4", 1 * MB, 0, 0.020),
            row("tp=4", 3 * MB, 0, 0.030)]
    rows[1]["unlent_s"] = 0.035
    assert [r["layout"] for r in ranked_first(rows, 3)] == ["tp=4", "dp=4", "pp=4"]
    assert [r["layout"] for r in ranked_first(rows, 1)] == ["tp=4"]


def test_plan_stars_and_explain_show_the_ranking_by_unlent_time():
    """On shared cores (concurrency 4) a pipeline's idle time is paid in full for the ranking:
    plan's `unlent` column appears, its * is the least ranking_seconds, and explain appends
    the unlent time to a pipeline's step; the rule's explain shows the updates column."""
    cal = dict(json.loads((ROOT / "examples/calibration.example.json").read_text()),
               concurrency=4.0)
    model = model_from_flag("gpt", "relu", gpt="d_model=32,n_heads=4,n_layers=2,seq_len=16")
    rows, rejected = plan_layouts(model, 4, 256, calibration=cal)
    pipes = [r for r in rows if "pp=" in r["layout"]]
    assert pipes and all(r["unlent_s"] > r["step_s"] for r in pipes)
    pipes[0]["step_s"] = 1e-6             # the fastest with lending, not when paid in full
    text = plan_report(model, 4, 256, calibration=cal, layouts=(rows, rejected), top=200)
    assert "unlent: a pipeline's step as if no other rank could use the cores" in text
    assert "sorted by time (a pipeline's unlent)" in text
    limited = plan_report(model, 4, 256, calibration=cal, layouts=(rows, rejected), top=200,
                          limit=sorted(r["memory"] for r in rows)[len(rows) // 2])
    within = [r for r in rows if r["memory"] <= sorted(x["memory"] for x in rows)[len(rows) // 2]]
    best_within = min(within, key=lambda r: (ranking_seconds(r), r["memory"], r["layout"]))
    marks = {line.split()[0]: line.split()[1] for line in limited.splitlines()
             if line.split()[1:2] in (["*"], ["!"])}
    assert [k for k, v in marks.items() if v == "*"] == [best_within["layout"]]
    assert {k for k, v in marks.items() if v == "!"} == {r["layout"] for r in rows
                                                         if r not in within}
    ruled = plan_report(model, 4, 256, layouts=([dict(r, step_s=None) for r in rows],
                                                rejected), top=200,
                        limit=sorted(r["memory"] for r in rows)[len(rows) // 2])
    over = {line.split()[0] for line in ruled.splitlines() if line.split()[1:2] == ["!"]}
    assert over == {r["layout"] for r in rows if r not in within}     # without a calibration
    assert "! over --max-memory" in ruled          # without a calibration, the rule's best:
    ruled_rows = add_calls([dict(r, step_s=None) for r in rows], model, 256)
    ruled_best = rank_rows(ruled_rows, sorted(r["memory"] for r in rows)[len(rows) // 2])
    assert [line.split()[0] for line in ruled.splitlines()
            if line.split()[1:2] == ["*"]] == [ruled_best["best"]["layout"]]
    best = min(rows, key=lambda r: (ranking_seconds(r), r["memory"], r["layout"]))
    starred = [line.split()[0] for line in text.splitlines() if line.split()[1:2] == ["*"]]
    assert starred == [best["layout"]] and best["layout"] != pipes[0]["layout"]
    explained = explain_report(pipes, 2 ** 40, "--max-memory", True, top=2)
    assert explained.count("(unlent ") == 2
    ruled = explain_report(add_calls(rows, model, 256), 2 ** 40, "--max-memory", False)
    assert "updates" in ruled.splitlines()[2] and " k" in ruled
    assert count_text(867_072) == "867.1 k" and count_text(5.8e9) == "5.8 G"
    assert count_text(12) == "12" and count_text(None) == "" and count_text(999_960) == "1.0 M"


def test_generation_prefers_a_kv_cache_then_fewer_bytes():
    rows = [row("cp=2", 1 * MB, 0, cached=False), row("tp=2", 2 * MB, 100),
            row("dp=2", 4 * MB, 0)]
    assert [r["layout"] for r in rank_rows(rows, 8 * MB, "generate")["fit"]] == \
        ["dp=2", "tp=2", "cp=2"]
    assert rank_rows(rows, 3 * MB, "generate")["best"]["layout"] == "tp=2"
    with pytest.raises(ValueError, match="purpose"):
        rank_rows(rows, MB, "serve-me")


@pytest.mark.parametrize("spec,batch,calibrated", [("784,256,256,10", 64, False),
                                                   ("784,256,256,10", 64, True),
                                                   ("gpt", 8, False)])
def test_choice_is_the_plans_best_that_fits(spec, batch, calibrated):
    model = model_from_flag(spec, "relu", gpt="d_model=32,n_heads=4,n_layers=2,seq_len=16"
                            if spec == "gpt" else None)
    cal = json.loads((ROOT / "examples/calibration.example.json").read_text()) \
        if calibrated else None
    rows, _ = plan_layouts(model, 4, batch, calibration=cal)
    limit = sorted(r["memory"] for r in rows)[len(rows) // 2]        # about half fit
    fit = [r for r in rows if r["memory"] <= limit]
    calls = {r["layout"]: max(sum(step_calls(rank_view(model, parse_layout(r["layout"]), k,
                                                       4, batch)).values()) for k in range(4))
             for r in rows}
    updated = {r["layout"]: max(sum(np.prod(b) for b in rank_view(
        model, parse_layout(r["layout"]), k, 4, batch).grad_blocks.values()) for k in range(4))
        for r in rows}
    key = (lambda r: ranking_seconds(r)) if calibrated else \
        (lambda r: (bubble(parse_layout(r["layout"])), r["comm"] + 1e5 * calls[r["layout"]]
                    + 4 * updated[r["layout"]], r["memory"]))
    choice = choose_layout(model, 4, limit, batch, calibration=cal)
    best = min(fit, key=key)
    assert key(next(r for r in rows if r["layout"] == choice["layout"])) == key(best)
    assert choice["layout"] in choice["line"] and f"of {len(rows)} layouts fit" in choice["line"]
    assert ("predicted" in choice["line"]) == calibrated
    assert ("no --calibration" in choice["line"]) == (not calibrated)
    text = explain_report(rows if calibrated else add_calls(rows, model, batch), limit,
                          "--max-memory", calibrated, top=3)
    assert choice["layout"] in text.splitlines()[3] and "over the limit" in text
    table = plan_report(model, 4, batch, calibration=cal, limit=limit, top=len(rows)).split(
        "\n\n")[1].splitlines()[1:]      # plan's default order is auto's, the fitting first
    assert table[0].startswith(f"{choice['layout']} *")
    assert [line.split()[0] for line in table] == [r["layout"] for r in sorted(
        rows, key=lambda r: (r["memory"] > limit,) + ((key(r), r["memory"], r["layout"])
                                                      if calibrated else
                                                      (key(r), len(r["layout"]), r["layout"])))]
    assert sum("*" in line.split()[1] for line in table) == 1


def test_plan_sorts_by_time_only_with_a_calibration():
    model = model_from_flag("784,256,256,10", "relu")
    with pytest.raises(ValueError, match="--sort time needs --calibration FILE"):
        plan_report(model, 4, 64, sort="time")
    assert "sorted by --layout auto's rule of thumb" in plan_report(model, 4, 64, sort="auto")
    cal = json.loads((ROOT / "examples/calibration.example.json").read_text())

    def order(text):
        return [line.split()[0] for line in text.split("\n\n")[1].splitlines()[1:]]
    ruled = plan_report(model, 4, 64, calibration=cal, sort="rule", top=99)  # the rule's
    assert order(ruled) == order(plan_report(model, 4, 64, top=99))      # numbers, calibrated
    assert order(ruled) != order(plan_report(model, 4, 64, calibration=cal, top=99))


def test_nothing_fits_names_the_smallest_need():
    model = model_from_flag("64,128,10", "relu")
    rows, _ = plan_layouts(model, 2, 64)
    least = min(rows, key=lambda r: r["memory"])
    with pytest.raises(UsageError, match=f"no layout of 2 rank.s. fits in 1.0 KiB per rank "
                                         f".--max-memory.: the smallest, {least['layout']}"):
        choose_layout(model, 2, 1024, 64)


def test_decode_bytes_per_strategy():
    model = model_from_flag("gpt", "relu", gpt="d_model=32,n_heads=4,n_layers=2,seq_len=16")
    d = model.d_model

    def sent(text, rows=4):
        return max(decode_bytes(model, parse_layout(text), r, rows) for r in range(4))
    assert sent("dp=4") == 0 and sent("fsdp=4,zero=1") == 0 and sent("fsdp=4,zero=2") == 0
    assert sent("fsdp=4,zero=3") > 4 * 1000        # the weights gathered every step
    # pp: one activation row of d_model floats per prompt per boundary, forward only
    assert sent("pp=2,dp=2", rows=4) == pytest.approx(2 * d * 4, rel=0.01)
    assert sent("tp=4", rows=4) > sent("tp=4", rows=1) > 0
    rows, rejected = generate_rows(model, ["dp=4", "cp=4", "tp=4", "tp=3"], rows=2)
    assert [r["cached"] for r in rows] == [True, False, True] and rejected[0][0] == "tp=3"
    assert choose_layout(model, 4, 2 ** 30, purpose="generate", rows=2)["layout"] == "dp=4"
    (dp, tp), _ = generate_rows(model, ["dp=4", "tp=4"], rows=8)
    params = rank_memory(model, parse_layout("dp=4"), 0, 4)["parameters"]
    kv = 2 * model.n_layers * 2 * model.seq_len * d * 4        # k, v: 2 rows per dp rank
    assert dp["memory"] >= params + kv and tp["memory"] < dp["memory"]
    limit = (dp["memory"] + tp["memory"]) // 2                  # dp=4 no longer fits
    choice = choose_layout(model, 4, limit, purpose="generate", rows=8)
    best = choice["ranked"]["best"]
    assert best["layout"] != "dp=4" and best["cached"] and best["memory"] <= limit
    assert best["comm"] == min(r["comm"] for r in choice["ranked"]["fit"] if r["cached"])


def test_a_16_bit_gpu_step_is_priced_as_it_holds_its_arrays(monkeypatch):
    """choose_layout with compute_dtype bfloat16 on the GPU prices the saved matmul inputs in
    2 bytes and the attention's log-sum-exp: a limit between its need and float32's lets
    the 16-bit step run where float32's pricing would refuse every layout; the line says
    what was priced. The CPU's emulation needs more than float32 (rounded copies)."""
    monkeypatch.delenv("MPISHARD_FUSED", raising=False)
    model = model_from_flag("gpt", "relu", gpt="vocab_size=512,seq_len=128,d_model=64,"
                                               "n_heads=4,n_layers=2")
    need = {key: min(r["memory"] for r in plan_layouts(
        model, 2, 16, storage=storage_for("float32", *key))[0])
        for key in ((None, "cpu"), ("bfloat16", "gpu"), ("bfloat16", "cpu"))}
    assert need["bfloat16", "gpu"] < 0.8 * need[None, "cpu"] < need["bfloat16", "cpu"]
    limit = (need["bfloat16", "gpu"] + need[None, "cpu"]) // 2
    with pytest.raises(UsageError, match="no layout"):
        choose_layout(model, 2, limit, 16)
    choice = choose_layout(model, 2, limit, 16, compute_dtype="bfloat16", device="gpu")
    assert "16 rows a forward in float32 (bfloat16 compute on the GPU)" in choice["line"]
    assert choice["ranked"]["best"]["memory"] <= limit


def test_a_16_bit_gpu_generation_prices_its_kv_cache_in_2_bytes(monkeypatch):
    """generate's --layout auto on the GPU with compute_dtype bfloat16: the KV cache (k and
    v as the matmuls take them, nn/kv_cache.py) in 2 bytes an element, half of float32's;
    the parameters as they are; the line says what was priced."""
    monkeypatch.delenv("MPISHARD_FUSED", raising=False)
    model = model_from_flag("gpt", "relu", gpt="vocab_size=64,seq_len=256,d_model=64,"
                                               "n_heads=4,n_layers=2")
    wide, _ = generate_rows(model, ["dp=2"], rows=8)
    low, _ = generate_rows(model, ["dp=2"], rows=8,
                           storage=storage_for("float32", "bfloat16", "gpu"))
    params = rank_memory(model, parse_layout("dp=2"), 0, 4)["parameters"]
    kv = 2 * model.n_layers * 4 * model.seq_len * model.d_model       # 4 rows per dp rank
    assert wide[0]["memory"] - low[0]["memory"] == kv * 2 and low[0]["memory"] > params
    choice = choose_layout(model, 2, 2 ** 30, purpose="generate", rows=8,
                           compute_dtype="bfloat16", device="gpu")
    assert "in float32 (bfloat16 compute on the GPU)" in choice["line"]
