"""The cost models: what a layout costs each rank, with no MPI (memory and bytes: rank_costs,
calls: call_counts, step time: step_time). Generic: a model's own terms come from its spec
(models/interface.py, section "cost model"; models/<name>/costs.py)."""
