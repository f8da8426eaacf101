"""The end-of-training table rank 0 prints, from the Trainer's metrics dict."""
from __future__ import annotations


def _number(value, spec: str, suffix: str = "") -> str:
    """`value` formatted with `spec`, or "-" where it is unknown (evaluation turned off)."""
    return "-" if value is None else f"{value:{spec}}{suffix}"


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
            ("samples/s", f"{metrics['samples_per_s']:.0f}"),
            ("wall time", f"{metrics['wall_time_s']:.2f} s")]
    unit = next((u for u in ("byte", "token") if f"val_bits_per_{u}" in metrics), None)
    if unit is not None:                                  # a language model (train/text.py)
        rows[7:8] = [(f"val bits/{unit}", _number(metrics[f"val_bits_per_{unit}"], ".4f")),
                     ("tokens/s", f"{metrics['tokens_per_s']:.0f}")]
    w0 = max(len(k) for k, _ in rows)
    w1 = max(len(v) for _, v in rows)
    line = f"+-{'-' * w0}-+-{'-' * w1}-+"
    body = [f"| {k:<{w0}} | {v:<{w1}} |" for k, v in rows]
    return "\n".join([line, *body, line])


__all__ = ["summary_table"]
