"""The end-of-training table rank 0 prints, from the Trainer's metrics dict."""
from __future__ import annotations


def _number(value, spec: str, suffix: str = "") -> str:
    """`value` formatted with `spec`, or "-" where it is unknown (evaluation turned off)."""
    return "-" if value is None else f"{value:{spec}}{suffix}"


def rate_text(per_s: float) -> str:
    """A rate for people: whole numbers from 100 up, three significant digits below (a
    GPT-2-small step on a few cores is well under one sample a second, not 0)."""
    return f"{per_s:.0f}" if per_s >= 100 else f"{per_s:.3g}"


def summary_table(metrics: dict) -> str:
    """The end-of-training table (rank 0 prints it)."""
    acc = metrics.get("test_accuracy")
    rows = [("layout", metrics["layout"]),
            ("world size", str(metrics["world_size"])),
            ("model", metrics.get("model", "")),
            ("dataset", metrics.get("dataset", "")),
            ("steps", f"{metrics['steps']} ({metrics.get('epochs', 0):.2f} epochs)"),
            ("final loss", _number(metrics["final_loss"], ".6g")),
            ("test loss", _number(metrics["test_loss"], ".6g")),
            ("test accuracy", _number(None if acc is None else 100 * acc, ".2f", "%")),
            ("samples/s", rate_text(metrics['samples_per_s'])),
            ("wall time", f"{metrics['wall_time_s']:.2f} s")]
    unit = next((u for u in ("byte", "token") if f"val_bits_per_{u}" in metrics), None)
    if unit is not None:                                  # a language model (train/text.py)
        rows[7:8] = [(f"val bits/{unit}", _number(metrics[f"val_bits_per_{unit}"], ".4f")),
                     ("tokens/s", rate_text(metrics['tokens_per_s']))]
    w0 = max(len(k) for k, _ in rows)
    w1 = max(len(v) for _, v in rows)
    line = f"+-{'-' * w0}-+-{'-' * w1}-+"
    body = [f"| {k:<{w0}} | {v:<{w1}} |" for k, v in rows]
    return "\n".join([line, *body, line])


__all__ = ["rate_text", "summary_table"]
