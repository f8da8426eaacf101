"""Which layers go where in a pipeline (no MPI): the options of a pp layout and the
assignment of layers to (virtual) stages, balanced by parameter count or given by `stages=`.
Both read a parsed comm.mesh.Layout.
"""
from __future__ import annotations

from functools import lru_cache
from math import prod


def pipeline_options(layout):
    """(pp, schedule name, virtual stages, microbatches) of a Layout; ValueError if they clash."""
    pp = layout.size("pp")
    name = layout.option("schedule", "1f1b")
    v = layout.option("virtual_stages", 2 if name == "interleaved" else 1)
    m = layout.option("microbatches", pp)
    if name == "interleaved" and v < 2:
        raise ValueError(f"schedule=interleaved needs virtual_stages >= 2, got {v} "
                         f"(layout {layout.text!r})")
    if name != "interleaved" and v != 1:
        raise ValueError(f"virtual_stages={v} needs schedule=interleaved, got schedule={name} "
                         f"(layout {layout.text!r})")
    if m < 1:
        raise ValueError(f"microbatches must be >= 1, got {m} (layout {layout.text!r})")
    return pp, name, v, m


@lru_cache(maxsize=256)                 # the planner asks again for every layout and rank
def _balanced_counts(costs: tuple, parts: int) -> tuple:
    """Layers per part: contiguous, >= 1 each, the largest part's cost as small as possible,
    then the sum of squared part costs as small as possible (an even split of equal layers)."""
    n = len(costs)
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def seg(i, j):                                     # cost of layers i..j-1
        return prefix[j] - prefix[i]

    inf = float("inf")
    # pass 1: the smallest possible maximum part cost
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for j in range(k, n - (parts - k) + 1):
            best[k][j] = min(max(best[k - 1][i], seg(i, j)) for i in range(k - 1, j))
    cap = best[parts][n]
    # pass 2: among splits under that cap, the most even one (first cut on ties)
    sq = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    sq[0][0] = 0
    for k in range(1, parts + 1):
        for j in range(k, n - (parts - k) + 1):
            for i in range(k - 1, j):
                if seg(i, j) <= cap and sq[k - 1][i] + seg(i, j) ** 2 < sq[k][j]:
                    sq[k][j], cut[k][j] = sq[k - 1][i] + seg(i, j) ** 2, i
    counts, j = [], n
    for k in range(parts, 0, -1):
        counts.append(j - cut[k][j])
        j = cut[k][j]
    return tuple(counts[::-1])


def assign_stages(model, layout) -> list:
    """Virtual-stage index (0 .. pp*v - 1) of every layer: contiguous, non-decreasing.

    Default: balance the parameter count over the pp*v virtual stages (each gets >= 1 layer);
    with schedule=interleaved the virtual stages must divide the layer count. The layout
    option `stages=2+1+1` (layers per virtual stage) overrides. Raises ValueError with the
    numbers, the same on every rank (no communication happens here).
    """
    pp, name, v, _ = pipeline_options(layout)
    n, k_total = model.n_layers, pp * v
    what = f"pp={pp}" + (f" x virtual_stages={v} = {k_total} virtual stages" if v > 1 else "")
    if k_total > n:
        raise ValueError(f"{what} needs at least {k_total} layers, model has {n}")
    text = layout.option("stages")
    if text is not None:
        try:
            counts = [int(p) for p in str(text).split("+")]
        except ValueError:
            raise ValueError(f"stages={text!r}: expected layer counts joined by '+', "
                             f"e.g. stages=2+1+1") from None
        if len(counts) != k_total:
            raise ValueError(f"stages={text} names {len(counts)} stages, but {what} needs "
                             f"{k_total}")
        if min(counts) < 1:
            raise ValueError(f"stages={text}: every stage needs at least 1 layer")
        if sum(counts) != n:
            raise ValueError(f"stages={text} sums to {sum(counts)} layers, model has {n}")
    else:
        if v > 1 and n % k_total:
            raise ValueError(f"{what} do not divide the model's {n} layers (interleaving "
                             f"needs equal chunks; give stages= to split unevenly)")
        costs = tuple(sum(prod(s) for s in spec.param_shapes.values())
                      for spec in model.layers())
        counts = _balanced_counts(costs, k_total)
    return [k for k, c in enumerate(counts) for _ in range(c)]
