"""activate_backward(name, g, z) == g * d act/dz, against autograd in float64."""
import pytest
import torch

from shardmoe.moe.activations import ClampedSwiGLU, activate, activate_backward
from shardmoe.moe.config import ACTIVATIONS


@pytest.mark.parametrize("name", ACTIVATIONS)
def test_backward_matches_autograd_float64(name):
    gen = torch.Generator().manual_seed(1)
    z = (torch.randn(4096, generator=gen, dtype=torch.float64) * 4).requires_grad_()
    grad = torch.randn(4096, generator=gen, dtype=torch.float64)
    (expected,) = torch.autograd.grad(activate(name, z), z, grad)
    got = activate_backward(name, grad, z.detach())
    assert torch.allclose(got, expected, rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("name", ACTIVATIONS)
def test_bf16_backward_close_to_float64(name):
    gen = torch.Generator().manual_seed(2)
    z = torch.randn(2048, generator=gen).bfloat16()
    grad = torch.randn(2048, generator=gen).bfloat16()
    exact = activate_backward(name, grad.double(), z.double())
    got = activate_backward(name, grad, z).double()
    assert ((got - exact).abs().max() / exact.abs().max()).item() < 1e-2


def test_unknown_activation_names_the_argument():
    with pytest.raises(ValueError, match="activation: expected .* got 'tanh'"):
        activate("tanh", torch.zeros(1))
    with pytest.raises(ValueError, match="activation: expected .* got 'tanh'"):
        activate_backward("tanh", torch.zeros(1), torch.zeros(1))


def _clamped_swiglu_autograd(hg, hu, limit, alpha):
    """GPT-OSS's _apply_gate on de-interleaved halves, written with torch.clamp as it is."""
    gate = hg.clamp(max=limit)
    return (hu.clamp(-limit, limit) + 1) * (gate * torch.sigmoid(gate * alpha))


def test_clamped_swiglu_matches_autograd_float64_at_and_around_the_limits():
    """Forward and backward against torch.clamp's autograd, with inputs planted exactly at +-L (where
    torch.clamp passes the gradient: the closed-range convention), just inside and just outside."""
    limit, alpha = 1.5, 1.702
    gen = torch.Generator().manual_seed(3)
    planted = torch.tensor([limit, -limit, limit + 1e-12, -limit - 1e-12, limit - 1e-12, 0.0, 9.0, -9.0],
                           dtype=torch.float64)
    hg = torch.cat([planted, planted.flip(0), torch.randn(512, generator=gen, dtype=torch.float64) * 3])
    hu = torch.cat([planted, planted, torch.randn(512, generator=gen, dtype=torch.float64) * 3])
    hg.requires_grad_(), hu.requires_grad_()
    grad = torch.randn(hg.shape, generator=gen, dtype=torch.float64)
    want = _clamped_swiglu_autograd(hg, hu, limit, alpha)
    want_g, want_u = torch.autograd.grad(want, (hg, hu), grad)
    act = ClampedSwiGLU(limit, alpha)
    got, act_gate = act.forward(hg.detach(), hu.detach())
    got_g, got_u = torch.empty_like(grad), torch.empty_like(grad)
    act.backward(grad, hg.detach(), hu.detach(), act_gate, got_g, got_u)
    assert torch.allclose(got, want, rtol=1e-14, atol=0)
    assert torch.allclose(got_g, want_g, rtol=1e-13, atol=1e-15)
    assert torch.allclose(got_u, want_u, rtol=1e-13, atol=1e-15)
    # the planted points: gradient passes at exactly +-L, stops just outside
    assert (got_u[:2] != 0).all() and (got_u[2:4] == 0).all() and got_g[0] != 0 and got_g[2] == 0


def test_clamped_swiglu_bf16_close_to_float64():
    gen = torch.Generator().manual_seed(4)
    hg, hu, grad = (torch.randn(3, 2048, generator=gen) * 4).bfloat16()
    act = ClampedSwiGLU(7.0, 1.702)
    exact = act.forward(hg.double(), hu.double())[0]
    got = act.forward(hg, hu)[0].double()
    assert ((got - exact).abs().max() / exact.abs().max()).item() < 1e-2
    outs = [torch.empty(2048, dtype=d) for d in (torch.float64, torch.float64, torch.bfloat16, torch.bfloat16)]
    act.backward(grad.double(), hg.double(), hu.double(), act.gate(hg.double()), outs[0], outs[1])
    act.backward(grad, hg, hu, act.gate(hg), outs[2], outs[3])
    for exact, got in ((outs[0], outs[2]), (outs[1], outs[3])):
        assert ((got.double() - exact).abs().max() / exact.abs().max()).item() < 2e-2
