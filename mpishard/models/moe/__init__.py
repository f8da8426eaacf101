"""A mixture-of-experts layer (ms.MoE): router and expert MLPs (spec.py)."""
