"""Neural-network pieces with no communication: forward/backward pairs, layers, losses."""
from .functional import (ACTIVATIONS, activation_backward, activation_forward, array_module,
                         check_activation, einsum, linear_backward, linear_forward)

__all__ = ["ACTIVATIONS", "activation_backward", "activation_forward", "array_module",
           "check_activation", "einsum", "linear_backward", "linear_forward"]
