"""shardmoe.hf.from_block / block_state_dict and shardmoe.hf.convert against the families themselves.

A converted model routes in float64 where the families' routers cast logits to float32, so it
equals the family's own model to that precision (~1e-7 relative); against shardmoe's float64
autograd reference (moe/reference.py) swapped into the same converted model it is exact (1e-10).
The model's loss keeps the family's router aux loss with its own coefficient.
shardmoe.hf is imported by the tests, not at collection: it imports transformers.integrations,
which imports triton before tests/kernels/conftest.py can choose the interpreter.
"""
from __future__ import annotations

import copy

import pytest
import torch

from shardmoe import MoE
from shardmoe.moe.reference import reference_moe


def from_block(block, **overrides):
    from shardmoe.hf import from_block  # not at collection: see tests/hf/conftest.py

    return from_block(block, **overrides)


def block_state_dict(layer):
    from shardmoe.hf import block_state_dict

    return block_state_dict(layer)

# case -> (family, config sizes): DeepSeek-V3 with its shared experts, and with none
CONVERTIBLE = {"mixtral": ("mixtral", {}), "qwen2_moe": ("qwen2_moe", {}), "qwen3_moe": ("qwen3_moe", {}),
               "olmoe": ("olmoe", {}),
               "deepseek_v3": ("deepseek_v3", {}), "deepseek_v3_no_shared": ("deepseek_v3", {"n_shared_experts": 0}),
               "gpt_oss": ("gpt_oss", {}), "gpt_oss_clamping": ("gpt_oss", {"swiglu_limit": 0.05})}
IDS = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(3))


def hf_name(name: str) -> str:
    """The family's name of a converted parameter (the gate weight is transposed)."""
    return name.replace("mlp.moe.gate_weight", "mlp.gate.weight").replace("mlp.moe.", "mlp.experts.")


def converted_grads(grads: dict) -> dict:
    """The converted model's gradients under the family's names (the shared expert's [gate; up]
    split back into gate_proj and up_proj; a gated one is Qwen2-MoE's shared_expert)."""
    gated = any(n.endswith("moe.shared_gate_weight") for n in grads)
    shared = "shared_expert." if gated else "shared_experts."
    if any(n.endswith("moe.gate_bias") for n in grads):  # GPT-OSS
        return gpt_oss_grads(grads)
    out = {}
    for name, g in grads.items():
        if name.endswith("moe.shared_gate_up_proj"):
            prefix, half = name.replace("moe.shared_gate_up_proj", shared), g.shape[0] // 2
            out.update({prefix + "gate_proj.weight": g[:half], prefix + "up_proj.weight": g[half:]})
        elif name.endswith("moe.shared_down_proj"):
            out[name.replace("moe.shared_down_proj", shared + "down_proj.weight")] = g
        elif name.endswith("moe.shared_gate_weight"):
            out[name.replace("moe.shared_gate_weight", "shared_expert_gate.weight")] = g[None]
        else:
            out[hf_name(name)] = g.t() if name.endswith("gate_weight") else g
    return out


def gpt_oss_grads(grads: dict) -> dict:
    """GPT-OSS's names and layouts: router.weight [E, H], router.bias; experts transposed, with
    gate/up columns interleaved (column 2f is gate f, 2f + 1 is up f)."""
    def interleave(t):  # [E, 2F, ...] halves -> rows g0, u0, g1, u1, ...
        half = t.shape[1] // 2
        return torch.stack([t[:, :half], t[:, half:]], dim=2).reshape(t.shape)

    out = {}
    for name, g in grads.items():
        base = name.replace("mlp.moe.", "mlp.experts.")
        if name.endswith("moe.gate_weight"):
            out[name.replace("moe.gate_weight", "router.weight")] = g.t()
        elif name.endswith("moe.gate_bias"):
            out[name.replace("moe.gate_bias", "router.bias")] = g
        elif name.endswith("moe.gate_up_proj"):
            out[base] = interleave(g).transpose(1, 2)
        elif name.endswith("moe.gate_up_proj_bias"):
            out[base] = interleave(g)
        elif name.endswith("moe.down_proj"):
            out[base] = g.transpose(1, 2)
        else:
            out[base] = g
    return out


