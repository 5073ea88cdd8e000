import torch

from shardmoe.model import Embedding, embed, embedding_backward, embedding_forward


def test_forward_is_a_row_lookup():
    weight = torch.randn(7, 5, dtype=torch.float64)
    ids = torch.tensor([[0, 3, 3, 6], [1, 1, 2, 0]])
    assert torch.equal(embed(ids, weight), torch.nn.functional.embedding(ids, weight))


def test_explicit_backward_matches_autograd_with_repeated_ids(rel_err):
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(11, 6, dtype=torch.float64, generator=gen, requires_grad=True)
    ids = torch.randint(0, 11, (3, 9), generator=gen)
    grad_x = torch.randn(3, 9, 6, dtype=torch.float64, generator=gen)

    x, res = embedding_forward(ids, weight)
    (expected,) = torch.autograd.grad(x, weight, grad_x)
    _, grads = embedding_backward(res, grad_x)
    assert rel_err(grads.weight, expected) <= 1e-10
    # The autograd.Function wrapper runs the same backward.
    (wrapped,) = torch.autograd.grad(embed(ids, weight, backward="explicit"), weight, grad_x)
    assert rel_err(wrapped, expected) <= 1e-10


def test_module_declares_its_spec_and_trains_in_bf16():
    layer = Embedding(16, 8, dtype=torch.bfloat16)
    assert layer.SPECS == {"weight": "V/t M/d"}
    ids = torch.randint(0, 16, (2, 5))
    layer(ids).float().square().sum().backward()
    assert layer.weight.grad.dtype == torch.bfloat16
    assert torch.isfinite(layer.weight.grad.float()).all()
