"""Strategy pieces (one file each) and `compose`, which stacks them for a layout."""
from .compose import EngineParts, compose, plan_params

__all__ = ["EngineParts", "compose", "plan_params"]
