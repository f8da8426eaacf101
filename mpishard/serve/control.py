"""The server's control plane: a Comm over every rank of the job, for the loop's plan and tokens.

With one replica the engine's own Comm is the world, and the loop uses it. With R replicas
(serve/replicas.py) each engine's Comm is one replica's ranks, so the plan rank 0 broadcasts
to all of them, and the tokens it gathers back, travel on this Comm instead: a mesh over the
world whose layout is dp=R (times the replica's size on a second axis, so the sizes multiply
to the world's), with its own watchdog. Its waits are bounded like an engine's: a rank that
stalls between steps ends the job with the watchdog's named-rank error. Only control data
(JSON, comm/objects.py) travels on it, on the host.
"""
from __future__ import annotations

from ..comm.backend import Backend
from ..comm.collectives import Comm
from ..comm.mesh import DeviceMesh, parse_layout
from ..health import flight
from ..health.debug import signature_check
from ..health.watchdog import Watchdog


def control_comm(world, replicas: int, timeout: float) -> Comm:
    """Collective on `world` (an mpi4py communicator): a host Comm over all of its ranks,
    waited at most `timeout` seconds (0: unbounded)."""
    size = world.Get_size()
    inner = size // replicas
    layout = parse_layout(f"dp={replicas}" + (f",tp={inner}" if inner > 1 else ""))
    mesh = DeviceMesh(world, layout)
    return Comm(mesh, Backend("cpu", world, None), watchdog=Watchdog(mesh, timeout),
                flight=flight.FlightRecorder.shared(), check=signature_check(False))


__all__ = ["control_comm"]
