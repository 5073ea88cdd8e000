"""Grouped GEMMs: the grouped_mm path equals the per-expert loop, empty experts included."""
import pytest
import torch

from shardmoe.moe import experts as ex


def _groups(sizes):
    return ex.Groups.from_counts(torch.tensor(sizes))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_grouped_gemms_match_per_expert_matmuls(dtype):
    gen = torch.Generator().manual_seed(0)
    sizes = [3, 0, 5, 1]
    groups, n = _groups(sizes), sum(sizes)
    rows = torch.randn(n, 16, generator=gen, dtype=dtype)
    weight = torch.randn(4, 8, 16, generator=gen, dtype=dtype)
    grad = torch.randn(n, 8, generator=gen, dtype=dtype)
    starts = [0, 3, 3, 8]
    out = ex.grouped_linear(rows, weight, groups)
    back = ex.grouped_linear_t(grad, weight, groups)
    dw = ex.grouped_weight_grad(grad, rows, groups)
    db = ex.grouped_bias_grad(grad, groups)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-13, atol=1e-13)
    for e, (s, m) in enumerate(zip(starts, sizes)):
        r, g = rows[s:s + m], grad[s:s + m]
        assert torch.allclose(out[s:s + m], r @ weight[e].t(), **tol)
        assert torch.allclose(back[s:s + m], g @ weight[e], **tol)
        assert torch.allclose(dw[e], g.t() @ r, **tol)
        assert torch.allclose(db[e], g.sum(0), **tol)
    assert torch.count_nonzero(dw[1]) == 0 and torch.count_nonzero(db[1]) == 0


def test_grouped_mm_is_used_when_aligned_and_loop_otherwise():
    aligned = torch.randn(4, 16)
    assert ex._use_grouped_mm(aligned, torch.randn(2, 8, 16).transpose(-2, -1))
    assert not ex._use_grouped_mm(torch.randn(4, 6), torch.randn(2, 8, 6))   # 24-byte rows
    assert not ex._use_grouped_mm(aligned.double())


def test_zero_rows():
    groups = _groups([0, 0])
    w = torch.randn(2, 8, 16)
    assert ex.grouped_linear(torch.zeros(0, 16), w, groups).shape == (0, 8)
    assert ex.grouped_linear_t(torch.zeros(0, 8), w, groups).shape == (0, 16)
    assert torch.count_nonzero(ex.grouped_weight_grad(torch.zeros(0, 8), torch.zeros(0, 16), groups)) == 0
