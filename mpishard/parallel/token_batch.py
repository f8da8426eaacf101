"""What a step's batch brings besides x and t: a global target count and packed documents.

The global-token mean. A fine-tune's targets are masked (ignore_index, -100): the prompt,
the padding, a document's last token. Ranks then count different numbers of targets, and the
mean of per-rank means (what averaging gradients over the data axes gives) weighs a rank's
few targets as much as another's many. With `count` = the counted targets of the whole global
batch (every data-parallel and cp rank's, every accumulation micro-step's), each rank divides
its summed token losses by

    n = count / (R * m)        R: ranks averaged over (comm.mesh.AVERAGE_AXES),
                               m: the pipeline's microbatches (averaged over by the runner)

so that the engine's averages over ranks and microbatches give sum(token losses) / count
exactly: the single-device loss and gradient of the global batch (nn.losses, `over`).
`count_targets` is the collective that counts: an all_reduce(sum) of this rank's count over
the averaging axes (adjoint: none, the count is data).

Packed documents (nn/documents.py): the ids (B_local, T) of the whole sequence, checked on the
host before any communication, moved to the device and split into the runner's microbatches.

And the engine's two other batch helpers: `local_rows` (the rows of a global batch a rank is
fed: its data-parallel block, cut by cp) and `global_mean` (a per-rank scalar averaged over
the ranks that hold different rows, from the last pipeline stage).
"""
from __future__ import annotations

import numpy as np

from ..comm.mesh import AVERAGE_AXES, DATA_AXES
from ..nn.documents import check_documents
from .context_parallel import shard_sequence


def step_loss(loss, count, ranks: int, microbatches: int):
    """`loss` divided by count / (ranks * microbatches) instead of its own counted targets
    (module docstring); `loss` itself when count is None."""
    if count is None:
        return loss
    if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < 0:
        raise ValueError(f"count must be the number of counted targets of the global batch "
                         f"(an int >= 0), got {count!r}")
    return loss.over(int(count) / (ranks * microbatches))


def check_targets(loss, t, model, xp, dtype):
    """t, after `loss` checked it against the model's output shape on every rank before any
    communication (under pp the loss itself runs on the last stage only): a shape-only
    stand-in for the output."""
    stand_in = xp.broadcast_to(xp.zeros((), dtype), model.output_shape(t.shape))
    loss.check(stand_in, t)
    return t


def local_rows(arr, mesh):
    """The rows of a global batch (host array) this rank is fed: block dp_rank of the data
    axes' ranks along axis 0 (tp, pp peers: the same rows), then its cp chunks
    (context_parallel.shard_sequence); ValueError when the rows do not divide."""
    n, i = mesh.size(DATA_AXES), mesh.coord(DATA_AXES)
    rows = np.shape(arr)[0]
    if rows % n:
        raise ValueError(f"batch of {rows} rows does not divide by the {n} data-parallel "
                         f"ranks of layout {mesh.layout.text!r}")
    return shard_sequence(arr[rows // n * i:rows // n * (i + 1)], mesh)


def global_mean(comm, mesh, value: float) -> float:
    """Collective: the mean of a per-rank scalar over the data axes and cp, taken from the
    last pp stage (broadcast over pp first); the same float on every rank."""
    v = np.array([value], dtype=np.float64)
    pp = mesh.layout.size("pp")
    if pp > 1:
        v = comm.broadcast(v, root=pp - 1, group="pp")
    if mesh.size(AVERAGE_AXES) > 1:
        v = comm.all_reduce(v, op="avg", group=AVERAGE_AXES)
    return float(comm.backend.to_host(v)[0])


def count_targets(comm, mesh, loss, t) -> int:
    """Collective over the averaging axes: the counted targets (loss.counted) of every rank's
    `t` (this rank's rows, cut by cp); the same int on every rank."""
    n = np.array([loss.counted(t)], dtype=np.int64)
    if mesh.size(AVERAGE_AXES) > 1:
        n = comm.all_reduce(n, op="sum", group=AVERAGE_AXES)
    return int(comm.backend.to_host(n)[0])


def set_documents(documents, ids, x, to_device, microbatches: int = 1, mb: int = 0):
    """Give the rank's units (documents: nn.documents.Documents) the batch's document ids:
    None (not packed), or (B_local, T) ids of the whole sequence for the rows of x (this
    rank's input or None; its T cut by cp or not); ValueError before any communication when
    they do not fit."""
    if ids is None:
        documents.set(None)
        return
    if np.ndim(ids) != 2:
        raise ValueError(f"documents must be (rows, T) ids, got shape {np.shape(ids)}")
    if x is not None and np.shape(ids)[0] != x.shape[0]:
        raise ValueError(f"documents have {np.shape(ids)[0]} rows, the batch has "
                         f"{x.shape[0]}")
    c = documents.sequence_ranks
    if x is not None and x.ndim == 2 and np.shape(ids)[1] != x.shape[1] * c:
        raise ValueError(f"documents cover {np.shape(ids)[1]} tokens of a row, the batch's rows "
                         f"{x.shape[1]}" + (f" x cp={c}: give the whole sequence's ids, not "
                                           f"cut by cp" if c > 1 else ""))
    ids = check_documents(ids)
    documents.set(to_device(ids), microbatches, mb)


__all__ = ["check_targets", "count_targets", "global_mean", "local_rows", "set_documents",
           "step_loss"]
