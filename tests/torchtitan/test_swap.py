"""A whole torchtitan model swapped: torchtitan's DeepSeek-V3 debug model (shrunk, conftest) trains
as with torchtitan's own MoE; its checkpoints (DCP, model and optimizer) and its HF state-dict
adapter go both ways; one setting of the config (the override) builds the swapped model, initialised
on the meta device as torchtitan does; what cannot be swapped is refused before anything changes."""
import copy
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torchtitan.components.checkpointer.base import ModelWrapper
from torchtitan.components.optimizer import register_moe_load_balancing_hook
from torchtitan.config import OverrideConfig, apply_overrides
from torchtitan.models.common import moe as titan_moe
from torchtitan.models.deepseek_v3.state_dict_adapter import DeepSeekV3StateDictAdapter

import shardmoe.torchtitan

from .conftest import VOCAB, deepseek_v3_config, randomize

ONE_PROCESS = SimpleNamespace(get_optional_mesh=lambda name: None, ep_enabled=False, tp=1)  # its loss mesh: none
STEPS = 5


def built(config, dtype=torch.float64, seed: int = 0):
    model = config.build()
    randomize(model, seed)
    for param in model.parameters():
        param.data = param.data.to(dtype)
    return model


def batches(count: int, seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (2, 16), generator=gen) for _ in range(count)]


def trainer(model):
    """AdamW with torchtitan's load-balancing hook registered, as its trainer registers it."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    register_moe_load_balancing_hook(optimizer, [model], ONE_PROCESS)
    return optimizer


def train(model, optimizer, data) -> list[float]:
    losses = []
    for tokens in data:
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-13), (torch.float32, 1e-5)])
def test_the_three_line_swap_trains_deepseek_v3_as_torchtitans_own_moe(dtype, tol, exact_torchtitan):
    """Five AdamW steps with the bias hook: every loss of the swapped model equals the torchtitan
    model's (its bf16 casts taken out) to `tol` relative, and so do the expert biases after them."""
    model = built(deepseek_v3_config(score_func="sigmoid", route_norm=True, route_scale=2.0), dtype)
    titan = copy.deepcopy(model)

    import shardmoe.torchtitan                 # the swap: these three lines
    shardmoe.torchtitan.swap_moe(model)        # (the model is built above)

    assert [type(block.moe) for block in list(model.layers.values())[1:]] == [shardmoe.torchtitan.MoE] * 2
    data = batches(STEPS)
    expected, got = train(titan, trainer(titan), data), train(model, trainer(model), data)
    assert all(abs(a - b) <= tol * abs(b) for a, b in zip(got, expected)), (got, expected)
    for i in ("1", "2"):
        assert torch.equal(model.layers[i].moe.expert_bias_E, titan.layers[i].moe.expert_bias_E)
        assert model.layers[i].moe.expert_bias_E.abs().sum() > 0


def test_the_loss_sees_the_moe_layers(exact_torchtitan):
    """The comparison above is not blind: the same model with the gate and up projections of the
    routed experts exchanged (w1 <-> w3) loses differently by far more than its tolerances."""
    model = built(deepseek_v3_config())
    wrong = copy.deepcopy(model)
    with torch.no_grad():
        for block in list(wrong.layers.values())[1:]:
            inner = block.moe.routed_experts.inner_experts
            w1 = inner.w1_EFD.clone()
            inner.w1_EFD.copy_(inner.w3_EFD)
            inner.w3_EFD.copy_(w1)
    tokens = batches(1)[0]
    loss = [F.cross_entropy(m(tokens).flatten(0, 1), tokens.flatten()).item() for m in (model, wrong)]
    assert abs(loss[0] - loss[1]) > 1e-3 * loss[0]


def test_a_torchtitan_checkpoint_resumes_in_the_swapped_model_and_back(tmp_path, exact_torchtitan):
    """DCP, as torchtitan's checkpointer writes it (ModelWrapper's flat state dict, the optimizer's
    by parameter FQN): torchtitan's model trained two steps and saved, loaded into a swapped model
    of other weights and trained three more, loses what torchtitan's own resumed run loses, to
    round-off; the swapped model's checkpoint loads into a torchtitan model, every tensor equal."""
    titan = built(deepseek_v3_config())
    optimizer = trainer(titan)
    data = batches(5)
    train(titan, optimizer, data[:2])
    dcp.save({"model": ModelWrapper(titan).state_dict(),
              "optimizer": get_optimizer_state_dict(titan, optimizer)}, checkpoint_id=tmp_path / "titan")
    resumed = shardmoe.torchtitan.swap_moe(built(deepseek_v3_config(), seed=7))
    resumed_optimizer = trainer(resumed)
    wrapper = ModelWrapper(resumed)
    state = {"model": wrapper.state_dict(), "optimizer": get_optimizer_state_dict(resumed, resumed_optimizer)}
    dcp.load(state, checkpoint_id=tmp_path / "titan")
    wrapper.load_state_dict(state["model"])
    set_optimizer_state_dict(resumed, resumed_optimizer, state["optimizer"])
    expected, got = train(titan, optimizer, data[2:]), train(resumed, resumed_optimizer, data[2:])
    assert all(abs(a - b) <= 1e-13 * abs(b) for a, b in zip(got, expected)), (got, expected)

    dcp.save({"model": ModelWrapper(resumed).state_dict()}, checkpoint_id=tmp_path / "swapped")
    back = built(deepseek_v3_config(), seed=9)
    state = {"model": ModelWrapper(back).state_dict()}
    dcp.load(state, checkpoint_id=tmp_path / "swapped")
    ModelWrapper(back).load_state_dict(state["model"])
    saved = resumed.state_dict()
    assert list(back.state_dict()) == list(saved)
    assert all(torch.equal(v, saved[k]) for k, v in back.state_dict().items())


