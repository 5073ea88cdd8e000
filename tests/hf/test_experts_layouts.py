"""Every experts layout transformers' decorator describes, on decorated experts classes of the
tests' own: "shardmoe" against transformers' "batched_mm" (an independent implementation of the
same flags), float64; and each feature shardmoe cannot run, refused before any work."""
from __future__ import annotations

import pytest
import torch
from torch import nn

E, H, F, S, K = 5, 8, 6, 11, 2


def experts_class(transposed: bool = False, bias: bool = False, gate: bool = True, post_norm: bool = False,
                  apply_gate=None):
    from transformers.activations import ACT2FN
    from transformers.integrations.moe import use_experts_implementation

    class Experts(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.num_experts = E
            width = 2 * F if gate else F
            first = "gate_up_proj" if gate else "up_proj"
            setattr(self, first, nn.Parameter(torch.randn(*((E, H, width) if transposed else (E, width, H)))))
            self.down_proj = nn.Parameter(torch.randn(*((E, F, H) if transposed else (E, H, F))))
            if bias:
                setattr(self, first + "_bias", nn.Parameter(torch.randn(E, width)))
                self.down_proj_bias = nn.Parameter(torch.randn(E, H))
            self.act_fn = ACT2FN[config.hidden_act]
            if post_norm:
                self.post_expert_norm = nn.Identity()

    if apply_gate is not None:
        Experts._apply_gate = apply_gate
    return use_experts_implementation(Experts, is_transposed=transposed, has_bias=bias, has_gate=gate,
                                      has_post_expert_norm=post_norm)


def build(cls, implementation: str, hidden_act: str = "silu"):
    from transformers import PreTrainedConfig

    config = PreTrainedConfig(hidden_act=hidden_act)
    config._experts_implementation = implementation
    torch.manual_seed(0)
    return cls(config).double()


def routed_inputs(seed: int = 0, tokens: int = S):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=gen, dtype=torch.float64, requires_grad=True)
    index = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(tokens)]) if tokens else \
        torch.zeros(0, K, dtype=torch.long)
    weights = torch.rand(tokens, K, generator=gen, dtype=torch.float64, requires_grad=True)
    return x, index, weights


def run(module, x, index, weights):
    out = module(x, index, weights)
    out.backward(torch.cos(torch.arange(out.numel(), dtype=out.dtype)).view_as(out))
    grads = {n: p.grad for n, p in module.named_parameters()}
    return out.detach(), x.grad, weights.grad, grads


@pytest.mark.parametrize("transposed,bias,gate,act", [
    (False, False, True, "gelu"), (True, False, True, "silu"), (False, True, True, "gelu_pytorch_tanh"),
    (True, True, True, "swish"), (False, False, False, "relu"), (True, True, False, "gelu")])
def test_layout_matches_batched_mm(hf, transposed, bias, gate, act):
    cls = experts_class(transposed, bias, gate)
    results = []
    for implementation in ("batched_mm", "shardmoe"):
        x, index, weights = routed_inputs()
        results.append(run(build(cls, implementation, act), x, index, weights))
    (out_ref, dx_ref, dw_ref, grads_ref), (out, dx, dw, grads) = results
    assert hf.relative_error(out, out_ref) < 1e-12
    assert hf.relative_error(dx, dx_ref) < 1e-12
    assert hf.relative_error(dw, dw_ref) < 1e-12
    assert grads.keys() == grads_ref.keys() and len(grads) == 2 + 2 * bias
    for name in grads:
        assert grads[name].shape == grads_ref[name].shape
        assert hf.relative_error(grads[name], grads_ref[name]) < 1e-12, name


def test_zero_tokens(hf):
    module = build(experts_class(bias=True), "shardmoe")
    x, index, weights = routed_inputs(tokens=0)
    out, dx, dw, grads = run(module, x, index, weights)
    assert out.shape == (0, H) and dx.shape == (0, H) and dw.shape == (0, K)
    assert all(g.abs().max() == 0 for g in grads.values())


def _own_gate(self, gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.relu(gate) * up


@pytest.mark.parametrize("options,hidden_act,match", [
    (dict(post_norm=True), "silu", "post-expert norm"),
    (dict(apply_gate=_own_gate), "silu", r"Experts\._apply_gate"),
    ({}, "gelu_new", "activation: expected act_fn one of .*got NewGELUActivation"),
])
def test_unsupported_features_are_refused(hf, options, hidden_act, match):
    module = build(experts_class(**options), "shardmoe", hidden_act)
    x, index, weights = routed_inputs()
    with pytest.raises(ValueError, match=r"family '[a-z.]*test_experts_layouts'.*" + match):
        module(x, index, weights)


def test_bad_inputs_are_refused(hf):
    module = build(experts_class(), "shardmoe")
    x, index, weights = routed_inputs()
    module._is_expert_parallel = True
    with pytest.raises(ValueError, match="expert parallelism"):
        module(x, index, weights)
    module._is_expert_parallel = False
    with pytest.raises(ValueError, match=rf"top_k_index: expected expert ids in 0..{E - 1}, got [0-9]..{E}"):
        module(x, torch.where(index == 0, E, index), weights)
    with pytest.raises(ValueError, match=r"hidden_states: expected dtype torch.float64 .* got torch.float32"):
        module(x.float(), index, weights)
    with pytest.raises(ValueError, match=r"top_k_index, top_k_weights: expected shapes \[S, k\] with S=11"):
        module(x, index[:3], weights[:3])
