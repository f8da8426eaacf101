"""The array module an array belongs to: numpy, cupy, or another device module."""
from __future__ import annotations

import numpy as np


def array_module(a):
    """numpy or cupy, whichever owns `a` (another device array: its `__array_namespace__`)."""
    mod = type(a).__module__.split(".")[0]
    if mod == "cupy":
        import cupy

        return cupy
    namespace = getattr(a, "__array_namespace__", None)
    return np if namespace is None or isinstance(a, np.ndarray) else namespace()
