import pytest
import torch

from shardmoe.model import RMSNorm, rms_norm, rms_norm_backward, rms_norm_forward

EPS = 1e-5


def test_forward_matches_torch_rms_norm():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 8, dtype=torch.float64, generator=gen)
    weight = torch.randn(8, dtype=torch.float64, generator=gen)
    expected = torch.nn.functional.rms_norm(x, (8,), weight, EPS)
    torch.testing.assert_close(rms_norm_forward(x, weight, EPS)[0], expected, rtol=1e-14, atol=1e-14)


def test_explicit_backward_matches_autograd(rel_err):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 7, 16, dtype=torch.float64, generator=gen, requires_grad=True)
    weight = torch.randn(16, dtype=torch.float64, generator=gen, requires_grad=True)
    grad_y = torch.randn(3, 7, 16, dtype=torch.float64, generator=gen)

    y, res = rms_norm_forward(x, weight, EPS)
    expected_x, expected_w = torch.autograd.grad(y, (x, weight), grad_y)
    grad_x, grads = rms_norm_backward(res, grad_y)
    assert rel_err(grad_x, expected_x) <= 1e-10
    assert rel_err(grads.weight, expected_w) <= 1e-10

    wrapped = torch.autograd.grad(rms_norm(x, weight, EPS), (x, weight), grad_y)
    assert rel_err(wrapped[0], expected_x) <= 1e-10
    assert rel_err(wrapped[1], expected_w) <= 1e-10


def test_backward_is_linear_in_the_incoming_gradient(rel_err):
    # The t-sharded model runs this backward on partial (unreduced) gradients and sums after.
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 4, 8, dtype=torch.float64, generator=gen)
    _, res = rms_norm_forward(x, torch.randn(8, dtype=torch.float64, generator=gen), EPS)
    g1, g2 = torch.randn(2, 2, 4, 8, dtype=torch.float64, generator=gen)
    whole_x, whole = rms_norm_backward(res, g1 + g2)
    (x1, w1), (x2, w2) = rms_norm_backward(res, g1), rms_norm_backward(res, g2)
    assert rel_err(x1 + x2, whole_x) <= 1e-12
    assert rel_err(w1.weight + w2.weight, whole.weight) <= 1e-12


@pytest.mark.parametrize("backward", ["explicit", "autograd"])
def test_bf16_runs_in_float32_and_returns_bf16(backward):
    gen = torch.Generator().manual_seed(3)
    x32 = torch.randn(2, 6, 32, generator=gen)
    layer = RMSNorm(32, EPS, backward=backward, dtype=torch.bfloat16)
    y = layer(x32.bfloat16())
    assert y.dtype == torch.bfloat16
    reference = torch.nn.functional.rms_norm(x32.bfloat16().float(), (32,), None, EPS)
    torch.testing.assert_close(y.float(), reference, rtol=1e-2, atol=1e-2)
    y.float().sum().backward()
    assert layer.weight.grad.dtype == torch.bfloat16