@pytest.mark.parametrize("case", CONVERTIBLE)
def test_converted_model_matches_family(case, hf):
    from shardmoe.hf.converted import ConvertedBlock

    family, sizes = CONVERTIBLE[case]
    model = hf.small_model(family, **sizes)
    converted = hf.convert(copy.deepcopy(model))
    assert any(isinstance(m, ConvertedBlock) for m in converted.modules())
    logits, loss, grads = hf.loss_and_grads(model, IDS)
    c_logits, c_loss, c_grads = hf.loss_and_grads(converted, IDS)
    assert hf.relative_error(c_logits, logits) < 1e-6
    assert abs(c_loss.item() - loss.item()) < 1e-6 * loss.item()
    c_grads = converted_grads(c_grads)
    grads = {n: g for n, g in grads.items() if g.numel()}  # DeepSeek-V3's zero-width shared experts
    assert c_grads.keys() == grads.keys()
    for name, g in grads.items():
        assert hf.relative_error(c_grads[name], g) < 1e-5, name


def test_converted_model_matches_family_float32(hf):
    model = hf.small_model("qwen3_moe", dtype=torch.float32)
    converted = hf.convert(copy.deepcopy(model))
    logits, loss, grads = hf.loss_and_grads(model, IDS)
    c_logits, c_loss, c_grads = hf.loss_and_grads(converted, IDS)
    assert hf.relative_error(c_logits, logits) < 1e-5
    assert abs(c_loss.item() - loss.item()) < 1e-5 * loss.item()
    for name, g in converted_grads(c_grads).items():
        assert hf.relative_error(g, grads[name]) < 1e-5, name


@pytest.mark.parametrize("case", ["mixtral", "qwen2_moe", "deepseek_v3", "gpt_oss_clamping"])
def test_converted_model_matches_float64_reference(case, hf, monkeypatch):
    family, sizes = CONVERTIBLE[case]
    converted = hf.convert(hf.small_model(family, **sizes))
    result = hf.loss_and_grads(converted, IDS)

    def reference_forward(self, x):
        names = ("gate_weight", *(("gate_bias",) if self.config.router_bias else ()),
                 *self.config.expert_param_names, *self.config.shared_param_names)
        params = {n: getattr(self, n) for n in names}
        return reference_moe(x, params, self.config, self.correction_bias)[0]

    monkeypatch.setattr(MoE, "forward", reference_forward)
    expected = hf.loss_and_grads(converted, IDS)
    assert hf.relative_error(result[0], expected[0]) < 1e-10
    assert abs(result[1].item() - expected[1].item()) <= 1e-10 * expected[1].item()
    for name, g in expected[2].items():
        assert hf.relative_error(result[2][name], g) < 1e-10, name


def test_training_steps_give_the_family_losses(hf):
    model = hf.small_model("mixtral")
    converted = hf.convert(copy.deepcopy(model))
    losses = []
    for m in (model, converted):
        optimizer = torch.optim.SGD(m.parameters(), lr=0.1)
        run = []
        for _ in range(3):
            optimizer.zero_grad()
            loss = m(input_ids=IDS, labels=IDS).loss
            loss.backward()
            optimizer.step()
            run.append(loss.item())
        losses.append(run)
    assert losses[0][0] > losses[0][-1]
    assert losses[1] == pytest.approx(losses[0], rel=1e-6)


def test_aux_loss_keeps_the_family_coefficient(hf):
    converted = hf.convert(hf.small_model("olmoe", aux_loss_coef=0.5))
    out = converted(input_ids=IDS, labels=IDS)
    without = hf.convert(hf.small_model("olmoe", aux_loss_coef=0.0))(input_ids=IDS, labels=IDS)
    assert out.aux_loss is not None and out.aux_loss > 0
    assert out.loss.item() == pytest.approx(without.loss.item() + 0.5 * out.aux_loss.item(), rel=1e-6)


@pytest.mark.parametrize("case", CONVERTIBLE)
def test_from_block_and_block_state_dict_round_trip(case, hf):
    family, sizes = CONVERTIBLE[case]
    model = hf.small_model(family, **sizes)
    block = next(m for m in model.modules() if hasattr(getattr(m, "experts", None), "has_gate"))
    layer = from_block(block)
    x = torch.randn(2, 5, layer.config.hidden_size, dtype=torch.float64)

    def block_out(b):  # GPT-OSS's block returns (hidden_states, router_scores)
        out = b(x)
        return out[0] if isinstance(out, tuple) else out

    assert hf.relative_error(layer(x), block_out(block)) < 1e-6
    state = block_state_dict(layer)
    other = copy.deepcopy(block)
    hf.randomize(other, seed=7)
    missing, unexpected = other.load_state_dict(state, strict=False)
    assert not unexpected and all(n.startswith("shared_experts.") for n in missing)
    assert torch.equal(block_out(other), block_out(block))
    for name, t in state.items():
        assert torch.equal(t, block.state_dict()[name].to(t.dtype)), name


