"""shardmoe.hf.from_block on the sparse MoE block of every family in the installed transformers.

Each block is found by reading the modeling sources (a class whose __init__ sets `self.experts` and
a `self.gate` or `self.router`: the sparse blocks, and the Gemma 4 / DiffusionGemma decoder layers
that hold router and experts directly), so a family added to transformers is covered without
editing this file. Each is built tiny from its config class in float64 with random weights, and from_block
must either refuse it with a ValueError naming the family and the feature, or give the block's
own forward output, within the float32 precision of the block's routing softmax.
"""
from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

import pytest
import torch

import transformers


MODELS = Path(transformers.__file__).parent / "models"
_CLASS = re.compile(r"^class (\w+)\([^\n]*\n(.*?)(?=^\S)", re.M | re.S)
_INIT = re.compile(r"def __init__\(.*?(?=\n    def |\Z)", re.S)

# Blocks that, in transformers 5.23, compute softmax(x W^T) -> top-k (-> renormalise) over
# Mixtral-layout experts, and the three families read on their own (DeepSeek-V3, Qwen2-MoE, GPT-OSS:
# shardmoe/hf/block_layer.py): from_block must accept these (with their default config), so the
# check is not refusing everything. Every other discovered block must be refused.
EXPRESSIBLE = {"MixtralSparseMoeBlock", "MiniMaxSparseMoeBlock", "Qwen3VLMoeTextSparseMoeBlock", "GraniteMoeMoE",
               "GraniteMoeSWAMoE", "GraniteMoeHybridMoE", "GraniteMoeSharedMoE", "JambaSparseMoeBlock",
               "Qwen3MoeSparseMoeBlock", "Qwen3OmniMoeThinkerTextSparseMoeBlock", "OlmoeSparseMoeBlock",
               "FlexOlmoSparseMoeBlock", "MellumSparseMoeBlock", "DeepseekV3MoE", "Qwen2MoeSparseMoeBlock",
               "GptOssMLP"}
FEATURES = ("shared experts", "correction bias", "router bias", "scaling factor", "router jitter",
            "expert layout", "router kind", "activation")

TINY = dict(hidden_size=8, d_model=8, intermediate_size=12, moe_intermediate_size=12, expert_intermediate_size=12,
            shared_expert_intermediate_size=12, ffn_hidden_size=12, d_ff=12, num_experts=4, num_local_experts=4,
            n_routed_experts=4, moe_num_experts=4, num_experts_per_tok=2, moe_topk=2, moe_top_k=2, top_k=2,
            n_group=1, topk_group=1, num_shared_experts=1, n_shared_experts=1, expert_capacity=64,
            enable_moe_block=True)  # Gemma 4: its decoder layer holds router and experts only when enabled


def discover() -> list[tuple[str, str]]:
    """(family, block class) for every sparse MoE block in the installed transformers' sources."""
    found = []
    for path in sorted(MODELS.glob("*/modeling_*.py")):
        family = path.parent.name
        if path.name != f"modeling_{family}.py":
            continue
        for name, body in _CLASS.findall(path.read_text()):
            init = _INIT.search(body)
            if init and "self.experts =" in init.group(0) and re.search(r"self\.(gate|router) =", init.group(0)):
                found.append((family, name))
    return found


BLOCKS = discover()


def _shrink(config) -> None:
    for key, value in TINY.items():
        if key in (getattr(config, "per_layer_attributes", None) or ()):
            continue  # Dots3-Note vision: set on each per-layer config instead
        if not isinstance(getattr(config, key, None), (list, dict)):
            setattr(config, key, value)


def _tiny_config(config_class):
    config = config_class()
    _shrink(config)
    # DBRX keeps its MoE sizes in a sub-config, Dots3-Note's vision tower in per-layer configs.
    for sub in [getattr(config, "ffn_config", None), *(getattr(config, "per_layer_config", None) or [])]:
        if sub is not None:
            _shrink(sub)
    config._experts_implementation = "eager"
    return config


