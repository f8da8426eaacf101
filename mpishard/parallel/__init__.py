"""Strategy pieces (one file each) and their composition over a device mesh."""
from .compose import MeshEngine, make_engine, plan_params
from .single import SingleDevice

__all__ = ["MeshEngine", "SingleDevice", "make_engine", "plan_params"]
