"""Llama and its mixture-of-experts variant Mixtral: RMSNorm, rotary positions, SwiGLU,
grouped-query attention (spec.py)."""
