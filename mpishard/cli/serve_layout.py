"""serve's `--layout`: the layouts a server runs, and `--layout auto` among them.

A server runs tp, pp and dp (replicas, serve/replicas.py), each replica decoding with a KV
cache (parallel/decoder.check_decode): fsdp, cp, ep and sequence_parallel are refused.

`--layout auto` ranks those of the job's world size by the generation rule of
costs/choose.rank_rows (docs/planning-and-tracing.md): a layout predicted to fit in
--max-memory per rank (parameters and this rank's KV cache: each replica holds --max-batch
rows of --max-model-len positions), then the fewest bytes sent per decode step, then the
least memory; so replicas come first whenever the model fits on fewer ranks. There is no
decode cost model yet: the rule does not predict tokens/s. No MPI here: every rank decides
from the same inputs (cli/auto_layout.py agrees on the limit first and on the choice after).
"""
from __future__ import annotations

import numpy as np

from ..comm.mesh import parse_layout
from ..costs.choose import generate_rows, rank_rows
from ..parallel.decoder import check_decode
from ..serve.replicas import split_replicas
from .auto_layout import AUTO, choice_line
from .device_options import held_storage
from .inspect import format_bytes
from .plan import candidate_layouts
from .usage import UsageError, checked_layout


def serve_layout(args, size: int) -> tuple:
    """(the layout, replicas, one replica's layout text) after serve's checks (UsageError);
    args.layout: a layout, None (single on one rank, else dp over all) or already chosen."""
    layout = checked_layout(args.layout or ("single" if size == 1 else f"dp={size}"), size)
    try:
        replicas, inner = split_replicas(layout.text, size)
        check_decode(layout)
    except ValueError as exc:
        raise UsageError(f"--layout: {exc}") from None
    return layout, replicas, inner


def serves(text: str, size: int) -> bool:
    """Whether a server runs the layout `text` on `size` ranks."""
    try:
        split_replicas(text, size)
        check_decode(parse_layout(text))
    except ValueError:
        return False
    return True


def auto_layout(args, model, size: int, dtype) -> str:
    """--layout auto (module docstring): the chosen layout's text; args.layout_line says why.
    The KV pool is priced as the run holds it (costs/storage.py: its --compute-dtype, on the
    GPU where every rank computes on one). UsageError naming the smallest need when none
    fits."""
    limit, source = args.max_memory_limit
    itemsize = np.dtype(dtype).itemsize
    storage = held_storage(args, dtype, getattr(args, "planned_device", "cpu"))
    texts = [t for t in candidate_layouts(size, None, model.seq_len, model.planned_experts())
             if serves(t, size)]
    rows = []
    for text in texts:                   # each replica holds --max-batch rows
        found, _ = generate_rows(model, [text], args.max_batch * parse_layout(text).size("dp"),
                                 itemsize, args.max_model_len, storage)
        rows += found
    ranked = rank_rows(rows, limit, "generate")
    if ranked["best"] is None:
        least = ranked["over"][0] if ranked["over"] else None
        raise UsageError(f"--layout auto: no layout serve runs on {size} rank(s) fits in "
                         f"{format_bytes(limit)} per rank ({source})"
                         + (f": the smallest, {least['layout']}, needs "
                            f"{format_bytes(least['memory'])} with --max-batch "
                            f"{args.max_batch} --max-model-len {args.max_model_len}"
                            if least else ""))
    args.layout_line = choice_line(ranked, limit, source, len(rows),
                                   f"{args.max_batch} row(s) a replica of up to "
                                   f"{args.max_model_len} positions")
    return ranked["best"]["layout"]


__all__ = ["AUTO", "auto_layout", "serve_layout", "serves"]
