"""Measuring this machine for the step-time model (step_time.py): the kernels' micro-benchmarks,
on every rank of the MPI job at once (as in training: cores shared by more ranks than they
have show in every rate), through the engine's own functions, and the calibration file.
cli/calibrate.py (`plan --calibrate [FILE]`) adds what needs an engine (the collectives, the
whole-step factors) and writes the file; its docstring lists every field.

    gemm, bgemm   GFLOP/s of one nn.functional.einsum GEMM call by FLOPs per call: a layer's
                  three ('bd,df->bf', 'bd,bf->df', 'bf,df->bd': x (n, n), W (n, 2n),
                  n = 32 ... 512) and the attention's batched 'bhtd,bhsd->bhts' (16 heads x
                  T x 32, T = 32 ... 256)
    concurrency   the 256-GEMM's rate on rank 0 alone (the others waiting as a pipeline
                  stage in its bubble waits: the `alone` timer passed in) over its rate with
                  every rank busy: 1 with a core per rank, up to ranks / free cores when they
                  share; what a pipeline's idle stage lends the busy ones
                  (step_time.bubble_factor)
    ops           seconds per element of the element-wise work at 2**12, 2**15, 2**18 and
                  2**21 elements (small arrays pay the call, large ones miss the caches;
                  each call on other copies of its arrays, 16 MiB in all, so they come from
                  memory as a step's do):
                  'pass' (one allocating add), each activation's forward + backward,
                  layernorm, cross-entropy, embedding gather + scatter, AdamW (the optimizer
                  passed in); and attention's softmax per score (its forward + backward less
                  its seven batched GEMMs, 16 heads x T x T, T = 32 ... 256)

Each time is the median over repeats of the slowest rank's mean over a window of >= 0.1 s
(several scheduler periods, so cores shared with other processes show as the share they
give), the repeats taken in passes over a whole group of measurements (every GEMM size, every
op and size, every collective point), so a burst of load spreads over the group instead of
spoiling one point.
"""
from __future__ import annotations

import json
import os
import time

import numpy as np
from mpi4py import MPI

from ..nn import attention, functional as nn
from ..nn.losses import CrossEntropy

GEMM_SIDES = (32, 64, 128, 256, 512)
BATCHED_T = (32, 64, 128, 256)
HEADS, HEAD_DIM = 16, 32
OP_SIZES = (2 ** 12, 2 ** 15, 2 ** 18, 2 ** 21)
COLD_BYTES = 16 << 20            # the ops' arrays rotate through at least this much memory
ACTIVATIONS = ("relu", "gelu", "tanh", "sigmoid")
WINDOW, REPEATS = 0.1, 5
DEFAULT_PATH = os.path.join("~", ".cache", "mpishard", "calibration.json")
VERSION = 2


def _window(fn, inner: int, comm) -> float:
    """The slowest rank's seconds per call over `inner` calls, started together."""
    comm.Barrier()
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    return comm.allreduce((time.perf_counter() - t0) / inner, op=MPI.MAX)


def _calls_per_window(fn, comm, window: float) -> int:
    """Calls of `fn` that fill `window` seconds with every rank calling it at once: the count
    doubles until a window takes a quarter of it, then scales (the same on every rank)."""
    fn()
    inner = 1
    while True:
        per_call = _window(fn, inner, comm)
        if per_call * inner >= window / 4 or inner >= 2 ** 16:
            break
        inner *= 2
    return max(1, int(window / max(per_call, 1e-9)))


def timed(fn, comm, window=None, repeats=None) -> float:
    """Seconds per call of `fn`, every rank of `comm` calling it at once (module docstring).
    Defaults: the module's WINDOW and REPEATS (read at the call: tests shorten them)."""
    return timed_interleaved({0: fn}, comm, window, repeats)[0]


def timed_interleaved(fns: dict, comm, window=None, repeats=None) -> dict:
    """{key: seconds per call} of each of `fns`, the repeats taken in passes over all of them
    (a burst of the machine's load lands on one pass of every key, not on every repeat of
    one): the median of `repeats` windows each."""
    window = WINDOW if window is None else window
    repeats = REPEATS if repeats is None else repeats
    inner = {key: _calls_per_window(fn, comm, window) for key, fn in fns.items()}
    times: dict = {key: [] for key in fns}
    for _ in range(repeats):
        for key, fn in fns.items():
            times[key].append(_window(fn, inner[key], comm))
    return {key: float(np.median(t)) for key, t in times.items()}


