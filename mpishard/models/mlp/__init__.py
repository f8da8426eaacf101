"""The MLP: a stack of linear layers with activations (spec.py)."""
