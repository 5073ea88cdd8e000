"""The kernels' closed-form activations and derivatives, and their GLU forms (the clamped SwiGLU
included), against float64 autograd and the torch path."""
import pytest
import torch

from shardmoe.kernels import triton_importable

if not triton_importable():
    pytest.skip("triton cannot be imported; install triton==3.9.0 to run the kernel tests", allow_module_level=True)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from shardmoe.kernels.activations import (activation, activation_args, activation_grad, glu,  # noqa: E402
                                          glu_backward)
from shardmoe.moe.activations import ClampedSwiGLU  # noqa: E402
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


@triton.jit
def _glu_kernel(gate_ptr, up_ptr, grad_ptr, a_ptr, grad_gate_ptr, grad_up_ptr, n, limit, alpha,
                ACT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    gate = tl.load(gate_ptr + offs, mask=mask, other=0.0)
    up = tl.load(up_ptr + offs, mask=mask, other=0.0)
    grad = tl.load(grad_ptr + offs, mask=mask, other=0.0)
    tl.store(a_ptr + offs, glu(gate, up, limit, alpha, ACT), mask=mask)
    grad_gate, grad_up = glu_backward(grad, gate, up, limit, alpha, ACT)
    tl.store(grad_gate_ptr + offs, grad_gate, mask=mask)
    tl.store(grad_up_ptr + offs, grad_up, mask=mask)


def _run_glu(activation, gate, up, grad):
    a, grad_gate, grad_up = (torch.empty_like(gate) for _ in range(3))
    args = activation_args(activation, glu=True)
    _glu_kernel[(1,)](gate, up, grad, a, grad_gate, grad_up, gate.numel(), args["limit"], args["alpha"],
                      ACT=args["ACT"], BLOCK=triton.next_power_of_2(gate.numel()))
    return a, grad_gate, grad_up


@pytest.mark.parametrize("limit", [7.0, 0.5])
def test_clamped_swiglu_matches_the_torch_path(device, limit):
    """GPT-OSS's clamped SwiGLU (glu, glu_backward with ACT "clamped_swiglu") against float64 autograd of
    (clamp(hu, -L, L) + 1) min(hg, L) sigmoid(alpha min(hg, L)) (torch.clamp's gradient passes on the
    closed range) and the torch path's ClampedSwiGLU, on the same float32 inputs, the clamps' edges
    included: the gradient passes at hg == L and hu == +-L exactly and is exactly 0 beyond."""
    clamped = ClampedSwiGLU(limit, 1.702)
    values = torch.cat([torch.linspace(-20, 20, 9), torch.linspace(-3, 3, 7),
                        torch.tensor([limit, -limit, limit + 0.25, -limit - 0.25, limit - 0.25])])
    gate, up = (t.reshape(-1) for t in torch.meshgrid(values, values, indexing="ij"))  # every pair
    grad = torch.linspace(0.5, 2, gate.numel()) * torch.tensor([1.0, -1.0]).repeat(gate.numel() // 2 + 1)[:gate.numel()]
    gate, up, grad = (t.float().to(device) for t in (gate, up, grad))
    a, grad_gate, grad_up = _run_glu(clamped, gate, up, grad)

    g64, u64, d64 = (t.double().cpu().requires_grad_(t is not grad) for t in (gate, up, grad))
    gc = g64.clamp(max=limit)
    expected_a = (u64.clamp(-limit, limit) + 1) * gc * torch.sigmoid(1.702 * gc)
    expected_a.backward(d64)
    torch.testing.assert_close(a.double().cpu(), expected_a.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad_gate.double().cpu(), g64.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad_up.double().cpu(), u64.grad, rtol=1e-5, atol=1e-6)
    torch_a, act_gate = clamped.forward(g64.detach(), u64.detach())  # and the torch path agrees
    torch_gate, torch_up = torch.empty_like(torch_a), torch.empty_like(torch_a)
    clamped.backward(d64, g64.detach(), u64.detach(), act_gate, torch_gate, torch_up)
    torch.testing.assert_close(torch_a, expected_a.detach(), rtol=1e-14, atol=1e-15)
    torch.testing.assert_close(torch_gate, g64.grad, rtol=1e-14, atol=1e-15)
    torch.testing.assert_close(torch_up, u64.grad, rtol=1e-14, atol=1e-15)
    # where each clamp cuts the gradient, exactly
    assert torch.all(grad_gate[gate > limit] == 0) and torch.all(grad_up[up.abs() > limit] == 0)
    at_edge = (gate == limit) & (up.clamp(-limit, limit) != -1)  # (uc + 1) = 0 would zero it anyway
    assert at_edge.any() and torch.all(grad_gate[at_edge] != 0)
    at_edges = (up.abs() == limit) & (gate != 0)  # f(0) = 0 would zero it anyway
    assert at_edges.any() and torch.all(grad_up[at_edges] != 0)


@pytest.mark.parametrize("name", ["relu", "gelu", "gelu_tanh", "silu", "identity"])
def test_glu_of_a_named_activation(device, name):
    """glu / glu_backward with a named activation: a = act(hg) hu, dhg = dA hu act'(hg), dhu = dA act(hg),
    against float64 autograd."""
    gen = torch.Generator().manual_seed(0)
    gate, up, grad = (torch.randn(100, generator=gen, dtype=torch.float64) * 3 for _ in range(3))
    a, grad_gate, grad_up = (t.cpu() for t in _run_glu(name, *(t.float().to(device) for t in (gate, up, grad))))
    g64, u64 = gate.float().double().requires_grad_(), up.float().double().requires_grad_()
    expected = ACTIVATION_FUNCTIONS[name](g64) * u64
    expected_gate, expected_up = torch.autograd.grad(expected, (g64, u64), grad.float().double())
    torch.testing.assert_close(a.double(), expected.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad_gate.double(), expected_gate, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad_up.double(), expected_up, rtol=1e-5, atol=1e-6)


def test_activation_args_errors():
    assert activation_args("silu", glu=False) == {"ACT": "silu", "limit": 0.0, "alpha": 0.0}
    assert activation_args(ClampedSwiGLU(7.0, 1.702), glu=True) == {"ACT": "clamped_swiglu", "limit": 7.0,
                                                                     "alpha": 1.702}
    with pytest.raises(ValueError, match="activation: expected one of .* got 'tanh'"):
        activation_args("tanh", glu=True)
    with pytest.raises(ValueError, match="activation: a clamped SwiGLU is a GLU form"):
        activation_args(ClampedSwiGLU(7.0, 1.702), glu=False)
