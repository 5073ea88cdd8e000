"""cpu_gemm: the experts' GEMMs side by side, one per thread, against float64 products; skewed
routing (an expert with a thread's share of the rows or more), empty experts, transposed weights."""
import pytest
import torch

import shardmoe
from shardmoe.moe import cpu_gemm, elementwise


@pytest.fixture
def two_threads():
    if elementwise._ops() is None:
        pytest.skip("the C++ library does not build here")
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(previous)


def _bound(dtype, k, *operands):
    """|error| bound of a float32-accumulated dot of length k, rounded to dtype."""
    scale = max(float(t.double().abs().max()) for t in operands) ** 2 * k
    return scale * (k * torch.finfo(torch.float32).eps + torch.finfo(dtype).eps)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("sizes", [(5, 0, 9, 3, 7, 1), (2, 40, 1, 0)], ids=["even", "skewed"])
def test_experts_mm_and_weight_grad_are_the_per_expert_products(two_threads, dtype, sizes):
    gen = torch.Generator().manual_seed(0)
    n, k, o = sum(sizes), 24, 20
    rows = torch.randn(n, k, generator=gen).to(dtype)
    weight = torch.randn(len(sizes), o, k, generator=gen).to(dtype).transpose(1, 2)  # [E, K, O], strided
    grad = torch.randn(n, o, generator=gen).to(dtype)
    assert cpu_gemm.available(rows, weight)
    out = cpu_gemm.experts_mm(rows, weight, sizes, torch.full((n, o), float("nan"), dtype=dtype))
    weight_grad = cpu_gemm.experts_weight_grad(grad, rows, sizes)
    start = 0
    for e, size in enumerate(sizes):
        part = slice(start, start + size)
        want = rows[part].double() @ weight[e].double()
        if size:
            assert (out[part].double() - want).abs().max() <= _bound(dtype, k, rows, weight)
        want_grad = grad[part].double().t() @ rows[part].double()
        assert (weight_grad[e].double() - want_grad).abs().max() <= _bound(dtype, max(size, 1), grad, rows)
        start += size
    assert not out.isnan().any()
    # the same call again gives the same bits, whichever thread took which expert
    assert torch.equal(out, cpu_gemm.experts_mm(rows, weight, sizes, torch.empty_like(out)))


def test_what_it_does_not_take_stays_on_the_loop(two_threads, monkeypatch):
    x = torch.randn(4, 3)
    assert cpu_gemm.available(x)
    assert not cpu_gemm.available(x.double())
    assert not cpu_gemm.available(x, x.to(torch.bfloat16))
    with torch.enable_grad():
        assert not cpu_gemm.available(x.requires_grad_())
    torch.set_num_threads(1)
    assert not cpu_gemm.available(x.detach())
    torch.set_num_threads(2)
    monkeypatch.setenv("SHARDMOE_EXPERTS_MM", "0")
    assert not cpu_gemm.available(x.detach())


def test_layer_with_and_without_side_by_side_gemms(two_threads, monkeypatch):
    """fp32 layer, forward and backward: the same results to float32 round-off either way."""
    torch.manual_seed(0)
    layer = shardmoe.MoE(32, 48, 6, 2)
    x = torch.randn(64, 32)

    def step():
        layer.zero_grad(set_to_none=True)
        xg = x.clone().requires_grad_()
        out = layer(xg)
        out.square().sum().backward()
        return [out.detach(), xg.grad, *(p.grad for p in layer.parameters())]

    side_by_side = step()
    monkeypatch.setenv("SHARDMOE_EXPERTS_MM", "0")
    loop = step()
    for a, b in zip(side_by_side, loop):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
