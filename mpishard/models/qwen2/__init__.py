"""Qwen2: a Llama with biases on the q, k and v projections (spec.py), its units, parallel
plan, cost terms and Hugging Face name map built on the Llama folder's."""
