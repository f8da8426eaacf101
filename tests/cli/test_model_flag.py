"""--model for every architecture of the registry: each implements the interface's data and
command line section, `--model KIND:KEY=VALUE,...` builds every keyed one, and a spec's
flag_args rebuild it (what `train --resume` without --model does)."""
from __future__ import annotations

import pytest

from mpishard.checkpoint.format import model_spec
from mpishard.cli.model_flag import KEYED, model_from_flag, spec_flags
from mpishard.cli.usage import UsageError
from mpishard.models import ARCHITECTURES

SECTION = ("takes_tokens", "generates", "default_loss", "flag_defaults", "flag_types",
           "flag_args", "log_name")
SIZES = "d_model=32,n_heads=4,n_layers=2,seq_len=8"


@pytest.mark.parametrize("kind", sorted(ARCHITECTURES))
def test_every_architecture_answers_the_data_and_command_line_section(kind):
    cls = ARCHITECTURES[kind]
    assert cls.kind == kind
    missing = [name for name in SECTION if not hasattr(cls, name)]
    assert not missing, f"{cls.__name__} lacks {missing}"
    assert (cls.flag_defaults is not None) == hasattr(cls, "from_flag")
    assert set(cls.flag_types) <= set(cls.flag_defaults or {})


@pytest.mark.parametrize("kind", sorted(KEYED))
def test_a_keyed_architecture_rebuilds_from_its_flag_args(kind):
    model = model_from_flag(f"{kind}:{SIZES}")
    assert model.kind == kind and model.d_model == 32 and model.seq_len == 8
    assert model_from_flag(kind).kind == kind                 # the bare KIND: its defaults
    flags = model.flag_args()
    assert spec_flags(model_spec(model)) == flags
    assert model_spec(model_from_flag(flags["model"])) == model_spec(model)


def test_an_mlp_rebuilds_from_its_dims_and_activation():
    model = model_from_flag("8,16,4", activation="tanh")
    assert model.flag_args() == {"model": "8,16,4", "activation": "tanh"}
    assert spec_flags(model_spec(model)) == model.flag_args()
    assert model.log_name() == "8->16->4"
    assert model_from_flag("8,16,4", bias=False).flag_args() is None


@pytest.mark.parametrize("text, message", [
    ("gpt:d_model", "expected KEY=VALUE pairs"),
    ("gpt:width=3", "unknown key 'width'"),
    ("gpt:tied=2", "tied must be 0 or 1"),
    ("llama:rope_theta=-1", "rope_theta must be a positive number"),
    ("llama:router_aux_loss_coef=-0.1", "router_aux_loss_coef must be a number >= 0"),
    ("gpt:n_layers=1.5", "n_layers='1.5' is not an integer"),
])
def test_the_parser_reads_each_key_by_the_spec_types(text, message):
    with pytest.raises(UsageError, match=message):
        model_from_flag(text)


def test_gpt_keys_joined_from_model_and_gpt_and_refused_for_an_mlp():
    assert model_from_flag("gpt:d_model=32", gpt="n_heads=2").n_heads == 2
    with pytest.raises(UsageError, match="--gpt applies to --model gpt, not --model 8,4"):
        model_from_flag("8,4", gpt="d_model=32")
