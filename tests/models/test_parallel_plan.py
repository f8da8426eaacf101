"""Every registered architecture answers models/interface.py's parallel-plan section: its plan
on `single` holds every parameter whole on stage 0 (the same through compose.plan_params), a
layout it cannot run is a ValueError, and the other questions get answers of the right kind.
A new architecture is checked by registering it (a keyed one builds from its flag defaults)."""
import pytest

import mpishard as ms
from mpishard.models import ARCHITECTURES
from mpishard.parallel.compose import plan_params

PLAN_METHODS = ("plan_params", "build", "grads_overlap", "supports_recompute")
UNKEYED = {"mlp": lambda: ms.MLP([4, 8, 3]), "moe": lambda: ms.MoE(4, 8, n_experts=4)}


def example(kind):
    """A spec of the registered architecture `kind`, no weights."""
    cls = ARCHITECTURES[kind]
    if cls.flag_defaults is None:
        return UNKEYED[kind]()
    return cls.from_flag(dict(cls.flag_defaults))


@pytest.mark.parametrize("kind", sorted(ARCHITECTURES))
def test_every_architecture_plans_single_whole_on_stage_0(kind):
    model = example(kind)
    for method in PLAN_METHODS:
        assert callable(getattr(model, method, None)), f"{kind} has no {method}"
    layout = ms.parse_layout("single")
    plan = model.plan_params(layout)
    assert list(plan) == list(model.param_shapes())
    for name, info in plan.items():
        assert info.full_shape == tuple(model.param_shapes()[name])
        assert info.placement.shards == () and info.placement.stage == 0, (name, info)
    assert plan_params(model, layout) == plan
    assert isinstance(model.grads_overlap(layout), bool)
    assert isinstance(model.supports_recompute(), bool)


@pytest.mark.parametrize("kind", sorted(ARCHITECTURES))
def test_every_architecture_refuses_a_layout_it_cannot_run(kind):
    """ep=3 divides no example's experts (and the dense ones have none)."""
    with pytest.raises(ValueError, match="ep"):
        example(kind).plan_params(ms.parse_layout("ep=3"))


def test_a_spec_no_pipeline_can_cut_says_so():
    """ms.MoE is one layer (plan_params refuses pp): its boundary_width is a ValueError."""
    with pytest.raises(ValueError, match="pipeline cannot cut"):
        ms.MoE(4, 8, n_experts=4).boundary_width(ms.parse_layout("single"), None)
