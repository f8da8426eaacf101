"""Which layout to run: the candidate ranked first among those predicted to fit under a memory
limit (no MPI).

`plan`'s rows (cli/plan.plan_layouts: every layout the engine accepts, its busiest rank's
memory and bytes sent per step, and with a calibration its predicted step time) are ranked
by one of two keys, the smallest first, among the rows whose memory is at most the limit:

  calibrated    the predicted seconds per step (costs/step_time.py), a pipeline's with its
                idle time paid in full (step_time.ranking_seconds: on ranks sharing cores
                the lending of an idle stage's core is not trusted to decide).
  rule          without a calibration, a rule of thumb: (pipeline idle fraction, bytes
                sent per step by the busiest rank + CALL_BYTES per communication call +
                UPDATE_BYTES per element its optimizer updates, memory). Every axis but pp
                splits the train_step's arithmetic evenly over its ranks, so the ranks'
                compute is alike across layouts except for the pipeline schedule's idle
                fraction (its simulated bubble, step_time.bubble), which costs that share
                of every step on a core per rank: it goes first. Among layouts idling
                alike, the communication decides: its bytes (ZeRO-3's re-gathers, tp's
                activations, dp's gradients) and its calls (call_counts.step_calls), each
                of which pays a latency and makes every rank of its group wait for the
                slowest (tp's per-layer all-reduces); and the optimizer's update, the one
                arithmetic that dp repeats on every replica and ZeRO, fsdp and tp split
                (AdamW reads and writes four arrays per element); the smaller memory breaks
                a tie. So a pipeline is chosen only when nothing without one fits.
                CALL_BYTES and UPDATE_BYTES were set on this project's CPU runs
                (benchmarks/layout_auto_check.py; the numbers are in
                docs/planning-and-tracing.md). UPDATE_BYTES prices AdamW's update whatever
                --optimizer is (SGD's is lighter).

For generation (`generate`, `serve`) there is no decode cost model yet; the rule there:
fits in memory (generate_memory: the parameters, ZeRO-3's gathered weights and the KV
cache, no gradients or optimizer state), then a KV cache (the
layouts decoder.check_decode allows: not cp, not sequence_parallel, which recompute the
context every token), then the fewest bytes the busiest rank sends per decoded token
(`decode_bytes`), then the smaller memory.
"""
from __future__ import annotations

from math import ceil, prod

from ..comm.mesh import parse_layout
from ..parallel import data_parallel, fsdp, pipeline, tied
from ..parallel.decode import decodes_with_cache
from . import call_counts
from .peak_memory import rank_peak
from .rank_costs import check_fit, rank_view, strategy_costs
from .step_time import bubble, ranking_seconds, representative_ranks

PURPOSES = ("train", "generate")
CALL_BYTES = 100_000      # the rule prices a communication call as this many bytes sent
UPDATE_BYTES = 4          # ... and an element the rank's optimizer updates as this many
RULES = {
    "calibrated": "the predicted step time (--calibration; a pipeline's with its idle time "
                  "paid in full)",
    "rule": "a rule of thumb, as no --calibration was given: the least pipeline idle "
            "time, then the fewest bytes sent per step counting 100 kB per call and 4 B per "
            "element the optimizer updates, then the least memory",
    "generate": "a KV cache, then the fewest bytes sent per decode step (a token for every "
                "prompt), then the least memory (no decode cost model yet)",
}


def train_key(row: dict, calibrated: bool) -> tuple:
    """The ranking key of one plan row (module docstring); smaller is better."""
    if calibrated:
        return (ranking_seconds(row), row["memory"], row["layout"])
    return (row.get("bubble", 0.0), rule_bytes(row), row["memory"], len(row["layout"]),
            row["layout"])


def rule_bytes(row: dict) -> float:
    """The rule's second key: the bytes sent per step, CALL_BYTES per call and UPDATE_BYTES
    per element the rank's optimizer updates (without add_calls' numbers, the bytes)."""
    return row["comm"] + CALL_BYTES * row.get("calls", 0) + UPDATE_BYTES * row.get("updated", 0)


def add_calls(rows: list, model, batch: int, itemsize: int = 4) -> list:
    """`rows` (plan rows, changed in place and returned) with what the rule counts besides
    bytes (module docstring): 'bubble', the pipeline's idle fraction, and, each the largest
    over the representative ranks (not always the same rank), 'calls', the communication
    calls per training step, and 'updated', the elements its optimizer updates (its
    gradient blocks)."""
    for row in rows:
        layout = parse_layout(row["layout"])
        row.setdefault("bubble", bubble(layout))
        views = [rank_view(model, layout, r, itemsize, batch)
                 for r in representative_ranks(layout)]
        row["calls"] = max(sum(call_counts.step_calls(view).values()) for view in views)
        row["updated"] = max(sum(prod(b) for b in view.grad_blocks.values()) for view in views)
    return rows