@pytest.mark.parametrize("family,options,match", [
    ("mixtral", {"router_jitter_noise": 0.1}, r"'mixtral'.*router jitter is not supported"),
])
def test_unsupported_blocks_are_refused_before_any_swap(family, options, match, hf):
    model = hf.small_model(family, **options)
    before = [type(m) for m in model.modules()]
    with pytest.raises(ValueError, match=match):
        hf.convert(model)
    assert [type(m) for m in model.modules()] == before
    block = next(m for m in model.modules() if hasattr(getattr(m, "experts", None), "has_gate"))
    with pytest.raises(ValueError, match=match):
        from_block(block)


def test_convert_refuses_a_model_that_ran_a_forward(hf):
    model = hf.small_model("qwen3_moe")
    model(input_ids=IDS)
    with pytest.raises(ValueError, match="model: expected a model that has not run a forward yet"):
        hf.convert(model)


def test_block_state_dict_refuses_what_no_block_holds():
    for options, name in ((dict(router_bias=True), "router_bias=True"), (dict(capacity_factor=1.0), "capacity_factor"),
                          (dict(expert="mlp"), "expert='mlp'"), (dict(score_func="sigmoid"), "score_func='sigmoid'")):
        layer = MoE(8, 4, 4, 2, **options)
        with pytest.raises(ValueError, match=rf"block_state_dict: expected .*got .*{name}"):
            block_state_dict(layer)


def test_block_state_dict_refuses_routers_no_family_computes():
    """A state dict carries no options: exported, these would load into blocks that route otherwise,
    with no error."""
    cases = [
        (dict(n_group=2, topk_group=1), "n_group=2"),
        (dict(routed_scaling_factor=2.5), "routed_scaling_factor=2.5"),
        (dict(renormalize_epsilon=0.5), "renormalize_epsilon=0.5"),
        (dict(correction_bias=True), "correction_bias=True"),
        (dict(shared_ffn_size=4), "shared_gate=False"),
        (dict(score_func="sigmoid", correction_bias=True, shared_ffn_size=4, shared_gate=True), "shared_gate=True"),
        (dict(score_func="sigmoid", correction_bias=True, renormalize_epsilon=0.5), "renormalize_epsilon=0.5"),
    ]
    for options, name in cases:
        layer = MoE(8, 4, 4, 2, **options)
        with pytest.raises(ValueError, match=rf"block_state_dict: no transformers block computes this router: .*{name}"):
            block_state_dict(layer)
    # what the families hold still exports: Qwen2-MoE's gated shared expert, DeepSeek-V3's router
    assert "shared_expert_gate.weight" in block_state_dict(MoE(8, 4, 4, 2, shared_ffn_size=4, shared_gate=True))
    deepseek = MoE(8, 4, 4, 2, score_func="sigmoid", correction_bias=True, n_group=2, topk_group=1,
                   routed_scaling_factor=2.5, renormalize_epsilon=1e-20, shared_ffn_size=4)
    assert "gate.e_score_correction_bias" in block_state_dict(deepseek)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "deepseek_v3", "gpt_oss"])
def test_a_converted_model_saves_what_plain_transformers_loads(family, hf, tmp_path):
    """save_pretrained of a converted model writes the family's own entries (under the layer's names,
    '...moe.gate_up_proj' and the like, from_pretrained would mark them missing and initialise them at
    random), and a converted model loads either kind of state dict."""
    from transformers import AutoModelForCausalLM

    model = hf.convert(hf.small_model(family))
    with torch.no_grad():  # "trained": away from the initial weights
        for p in model.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel()), dtype=p.dtype))
    expected = model(input_ids=IDS).logits
    model.save_pretrained(tmp_path)
    plain, info = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float64, output_loading_info=True,
                                                       experts_implementation="eager")
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    saved, loaded = model.state_dict(), plain.state_dict()
    assert saved.keys() == loaded.keys()
    # every trained weight, bit for bit (DeepSeek-V3's correction bias is float32 in the layer, whatever its dtype)
    assert all(torch.equal(saved[k].to(loaded[k].dtype), loaded[k]) for k in saved)
    # the families' eager routers take their softmax in float32: outputs agree to that
    assert hf.relative_error(plain(input_ids=IDS).logits, expected) < 1e-5
    # and back: a fresh converted model loads the family's entries into its layers
    again = hf.convert(hf.small_model(family, seed=7))
    again.load_state_dict(saved)
    torch.testing.assert_close(again(input_ids=IDS).logits, expected, rtol=0, atol=0)
