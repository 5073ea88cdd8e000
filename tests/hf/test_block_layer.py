"""shardmoe.hf.block_layer: a transformers Mixtral block as a shardmoe.MoE (from_block) and back
(block_state_dict), in float32 against the block itself; every other family is in test_blocks.py
and test_convert.py."""
import pytest
import torch


def from_block(block, **overrides):
    from shardmoe.hf import from_block  # not at collection: see tests/hf/conftest.py

    return from_block(block, **overrides)


def block_state_dict(layer):
    from shardmoe.hf import block_state_dict

    return block_state_dict(layer)


def _mixtral_block(H=16, F=24, E=4, k=2, seed=0):
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    cfg = MixtralConfig(hidden_size=H, intermediate_size=F, num_local_experts=E, num_experts_per_tok=k)
    cfg._experts_implementation = "grouped_mm"
    torch.manual_seed(seed)
    block = MixtralSparseMoeBlock(cfg)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.3)
    return block


def test_a_mixtral_block_imports_with_its_outputs_and_gradients_fp32():
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    block = _mixtral_block()
    # the block's backward has no aux term: the layer's is scaled away (its value is still checked)
    layer = from_block(block, aux_loss_coef=1.0, aux_loss_scale=0.0)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 11, 16, generator=gen)
    grad_out = torch.randn(2, 11, 16, generator=gen)
    x_ref, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_ref = block(x_ref)
    out_ref.backward(grad_out)
    out = layer(x_ours)
    out.backward(grad_out)

    def rel(a, b):
        return ((a - b).abs().max() / b.abs().max()).item()

    assert rel(out, out_ref) <= 1e-5
    assert rel(x_ours.grad, x_ref.grad) <= 1e-5
    assert rel(layer.gate_weight.grad, block.gate.weight.grad.t()) <= 1e-5
    assert rel(layer.gate_up_proj.grad, block.experts.gate_up_proj.grad) <= 1e-5
    assert rel(layer.down_proj.grad, block.experts.down_proj.grad) <= 1e-5
    expected_aux = load_balancing_loss_func((x.reshape(-1, 16) @ block.gate.weight.t(),), 4, 2)
    assert layer.aux_loss.item() == pytest.approx(expected_aux.item(), rel=1e-6)


def test_a_mixtral_block_round_trips_and_takes_overrides():
    block = _mixtral_block()
    layer = from_block(block, renormalize=False)
    assert layer.config.renormalize is False and layer.config.top_k == 2
    layer = from_block(block)
    fresh = _mixtral_block(seed=5)
    fresh.load_state_dict(block_state_dict(layer))
    for (name, a), b in zip(block.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name
