"""The per-step expert load of a mixture-of-experts model, for the log line and the metrics.

A Mixtral's blocks (models/llama/experts.RoutingStats) and ms.MoE (expert_parallel.py)
leave in `engine.stats` the assignments routed to each expert in their last forward, summed
over every rank holding different tokens (the same numbers on each of them):

    moe_routed [E]                    (token, choice) assignments per expert, blocks summed
    moe_blocks {block: (routed [E], kept [E])}    a Mixtral's, per block of this rank's stage
    moe_dropped                       assignments over capacity (0 without capacity_factor)

`expert_load(stats)` turns them into the record's fields (none for a dense model):

    expert_tokens                           moe_routed (assignments per expert, blocks summed)
    expert_tokens_min, expert_tokens_max    its min and max over experts
    expert_imbalance                        the worst block's max / mean over its experts
                                            (1.0 is perfectly even; E/k when every token
                                            picks the same k experts)
    moe_dropped

and `expert_text` those into the log line's ` experts min/max 30/52 imbalance 1.31`. The
Trainer takes them after each train_step (`trainer.expert_load`, before an evaluation's
forwards replace the statistics): the step's last micro-batch's. Under pp rank 0 logs, and
sees its own stage's blocks.
"""
from __future__ import annotations


def expert_load(stats: dict) -> dict:
    """The record fields of `stats` (module docstring); {} without expert statistics."""
    routed = stats.get("moe_routed")
    if not routed:
        return {}
    blocks = [r for r, _ in stats.get("moe_blocks", {}).values()] or [routed]
    worst = max(max(r) * len(r) / sum(r) if sum(r) else 1.0 for r in blocks)
    return {"expert_tokens": [int(n) for n in routed],
            "expert_tokens_min": int(min(routed)), "expert_tokens_max": int(max(routed)),
            "expert_imbalance": float(worst), "moe_dropped": int(stats.get("moe_dropped", 0))}


def expert_text(load: dict) -> str:
    """` experts min/max A/B imbalance R[ dropped N]` for the log line of an expert_load()
    result, or ''."""
    if not load:
        return ""
    dropped = f" dropped {load['moe_dropped']}" if load["moe_dropped"] else ""
    return (f" experts min/max {load['expert_tokens_min']}/{load['expert_tokens_max']} "
            f"imbalance {load['expert_imbalance']:.3g}{dropped}")