def fit_alpha_beta(points) -> list:
    """[alpha s, beta bytes/s] of t = alpha + bytes / beta through [[bytes, t], ...], least
    squares in relative error (each point's residual over its t), alpha >= 0, beta > 0."""
    w = [1.0 / t ** 2 for _, t in points]
    s, sx, st = sum(w), sum(wi * x for wi, (x, _) in zip(w, points)), \
        sum(wi * t for wi, (_, t) in zip(w, points))
    sxx = sum(wi * x * x for wi, (x, _) in zip(w, points))
    sxt = sum(wi * x * t for wi, (x, t) in zip(w, points))
    det = s * sxx - sx * sx
    b = (s * sxt - sx * st) / det if det > 0 else 0.0
    a = (st - b * sx) / s
    if b <= 0:
        return [st / s, 1e15]                      # no measurable bandwidth term
    if a < 0:
        a, b = 0.0, sxt / sxx
    return [a, 1.0 / b]


def _layer_gemms(n: int, comm, dtype):
    """A call of a layer's forward, dW and dx GEMMs: x (n, n), W (n, 2n); 12 n^3 FLOPs."""
    rng = np.random.default_rng(comm.Get_rank())
    x, w, dy = (rng.standard_normal(s).astype(dtype) for s in ((n, n), (n, 2 * n), (n, 2 * n)))

    def layer():
        nn.einsum("bd,df->bf", x, w)
        nn.einsum("bd,bf->df", x, dy)
        nn.einsum("bf,df->bd", dy, w)
    return layer


def layer_gflops(n: int, comm, dtype, window=None, repeats=None) -> float:
    """GFLOP/s of _layer_gemms(n), every rank at once: the `gemm` curve's point at n, and
    validation's reference for how fast the machine is at that moment."""
    return 12 * n ** 3 / timed(_layer_gemms(n, comm, dtype), comm, window, repeats) / 1e9


def measure_gemms(comm, dtype, alone) -> dict:
    """{'gemm', 'bgemm': [[flops per call, GFLOP/s], ...], 'concurrency'} (module docstring);
    alone(fn, comm): seconds per call of `fn` on rank 0 while the others wait."""
    rng = np.random.default_rng(comm.Get_rank())

    def rand(*shape):
        return rng.standard_normal(shape).astype(dtype)
    fns, flops = {}, {}
    for n in GEMM_SIDES:
        fns["gemm", n], flops["gemm", n] = _layer_gemms(n, comm, dtype), 12.0 * n ** 3
    for t in BATCHED_T:
        q, k = rand(1, HEADS, t, HEAD_DIM), rand(1, HEADS, t, HEAD_DIM)
        fns["bgemm", t] = lambda q=q, k=k: nn.einsum("bhtd,bhsd->bhts", q, k)
        flops["bgemm", t] = 2.0 * HEADS * t * t * HEAD_DIM
    seconds = timed_interleaved(fns, comm)
    curves = {"gemm": [], "bgemm": []}
    for (curve, size), t in seconds.items():       # a layer's GFLOP/s at one GEMM's FLOPs
        per_call = flops[curve, size] / (3 if curve == "gemm" else 1)
        curves[curve].append([per_call, flops[curve, size] / t / 1e9])
    a, w = rand(256, 256), rand(256, 256)
    by_itself = alone(lambda: nn.einsum("bd,df->bf", a, w), comm)
    shared = timed(lambda: nn.einsum("bd,df->bf", a, w), comm)
    return dict(curves, concurrency=max(1.0, shared / by_itself))


