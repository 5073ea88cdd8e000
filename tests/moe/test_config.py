"""MoEConfig: every switch of the layer is a bool; a string such as "no" or "false" (truthy) and
the ints 0 and 1 are refused by name instead of switching the option on."""
import dataclasses

import pytest

import shardmoe
from shardmoe.moe.config import MoEConfig

SWITCHES = [f.name for f in dataclasses.fields(MoEConfig) if f.type == "bool"]
NOT_BOOLS = ["no", "False", "false", 0, 1, None]


def test_the_switches_are_the_bool_options():
    assert sorted(SWITCHES) == ["bias", "correction_bias", "renormalize", "router_bias", "shared_gate"]


@pytest.mark.parametrize("value", NOT_BOOLS, ids=repr)
@pytest.mark.parametrize("name", SWITCHES)
def test_a_switch_refuses_anything_but_a_bool(name, value):
    options = dict(score_func="sigmoid") if name == "correction_bias" else {}
    if name == "shared_gate":
        options["shared_ffn_size"] = 4
    with pytest.raises(ValueError, match=rf"^{name}: expected a bool, got {value!r}$"):
        shardmoe.MoE(8, 6, 4, 2, **options, **{name: value})


def test_bias_no_creates_no_expert_biases_silently():
    """MoE(..., bias="no") built and trained expert biases: "no" is truthy."""
    with pytest.raises(ValueError, match="bias: expected a bool, got 'no'"):
        shardmoe.MoE(8, 6, 4, 2, bias="no")
    layer = shardmoe.MoE(8, 6, 4, 2, bias=False)
    assert layer.gate_up_proj_bias is None and layer.down_proj_bias is None
