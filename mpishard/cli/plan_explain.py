"""`plan --explain`: how `--layout auto` ranks the top candidates, with the numbers that decide.

The rows are plan.plan_layouts' (with costs/choose.add_calls' calls and updates for the rule);
the ranking is costs/choose.rank_rows', the same function `--layout auto` calls.
"""
from __future__ import annotations

from ..costs.choose import RULES, rank_rows
from ..costs.step_time import ranking_seconds
from .inspect import format_bytes


def count_text(n) -> str:
    """A count in at most 7 characters: 867,072 -> '867.1 k', 999,960 -> '1.0 M', 5.8e9 ->
    '5.8 G'; '' for None."""
    if n is None:
        return ""
    for scale, unit in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if round(n / scale, 1) >= 1:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f}"


def unlent_seconds(row: dict):
    """The seconds a calibrated row ranks by (step_time.ranking_seconds) where they are not its
    step_s (a pipeline on shared cores, its idle time paid in full); None otherwise."""
    ranked = ranking_seconds(row)
    return ranked if ranked > row["step_s"] * (1 + 1e-9) else None


def unlent_text(row: dict) -> str:
    """' (unlent X ms)' for a row with unlent_seconds, '' for any other."""
    ranked = unlent_seconds(row)
    return "" if ranked is None else f" (unlent {ranked * 1e3:.2f} ms)"


def explain_report(rows, limit: int, source: str, calibrated: bool, top: int = 10) -> str:
    """`plan --explain`: `--layout auto`'s ranking (costs/choose.rank_rows) of the `top`
    candidates, with the numbers that decide it (memory against the limit, and the predicted
    step or the rule's pipeline idle fraction, bytes sent, calls and elements the optimizer
    updates: costs/choose.add_calls on `rows` first), then the nearest misses."""
    ranked = rank_rows(rows, limit, "train", calibrated)
    width = max([36] + [len(r["layout"]) + 1 for r in ranked["fit"][:top]])
    lines = [f"explain: --layout auto ranks by {RULES[ranked['rule']]}",
             f"         memory limit {format_bytes(limit)} per rank ({source}); "
             f"{len(ranked['fit'])} of {len(rows)} layouts fit",
             f"{'':4}{'layout':<{width}}{'memory':>11}{'of limit':>9}" +
             (f"{'step':>14}" if calibrated else
              f"{'pp idle':>9}{'comm/step':>11}{'calls':>7}{'updates':>10}")]
    for i, r in enumerate(ranked["fit"][:top], 1):
        decide = f" {r['step_s'] * 1e3:>10.2f} ms{unlent_text(r)}" if calibrated else \
            f"{100 * r['bubble']:>8.0f}%{format_bytes(r['comm']):>11}{r.get('calls', ''):>7}" \
            f"{count_text(r.get('updated')):>10}"
        lines.append(f"{i:>3} {r['layout']:<{width}}{format_bytes(r['memory']):>11}"
                     f"{100 * r['memory'] / limit:>8.1f}%{decide}")
    lines += [f"  nearest over the limit: {r['layout']} needs {format_bytes(r['memory'])}"
              for r in ranked["over"][:3]]
    if ranked["best"] is None:
        lines.append("  no layout fits: --layout auto would refuse to run")
    return "\n".join(lines)


__all__ = ["count_text", "explain_report", "unlent_seconds", "unlent_text"]