def _op_benchmarks(n: int, dtype, rng, adamw) -> dict:
    """name -> a call doing that element-wise work on about `n` elements (`adamw`: an AdamW
    whose update is timed)."""
    z, dy = rng.standard_normal(n).astype(dtype), rng.standard_normal(n).astype(dtype)
    rows = n // 128
    x2, scale, shift = (rng.standard_normal((rows, 128)).astype(dtype),
                        np.ones(128, dtype), np.zeros(128, dtype))
    logits = rng.standard_normal((n // 256, 256)).astype(dtype)
    labels = rng.integers(0, 256, n // 256)
    table, ids = rng.standard_normal((256, 128)).astype(dtype), rng.integers(0, 256, rows)
    p, g = z.copy(), dy.copy()

    def activation(name):
        return lambda: nn.activation_backward(name, dy, nn.activation_forward(name, z)[1])

    def layernorm():
        y, saved = nn.layernorm_forward(x2, scale, shift)
        nn.layernorm_backward(y, saved, scale)

    def embedding():
        nn.embedding_backward(nn.embedding_forward(table, ids), ids, 256)
    ops = {"pass": lambda: np.add(z, dy), "layernorm": layernorm,
           "xent": lambda: CrossEntropy()(logits, labels), "embedding": embedding,
           "adamw": lambda: adamw.update(f"p{id(p)}", p, g)}
    ops.update({name: activation(name) for name in ACTIVATIONS})
    return ops


def _attention_calls(t: int, dtype, rng) -> tuple:
    """(forward + backward of causal attention on (1, HEADS, t, HEAD_DIM), one batched GEMM
    of that shape): two calls to time."""
    q, k, v, dout = (rng.standard_normal((1, HEADS, t, HEAD_DIM)).astype(dtype)
                     for _ in range(4))

    def both():
        out, lse = attention.causal_attention_forward(q, k, v)
        attention.causal_attention_backward(dout, q, k, v, out, lse)
    return both, lambda: nn.einsum("bhtd,bhsd->bhts", q, k)


def _cold(calls: list):
    """One call of the next of `calls` (copies of one benchmark on different arrays) in turn,
    so its operands come from memory, as a step's do, not from the cache of the last call."""
    turn = [0]

    def call():
        calls[turn[0] % len(calls)]()
        turn[0] += 1
    return call


def measure_ops(comm, dtype, adamw) -> dict:
    """{op: [[elements, seconds per element], ...]} (module docstring): each size rotates
    over copies of its arrays, COLD_BYTES in all, measured interleaved; `adamw`: an AdamW
    (of a rank-local engine) whose update is timed."""
    rng = np.random.default_rng(comm.Get_rank())
    fns = {}
    for n in OP_SIZES:
        copies = [_op_benchmarks(n, dtype, rng, adamw)
                  for _ in range(max(1, min(16, COLD_BYTES // (8 * n * 4))))]
        fns.update({(name, n): _cold([c[name] for c in copies]) for name in copies[0]})
    for t in BATCHED_T:
        fns["attention", t], fns["attention_gemm", t] = _attention_calls(t, dtype, rng)
    seconds = timed_interleaved(fns, comm)
    out: dict = {}
    for (name, n), t in seconds.items():
        if name in ("attention", "attention_gemm"):
            continue
        out.setdefault(name, []).append([float(n), t / n])
    out["softmax"] = [[float(HEADS * t * t), max(seconds["attention", t] - 7 * seconds[
        "attention_gemm", t], 0.0) / (HEADS * t * t)] for t in BATCHED_T]
    return out


def rank_count_note(calibration: dict, world_size: int):
    """None when `calibration` was measured at `world_size` ranks (or says nothing of it), else
    one line on what that means for its predictions (costs/step_time.py)."""
    ranks = calibration.get("ranks")
    if ranks is None or ranks == world_size:
        return None
    return (f"the calibration was measured at {ranks} ranks, these layouts have {world_size}: "
            f"its collectives of the nearest measured group sizes stand in and its mesh_factor "
            f"is not applied; calibrate at {world_size} ranks for their times")


def load_calibration(path) -> dict:
    """The calibration in `path` (cli/calibrate.py writes it); ValueError for one of an older
    format."""
    with open(os.path.expanduser(path)) as f:
        cal = json.load(f)
    if cal.get("version") != VERSION:
        raise ValueError(f"calibration {path}: format version {cal.get('version', 1)}, this "
                         f"mpishard reads {VERSION}; measure again with plan --calibrate")
    return cal
