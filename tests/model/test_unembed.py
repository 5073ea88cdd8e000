import pytest
import torch
import torch.nn.functional as F

from shardmoe.model import Unembedding, cross_entropy_backward, cross_entropy_forward, unembed_cross_entropy


def make_inputs(dtype=torch.float64, seed=0, batch=3, length=5, d_model=8, vocab=13):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, length, d_model, dtype=torch.float64, generator=gen).to(dtype).requires_grad_()
    weight = torch.randn(vocab, d_model, dtype=torch.float64, generator=gen).to(dtype).requires_grad_()
    targets = torch.randint(0, vocab, (batch, length), generator=gen)
    return x, weight, targets


def test_forward_matches_torch_cross_entropy():
    x, weight, targets = make_inputs()
    loss, _ = cross_entropy_forward(x, weight, targets)
    expected = F.cross_entropy((x @ weight.T).flatten(0, 1), targets.flatten())
    torch.testing.assert_close(loss, expected, rtol=1e-14, atol=1e-14)
    # A caller-given denominator (the global token count under data parallelism) rescales the sum.
    torch.testing.assert_close(cross_entropy_forward(x, weight, targets, num_tokens=60)[0], expected / 4)


@pytest.mark.parametrize("num_tokens", [None, 40])
def test_explicit_backward_matches_autograd(rel_err, num_tokens):
    x, weight, targets = make_inputs(seed=1)
    grad_loss = torch.tensor(0.7, dtype=torch.float64)
    loss, res = cross_entropy_forward(x, weight, targets, num_tokens)
    expected = torch.autograd.grad(loss, (x, weight), grad_loss)
    grad_x, grads = cross_entropy_backward(res, grad_loss)
    wrapped = torch.autograd.grad(unembed_cross_entropy(x, weight, targets, num_tokens), (x, weight), grad_loss)
    for name, explicit, via_function, reference in zip(("x", "weight"), (grad_x, grads.weight), wrapped, expected):
        assert rel_err(explicit, reference) <= 1e-10, name
        assert rel_err(via_function, reference) <= 1e-10, name


def test_stable_for_huge_logits():
    x, weight, targets = make_inputs(seed=2)
    with torch.no_grad():
        weight *= 1e4  # logits of order 1e4: a naive exp overflows
    loss = unembed_cross_entropy(x, weight, targets)
    assert torch.isfinite(loss)
    grad_x, grad_w = torch.autograd.grad(loss, (x, weight))
    assert torch.isfinite(grad_x).all() and torch.isfinite(grad_w).all()


@pytest.mark.parametrize("backward", ["explicit", "autograd"])
def test_bf16_loss_in_float32(backward):
    x64, weight64, targets = make_inputs(seed=3)
    reference = F.cross_entropy((x64.bfloat16().double() @ weight64.bfloat16().double().T).flatten(0, 1),
                                targets.flatten())
    layer = Unembedding(13, 8, backward=backward, dtype=torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(weight64)
    x = x64.detach().bfloat16().requires_grad_()
    loss = layer(x, targets)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss.double(), reference.detach(), rtol=1e-5, atol=1e-5)
    loss.backward()
    assert x.grad.dtype == torch.bfloat16 and layer.weight.grad.dtype == torch.bfloat16
    assert layer.logits(x).shape == (3, 5, 13)
