"""The kernels' closed-form activations and derivatives against float64 autograd."""
import pytest
import torch

from shardmoe.kernels import triton_importable

if not triton_importable():
    pytest.skip("triton cannot be imported; install triton==3.9.0 to run the kernel tests", allow_module_level=True)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from shardmoe.kernels.activations import activation, activation_grad  # noqa: E402
from shardmoe.moe.reference import ACTIVATION_FUNCTIONS  # noqa: E402

BLOCK = 64


@triton.jit
def _elementwise_kernel(z_ptr, act_ptr, grad_ptr, n, ACT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    z = tl.load(z_ptr + offs, mask=offs < n, other=0.0)
    tl.store(act_ptr + offs, activation(z, ACT), mask=offs < n)
    tl.store(grad_ptr + offs, activation_grad(z, ACT), mask=offs < n)


@pytest.mark.parametrize("name", ["relu", "gelu", "gelu_tanh", "silu", "identity"])
def test_activation_and_derivative(device, name):
    """act(z) and act'(z) on float32 inputs from -20 to 20 (0 and both saturated tails
    included) match float64 autograd to float32 round-off."""
    z = torch.cat([torch.linspace(-20, 20, 41), torch.linspace(-3, 3, 23)]).to(device)
    act, grad = torch.empty_like(z), torch.empty_like(z)
    _elementwise_kernel[(1,)](z, act, grad, z.numel(), ACT=name, BLOCK=BLOCK)

    z64 = z.double().requires_grad_(True)
    expected = ACTIVATION_FUNCTIONS[name](z64)
    (expected_grad,) = torch.autograd.grad(expected.sum(), z64)
    torch.testing.assert_close(act.double(), expected.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad.double(), expected_grad, rtol=1e-5, atol=1e-6)
