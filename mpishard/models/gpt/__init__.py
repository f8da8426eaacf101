"""GPT-2: pre-LayerNorm decoder, learned positions, tanh GELU (spec.py)."""