def generate_key(row: dict) -> tuple:
    return (not row["cached"], row["comm"], row["memory"], len(row["layout"]), row["layout"])


def rank_rows(rows: list, max_memory: float, purpose: str = "train",
              calibrated: bool = False) -> dict:
    """{'fit': the rows at most `max_memory`, best first; 'over': the others, least memory
    first; 'rule': RULES' key of the ranking used; 'best': the first fitting row or None}.
    Train rows without 'bubble' get it from their layout (step_time.bubble)."""
    if purpose not in PURPOSES:
        raise ValueError(f"purpose must be one of {PURPOSES}, got {purpose!r}")
    if purpose == "train":
        for row in rows:
            row.setdefault("bubble", bubble(parse_layout(row["layout"])))
        rule = "calibrated" if calibrated else "rule"
        key = lambda r: train_key(r, calibrated)     # noqa: E731
    else:
        rule, key = "generate", generate_key
    fit = sorted((r for r in rows if r["memory"] <= max_memory), key=key)
    over = sorted((r for r in rows if r["memory"] > max_memory),
                  key=lambda r: (r["memory"], r["layout"]))
    return {"fit": fit, "over": over, "rule": rule, "best": fit[0] if fit else None}


def decode_bytes(model, layout, rank: int, rows: int, itemsize: int = 4) -> float:
    """Bytes `rank` sends per decode step of `rows` prompts (one new token each), estimated
    from the training step's cost model: the strategies that move activations (all but dp's
    and ZeRO-1/2's gradient exchange and the tied copies') send the same bytes forward as
    backward on each rank, so half their train_step bytes per trained token, times this
    rank's rows; the pipeline's stages send one way each (activations on, gradients back),
    so its busiest rank's bytes are the forward's, not halved; a ZeRO-3 forward gathers the
    rank's weights once per step (half of a microbatch's gathers, the backward has the
    other half)."""
    m = check_fit(model, layout)
    data = layout.data_parallel_size
    view = rank_view(model, layout, rank, itemsize, batch=m * data)
    tokens = view.rows * (model.seq_len if model.takes_tokens else 1)
    moved = 0.0
    for strategy in strategy_costs(model):
        if strategy in (data_parallel, fsdp, tied):
            continue
        sent = sum(strategy.step_comm(view).get("train_step", {}).values())
        moved += sent if strategy is pipeline else sent / 2
    gathers = fsdp.step_comm(view).get("train_step", {}).get("all_gather", 0)
    return moved / tokens * ceil(rows / data) + gathers / m / 2


def generate_memory(model, layout, rank: int, rows: int, max_len: int, itemsize: int = 4,
                    cached: bool = True, storage=None) -> int:
    """Bytes `rank` holds to generate `rows` prompts of up to `max_len` tokens: its parameters,
    the weights ZeRO-3 gathers for a forward and its rows' KV cache (peak_memory.rank_peak's
    parameters, gathered and kv_cache; no gradients, optimizer state or saved activations;
    storage: costs/storage.py, the cache's bytes under a compute dtype)."""
    m, data = check_fit(model, layout), layout.data_parallel_size
    peak = rank_peak(model, layout, rank, m * data, itemsize, "sgd",
                     generate=(ceil(rows / data), max_len) if cached else None,
                     storage=storage)
    return peak["parameters"] + peak["gathered"] + peak["kv_cache"]


def generate_rows(model, layouts, rows: int = 1, itemsize: int = 4, max_len=None,
                  storage=None) -> tuple:
    """(rows, rejected) like plan_layouts' for generation: per layout text of `layouts` the
    busiest rank's generate_memory ('memory'; `max_len` default the model's seq_len),
    decode_bytes ('comm') and whether it decodes with a KV cache ('cached'); rejected =
    [(layout, the engine's reason)]; storage: generate_memory's."""
    out, rejected = [], []
    max_len = max_len or getattr(model, "seq_len", 1)
    for text in layouts:
        try:
            layout = parse_layout(text)
            check_fit(model, layout)
            ranks = representative_ranks(layout)
            cached = decodes_with_cache(layout)
            memory = max(generate_memory(model, layout, r, rows, max_len, itemsize, cached,
                                         storage)
                         for r in ranks)
            comm = max(decode_bytes(model, layout, r, rows, itemsize) for r in ranks)
        except ValueError as exc:
            rejected.append((text, str(exc)))
            continue
        out.append({"layout": text, "memory": memory, "comm": comm, "cached": cached,
                    "step_s": None})
    return out, rejected