def build_block(family: str, block_name: str) -> torch.nn.Module:
    """The block built from its family's config classes (text config first), tiny, float64."""
    block_class = getattr(importlib.import_module(f"transformers.models.{family}.modeling_{family}"), block_name)
    configs = importlib.import_module(f"transformers.models.{family}.configuration_{family}")
    config_classes = sorted((c for n, c in vars(configs).items()
                             if inspect.isclass(c) and n.endswith("Config") and c.__module__ == configs.__name__),
                            key=lambda c: ("Text" not in c.__name__, c.__name__))
    # Arguments after the config: a layer index, or a width (NllbMoe's ffn_dim).
    extra = [0 if "idx" in name else 12 for name, param in list(inspect.signature(block_class).parameters.items())[1:]
             if param.default is param.empty and param.kind is param.POSITIONAL_OR_KEYWORD]
    errors = []
    for config_class in config_classes:
        try:
            block = block_class(_tiny_config(config_class), *extra)
        except Exception as error:  # the next config class may be the one the block takes
            errors.append(f"{config_class.__name__}: {error!r}"[:160])
            continue
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in block.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
        return block.double()
    raise RuntimeError(f"could not build {family}.{block_name}: {errors}")


def from_block(block, **overrides):
    from shardmoe.hf import from_block  # not at collection: see tests/hf/conftest.py

    return from_block(block, **overrides)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _check_against_block(block, layer, H: int) -> None:
    x = torch.randn(1, 7, H, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = block(x.clone())
        expected = expected[0] if isinstance(expected, tuple) else expected
        got = layer(x)
    # The block's softmax runs in float32 (rel. error ~6e-8 in each weight); the rest is float64.
    assert _rel(got, expected) <= 1e-6


def test_discovery_finds_the_families():
    families = {family for family, _ in BLOCKS}
    assert len(BLOCKS) >= 50, BLOCKS
    assert {"mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "dbrx", "switch_transformers"} <= families


@pytest.mark.parametrize("family,block_name", BLOCKS, ids=[name for _, name in BLOCKS])
def test_block_is_reproduced_or_refused(family, block_name):
    block = build_block(family, block_name)
    try:
        layer = from_block(block)
    except ValueError as error:
        message = str(error)
        assert family in message and block_name in message, message
        assert any(feature in message for feature in FEATURES), message
        assert block_name not in EXPRESSIBLE, message
        return
    assert block_name in EXPRESSIBLE, f"{family} ({block_name}) accepted but not known to be expressible"
    assert layer.gate_up_proj.dtype == torch.float64
    _check_against_block(block, layer, layer.config.hidden_size)


@pytest.mark.parametrize("family,block_name", [("qwen3_moe", "Qwen3MoeSparseMoeBlock"),
                                               ("olmoe", "OlmoeSparseMoeBlock")])
def test_norm_topk_prob_maps_to_renormalize(family, block_name):
    block = build_block(family, block_name)
    for flag in (False, True):
        block.gate.norm_topk_prob = flag
        layer = from_block(block)
        assert layer.config.renormalize is flag
        _check_against_block(block, layer, layer.config.hidden_size)


def test_features_are_refused_on_an_accepted_block():
    block = build_block("mixtral", "MixtralSparseMoeBlock")
    block.jitter_noise = 0.1
    with pytest.raises(ValueError, match=r"'mixtral' \(MixtralSparseMoeBlock\): router jitter .*jitter_noise=0.1"):
        from_block(block)
    block.jitter_noise = 0.0
    block.routed_scaling_factor = 2.5
    with pytest.raises(ValueError, match="scaling factor is not supported .routed_scaling_factor=2.5"):
        from_block(block)
    del block.routed_scaling_factor
    block.gate.register_buffer("e_score_correction_bias", torch.zeros(4, dtype=torch.float64))
    with pytest.raises(ValueError, match="correction bias .*gate.e_score_correction_bias"):
        from_block(block)


def test_activation_is_read_from_the_experts():
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    config = MixtralConfig(hidden_size=8, intermediate_size=12, num_local_experts=4, num_experts_per_tok=2,
                           hidden_act="gelu_pytorch_tanh")
    assert from_block(MixtralSparseMoeBlock(config)).config.activation == "gelu_tanh"
    config.hidden_act = "gelu_new"
    with pytest.raises(ValueError, match="activation: expected hidden_act in .*got 'gelu_new'"):
        from_block(MixtralSparseMoeBlock(config))


def test_overrides_may_contradict_the_block():
    """An override is the user's explicit choice: renormalize=False on a renormalising block."""
    block = build_block("mixtral", "MixtralSparseMoeBlock")
    layer = from_block(block, renormalize=False, aux_loss_coef=0.01)
    assert layer.config.renormalize is False and layer.config.aux_loss_coef == 0.01
    with pytest.raises(AssertionError):  # the layer now computes what was asked, not the block
        _check_against_block(block, layer, layer.config.hidden_size)
