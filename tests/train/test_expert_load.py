"""The expert-load line (train/expert_load.py): its fields from engine.stats, and a real
`train --model llama:...,n_experts=4` run whose metrics records and log lines carry the
step's tokens per expert (min/max over experts, every block's assignments adding up to
blocks x tokens x top_k: the training step's, not those of the evaluation after it)."""
import json

import pytest

from mpishard.cli import main
from mpishard.cli.model_flag import model_from_flag
from mpishard.cli.usage import UsageError
from mpishard.train.expert_load import expert_load, expert_text

MOE = "llama:d_model=16,n_heads=4,n_kv_heads=2,n_layers=2,seq_len=16,n_experts=4,top_k=2"


def test_fields_of_the_statistics():
    assert expert_load({}) == {} and expert_text(expert_load({})) == ""
    stats = {"moe_blocks": {0: ([6, 2, 4, 4], [6, 2, 4, 4]), 1: ([4, 4, 4, 4], [3, 4, 4, 4])},
             "moe_routed": [10, 6, 8, 8], "moe_kept": [9, 6, 8, 8], "moe_dropped": 1}
    assert expert_load(stats) == {"expert_tokens": [10, 6, 8, 8], "expert_tokens_min": 6,
                                  "expert_tokens_max": 10, "expert_imbalance": 1.5,
                                  "moe_dropped": 1}
    assert expert_text(expert_load(stats)) == " experts min/max 6/10 imbalance 1.5 dropped 1"
    moe = {"moe_routed": [3, 5], "moe_kept": [3, 5], "moe_dropped": 0}     # ms.MoE's
    assert expert_load(moe)["expert_imbalance"] == 1.25
    assert expert_text(expert_load(moe)) == " experts min/max 3/5 imbalance 1.25"


def test_the_model_flag_takes_the_expert_keys():
    m = model_from_flag(MOE + ",capacity_factor=1.5,router_aux_loss_coef=0.01")
    assert (m.n_experts, m.top_k, m.capacity_factor, m.router_aux_loss_coef) == \
        (4, 2, 1.5, 0.01)
    assert model_from_flag(MOE.replace(",n_experts=4,top_k=2", "")).n_experts is None
    with pytest.raises(UsageError, match="router_aux_loss_coef must be a number >= 0"):
        model_from_flag(MOE + ",router_aux_loss_coef=-1")


def test_a_mixtral_run_logs_its_expert_load(tmp_path, capfd):
    jsonl = tmp_path / "m.jsonl"
    args = ["train", "--model", MOE, "--corpus-bytes", "20000", "--batch", "8", "--lr", "0.01",
            "--no-progress", "--log-every", "2", "--dtype", "float64", "--steps", "4",
            "--eval-every", "2", "--metrics-jsonl", str(jsonl)]
    assert main(args) == 0
    train = [json.loads(s) for s in jsonl.read_text().splitlines()]
    train = [r for r in train if r["kind"] == "train"]
    assert [r["step"] for r in train] == [2, 4]
    for r in train:
        assert sum(r["expert_tokens"]) == 2 * 8 * 16 * 2      # blocks x B T x top_k
        assert (r["expert_tokens_min"], r["expert_tokens_max"]) == \
            (min(r["expert_tokens"]), max(r["expert_tokens"]))
        assert r["expert_imbalance"] >= 1.0 and r["moe_dropped"] == 0
    lines = [m for m in capfd.readouterr().err.splitlines() if "INFO mpishard: step " in m]
    assert len(lines) == 2 and all(" experts min/max " in m for m in lines), lines
    r = train[-1]
    assert f"experts min/max {r['expert_tokens_min']}/{r['expert_tokens_max']} " in lines[-1]
