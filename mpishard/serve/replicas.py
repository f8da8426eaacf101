"""dp as replicas: a serving layout's dp axis is that many independent copies of the model.

    replicas, inner = split_replicas("dp=2,tp=2", world.Get_size())   # (2, "tp=2")
    comm, index = replica_comm(world, replicas)                       # my replica's ranks
    engine = make_engine(model, inner, comm=comm)

Each replica runs its own batch on its own ranks (rank 0 of the world dispatches requests to
them), so no step waits for another replica's rows. The replicas are contiguous blocks of
world ranks, as dp is the outermost axis of a layout (comm/mesh.AXES): rank 0 of the world is
rank 0 of replica 0. Axes that split one replica's batch or sequence (fsdp, ep, cp) and
sequence_parallel are refused: serve decodes with a KV cache on tp and pp only.
"""
from __future__ import annotations

from ..comm.mesh import DATA_AXES, OPTIONS, parse_layout

REFUSED = ("fsdp", "ep", "cp")


def split_replicas(layout_text: str, world_size: int) -> tuple:
    """(replicas, the layout of one replica as text): dp=R becomes R replicas of the rest
    ("single" when nothing is left); options of the data axes (bucket_mb, overlap: gradient
    sync) are dropped. ValueError, the same on every rank, for an axis serve cannot run or a
    layout whose size is not world_size."""
    layout = parse_layout(layout_text)
    refused = [f"{a}={layout.size(a)}" for a in REFUSED if layout.size(a) > 1]
    if layout.option("sequence_parallel", 0):
        refused.append("sequence_parallel=1")
    if refused:
        raise ValueError(f"layout {layout.text!r}: serve cannot run {', '.join(refused)} (it "
                         f"decodes with a KV cache on tp and pp, and runs dp as replicas)")
    if layout.world_size != world_size:
        raise ValueError(f"layout {layout.text!r} needs {layout.world_size} ranks, the job "
                         f"has {world_size}")
    data_only = {k for k, (_, _, axes) in OPTIONS.items() if axes and set(axes) <= set(DATA_AXES)}
    parts = [p.strip() for p in layout.text.split(",")]
    inner = [p for p in parts if p and p != "single" and p.split("=")[0].strip() != "dp"
             and p.split("=")[0].strip() not in data_only]
    inner_text = ",".join(inner) or "single"
    parse_layout(inner_text)                     # still a layout (ValueError otherwise)
    return layout.size("dp"), inner_text


def replica_comm(world, replicas: int) -> tuple:
    """Collective on `world` (an mpi4py communicator): (the communicator of my replica, my
    replica's index); replica r holds world ranks r * size/replicas .. (r+1) * size/replicas - 1."""
    size, rank = world.Get_size(), world.Get_rank()
    if replicas < 1 or size % replicas:
        raise ValueError(f"{replicas} replicas do not divide the job's {size} ranks")
    index = rank // (size // replicas)
    return world.Split(index, rank), index


__all__ = ["split_replicas", "replica_comm"]