def test_torchtitans_hf_adapter_maps_the_swapped_model_both_ways():
    """DeepSeekV3StateDictAdapter.to_hf of the swapped model is to_hf of torchtitan's (per-expert
    gate_proj/up_proj/down_proj, mlp.gate.e_score_correction_bias, ...); from_hf of it loads into a
    swapped model of other weights, strictly, every tensor equal."""
    config = deepseek_v3_config()
    titan = built(config)
    model = shardmoe.torchtitan.swap_moe(copy.deepcopy(titan))
    adapter = DeepSeekV3StateDictAdapter(config, None)
    hf, expected = adapter.to_hf(model.state_dict()), adapter.to_hf(titan.state_dict())
    assert list(hf) == list(expected) and all(torch.equal(v, expected[k]) for k, v in hf.items())
    assert "model.layers.1.mlp.experts.7.up_proj.weight" in hf and "model.layers.2.mlp.gate.e_score_correction_bias" in hf
    other = shardmoe.torchtitan.swap_moe(built(config, seed=3))
    other.load_state_dict(adapter.from_hf(hf), strict=True)
    assert all(torch.equal(v, titan.state_dict()[k]) for k, v in other.state_dict().items())


def test_one_override_setting_builds_the_swapped_model_initialised_on_meta_as_torchtitans():
    """--override.imports shardmoe.torchtitan.fused_moe (apply_overrides, as the trainer calls it):
    every MoE config becomes shardmoe.torchtitan.MoE's; built on meta, materialised with to_empty and
    initialised by init_weights under a seed (torchtitan's trainer's path), the model holds torchtitan's
    own model's values, parameters and buffers (expert_bias_E, tokens_per_expert_E, RoPE caches)."""
    config = deepseek_v3_config()
    swapped_config = copy.deepcopy(config)
    lines = apply_overrides(OverrideConfig(imports=["shardmoe.torchtitan.fused_moe"]), swapped_config)
    assert len(lines) == 2 and all("MoE.Config -> MoE.Config" in line for line in lines)
    models = []
    for c in (config, swapped_config):
        with torch.device("meta"):
            model = c.build()
        model.to_empty(device="cpu")
        with torch.no_grad():
            for t in [*model.parameters(), *model.buffers()]:
                t.fill_(float("nan"))
            torch.manual_seed(5)
            model.init_weights(buffer_device=None)
        models.append(model)
    titan, model = models
    assert [type(b.moe) for b in list(model.layers.values())[1:]] == [shardmoe.torchtitan.MoE] * 2
    model.verify_module_protocol()  # every submodule a torchtitan Module, as torchtitan checks
    expected = dict([*titan.named_parameters(), *titan.named_buffers()])
    got = dict([*model.named_parameters(), *model.named_buffers()])
    assert list(got) == list(expected) and any(n.endswith("tokens_per_expert_E") for n in got)
    for name, value in expected.items():
        assert torch.equal(got[name], value), name


def test_what_cannot_be_swapped_is_refused_before_anything_changes():
    with pytest.raises(ValueError, match="model: expected a torchtitan model holding torchtitan MoE modules, "
                                         "got Linear with none"):
        shardmoe.torchtitan.swap_moe(torch.nn.Linear(2, 2))
    config = deepseek_v3_config()
    config.layers[2].moe.router._debug_force_load_balance = True
    with torch.device("meta"):
        model = config.build()
    with pytest.raises(ValueError, match=r"^layers\.2\.moe\.router\._debug_force_load_balance: "):
        shardmoe.torchtitan.swap_moe(model)
    assert all(type(b.moe) is titan_moe.MoE for b in list(model.layers.values())[1:])  # layer 1 not swapped either
    model.layers["1"].moe._parallelized = True  # what torchtitan's Module.parallelize sets
    with pytest.raises(ValueError, match="moe: expected a torchtitan MoE not yet parallelized"):
        shardmoe.torchtitan.from_torchtitan(model.layers["1"].moe)
    with pytest.raises(ValueError, match="moe: expected torchtitan's MoE .* got Linear"):
        shardmoe.torchtitan.from_torchtitan(torch.nn.Linear(2, 2))
