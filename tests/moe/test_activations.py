"""activate_backward(name, g, z) == g * d act/dz, against autograd in float64."""
import pytest
import torch

from shardmoe.moe.activations import activate, activate_backward
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
