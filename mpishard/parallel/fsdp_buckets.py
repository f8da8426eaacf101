"""FSDP gradient buckets: one reduce-scatter over fsdp for several gradients.

ZeRO-2/3 average each gradient over fsdp and keep only the owned slice (fsdp.py). Without
buckets (layout option bucket_mb=0) every gradient a layer's backward adds is reduce-scattered
at once: one call per tensor and microbatch. With them (bucket_mb, default 25 MiB like dp's),
`add` queues the gradient, and one reduce_scatter(avg) serves the whole queue when

- the next gradient would not fit: the queue goes first, the gradient opens the next bucket
  (one larger than bucket_mb is a bucket of its own);
- the queue holds bucket_mb;
- the backward ends (`flush`: the engine's end_backward after every backward, sync or not,
  and finish_grads).

A bucket's send buffer is N rank-chunks; chunk r is every queued tensor's slice r, flattened,
one after the other, so the reduce-scatter hands rank r exactly its slices:

    g_i padded to N s_i rows, viewed (N, k_i)         row r = rows r s_i:(r+1) s_i of g_i
    send = concatenate([g_0, g_1, ...], axis=1)       (N, K), K = sum_i k_i     (pack)
    mine = reduce_scatter(send, 'avg', axis 0)        (1, K): row r of the sum / N
    dW_i,r += mine[0, K_i:K_i + k_i] as (s_i, ...)     K_i = k_0 + ... + k_i-1  (unpack)

    adjoint: the all_gather of the same bucket (every rank's slices back into N rank-chunks);
    the per-tensor adjoint pairs (all_gather of W_i / reduce_scatter of dW_i) side by side.

The reduction is element by element, so a bucket gives every rank the slices the per-tensor
calls gave: the same bytes ((N-1)/N of the padded gradients), fewer calls. Under the
low-precision Comm (precision.py) the bucket travels as its all_to_all in comm_dtype with the
fp32 sum, likewise element by element.

ZeRO-2's promise: the full gradients a rank holds are the queue, at most one bucket
(bucket_mb, or one larger tensor), plus its packed copy during the call; `peak_bytes` records
the most queued. A pipeline's microbatches share the queue within a step (a bucket may hold
one gradient several times, one entry per microbatch; each entry adds its slice).

Order: the flush points depend only on the gradients' names and shapes, which the fsdp peers
share (same stage, same schedule), so they issue the same calls in the same order.
`bucket_calls` counts the calls for the cost model (no MPI).
"""
from __future__ import annotations

from .data_parallel import DEFAULT_BUCKET_MB


def bucket_limit(layout) -> int:
    """Bytes per bucket from the layout option bucket_mb (0: 1 byte, a call per tensor)."""
    mb = layout.option("bucket_mb", DEFAULT_BUCKET_MB)
    if mb < 0:
        raise ValueError(f"layout {layout.text!r}: bucket_mb must be >= 0 (0: one call per "
                         f"tensor), got {mb}")
    return max(1, int(mb * 2 ** 20))


def pad_rows(xp, a, n: int):
    """`a` with zero rows appended along dim 0 up to a multiple of n (no copy if it divides)."""
    extra = -a.shape[0] % n
    if not extra:
        return a
    out = xp.zeros((a.shape[0] + extra,) + tuple(a.shape[1:]), dtype=a.dtype)
    out[:a.shape[0]] = a
    return out


def reduce_scatter_chunks(comm, chunks: list) -> list:
    """chunks: (N, k_i) arrays, row r = tensor i's slice r. One reduce_scatter(avg) of them
    packed side by side; returns this rank's (k_i,) averaged slices, in order (views)."""
    xp = comm.xp
    send = chunks[0] if len(chunks) == 1 else xp.concatenate(chunks, axis=1)   # pack (N, K)
    mine = comm.reduce_scatter(send, op="avg", axis=0)[0]          # (K,); adjoint: all_gather
    out, offset = [], 0
    for c in chunks:                                                            # unpack
        out.append(mine[offset:offset + c.shape[1]])
        offset += c.shape[1]
    return out


def bucket_calls(sizes, limit: int) -> int:
    """Reduce-scatter calls for gradients of `sizes` bytes (padded, in the order they are
    added) under GradBuckets' rule with `limit` bytes per bucket."""
    calls = queued = 0
    for nbytes in sizes:
        if queued and queued + nbytes > limit:
            calls, queued = calls + 1, 0                  # the queue goes first
        queued += nbytes
        if queued >= limit:
            calls, queued = calls + 1, 0                  # full
    return calls + (1 if queued else 0)                   # the end of the backward


class GradBuckets:
    """The queue of ZeRO-2/3 gradients waiting for their bucket's reduce-scatter.

    comm: the fsdp group's Comm (n ranks); limit: bytes per bucket (bucket_limit);
    deliver(name, shard): receives each owned (s, ...) averaged slice (fsdp adds it to the
    store's gradient and reports it ready).
    """

    def __init__(self, comm, n: int, limit: int, deliver):
        self.comm, self.n, self.limit, self.deliver = comm, n, limit, deliver
        self.queue: list = []      # (name, shape of the padded gradient, (N, k) view of it)
        self.bytes = 0             # queued
        self.peak_bytes = 0        # the most queued at once (ZeRO-2's promise)

    def add(self, name, g) -> None:
        """Queue dL/d(block) g, shaped (L, ...); reduce-scatter when a bucket is full."""
        padded = pad_rows(self.comm.xp, g, self.n)                 # (N s, ...)
        chunks = padded.reshape(self.n, -1)
        if self.queue and (self.bytes + chunks.nbytes > self.limit
                           or chunks.dtype != self.queue[0][2].dtype):
            self.flush()
        self.queue.append((name, padded.shape, chunks))
        self.bytes += chunks.nbytes
        self.peak_bytes = max(self.peak_bytes, self.bytes)
        if self.bytes >= self.limit:
            self.flush()

    def flush(self) -> None:
        """Reduce-scatter(avg) the queue in one call and deliver each owned slice."""
        if not self.queue:
            return
        queue, self.queue, self.bytes = self.queue, [], 0
        slices = reduce_scatter_chunks(self.comm, [c for _, _, c in queue])
        for (name, shape, _), mine in zip(queue, slices):
            self.deliver(name, mine.reshape((shape[0] // self.n,) + tuple(shape[1:])))

    def drop(self) -> None:
        """Forget the queue (a backward that raised; a new checkpoint)."""
        self.queue, self.bytes = [], 0
