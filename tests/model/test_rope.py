import torch

from shardmoe.model import apply_rope, packed_layout, rope_backward, rope_forward, rope_table


def test_forward_is_a_complex_rotation_of_half_pairs():
    gen = torch.Generator().manual_seed(0)
    positions = torch.tensor([[0, 1, 2, 0, 1], [3, 4, 0, 1, 2]])
    x = torch.randn(2, 5, 3, 8, dtype=torch.float64, generator=gen)
    y, _ = rope_forward(x, rope_table(positions, 8, 10000.0, torch.float64))

    angle = positions[..., None, None].double() * 10000.0 ** (-torch.arange(0, 8, 2).double() / 8)
    z = torch.complex(x[..., :4], x[..., 4:]) * torch.polar(torch.ones_like(angle), angle)
    torch.testing.assert_close(y, torch.cat([z.real, z.imag], dim=-1), rtol=1e-14, atol=1e-14)


def test_positions_restart_per_segment(packed_starts):
    # A packed segment is rotated exactly like the same tokens starting a fresh row.
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 11, 2, 6, dtype=torch.float64, generator=gen)
    table = rope_table(packed_layout(packed_starts).positions, 6, 500.0, torch.float64)
    packed, _ = rope_forward(x, table)
    fresh_positions = torch.arange(6)[None]
    alone, _ = rope_forward(x[:1, 5:11], rope_table(fresh_positions, 6, 500.0, torch.float64))
    torch.testing.assert_close(packed[:1, 5:11], alone, rtol=0, atol=0)


def test_explicit_backward_matches_autograd(rel_err):
    gen = torch.Generator().manual_seed(2)
    positions = torch.randint(0, 50, (3, 7), generator=gen)
    table = rope_table(positions, 10, 10000.0, torch.float64)
    x = torch.randn(3, 7, 2, 4, 10, dtype=torch.float64, generator=gen, requires_grad=True)
    grad_y = torch.randn(3, 7, 2, 4, 10, dtype=torch.float64, generator=gen)

    y, res = rope_forward(x, table)
    (expected,) = torch.autograd.grad(y, x, grad_y)
    assert rel_err(rope_backward(res, grad_y)[0], expected) <= 1e-10
    (wrapped,) = torch.autograd.grad(apply_rope(x, table), x, grad_y)
    assert rel_err(wrapped, expected) <= 1e-10
