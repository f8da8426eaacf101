"""Neural-network pieces with no communication: forward/backward pairs, layers, losses, specs."""
from .functional import (ACTIVATIONS, activation_backward, activation_forward, array_module,
                         check_activation, einsum, linear_backward, linear_forward)
from .models import GPT, MLP, MoE

__all__ = ["ACTIVATIONS", "activation_backward", "activation_forward", "array_module",
           "check_activation", "einsum", "linear_backward", "linear_forward", "GPT", "MLP", "MoE"]
