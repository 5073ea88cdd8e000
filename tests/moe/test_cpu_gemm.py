"""cpu_gemm: the experts' GEMMs side by side, one per thread, against float64 products; skewed
routing (an expert with a thread's share of the rows or more), empty experts, transposed weights;
the GEMMs as torch operators (torch.library.opcheck) and, with elementwise.glu_grad, under
torch.compile(fullgraph=True)."""
import pytest
import torch

import shardmoe
from shardmoe.moe import cpu_gemm, elementwise
from shardmoe.moe.elementwise import CpuPasses
from shardmoe.settings import SETTINGS


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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_row_blocks_and_zero_padded_weight_grads_are_the_per_expert_products(two_threads, dtype):
    """bf16 / fp16 GEMMs run over whole 32-row blocks plus the rest, and each weight gradient over
    its rows zero-padded to a block (the neighbour's rows read in place): experts of exactly one
    block, of blocks plus a rest, of less than a block, empty, and the last expert (no rows after
    it); a non-finite value in the rows a padded gradient would read takes the exact-rows GEMM, so
    only the expert that owns it gets a non-finite gradient."""
    gen = torch.Generator().manual_seed(1)
    sizes = (32, 70, 0, 64, 31, 33, 5)
    n, k, o = sum(sizes), 40, 24
    rows = torch.randn(n, k, generator=gen).to(dtype)
    weight = torch.randn(len(sizes), k, o, generator=gen).to(dtype)
    grad = torch.randn(n, o, generator=gen).to(dtype)
    out = cpu_gemm.experts_mm(rows, weight, sizes, torch.full((n, o), float("nan"), dtype=dtype))
    for narrower in ("grad", "in"):  # the copied operand is the narrower one: both ways
        g, x = (grad, rows) if narrower == "grad" else (rows, grad)
        weight_grad = cpu_gemm.experts_weight_grad(g, x, sizes)
        start = 0
        for e, size in enumerate(sizes):
            part = slice(start, start + size)
            if narrower == "grad" and size:
                want = rows[part].double() @ weight[e].double()
                assert (out[part].double() - want).abs().max() <= _bound(dtype, k, rows, weight)
            want_grad = g[part].double().t() @ x[part].double()
            assert (weight_grad[e].double() - want_grad).abs().max() <= _bound(dtype, max(size, 1), g, x)
            start += size
    poisoned = rows.clone()
    owner = 3  # its second row; expert 1's padded gradient would read it (expert 2 is empty)
    poisoned[sum(sizes[:owner]) + 1, 3] = float("inf")
    weight_grad = cpu_gemm.experts_weight_grad(grad, poisoned, sizes)
    assert not weight_grad[owner].isfinite().all()
    assert weight_grad[:owner].isfinite().all() and weight_grad[owner + 1:].isfinite().all()


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
    monkeypatch.setattr(SETTINGS, "experts_mm", False)
    assert not cpu_gemm.available(x.detach())


def test_a_forwards_decision_is_taken_as_given(two_threads, monkeypatch):
    """With the forward's CpuPasses, available() checks only the operands: the settings and the
    thread count are read once, by CpuPasses.decide."""
    x = torch.randn(4, 3)
    assert CpuPasses.decide(x) == CpuPasses(elementwise=True, experts_mm=True)
    assert not cpu_gemm.available(x, passes=CpuPasses(elementwise=True))
    monkeypatch.setattr(SETTINGS, "experts_mm", False)
    torch.set_num_threads(1)
    assert cpu_gemm.available(x, passes=CpuPasses(experts_mm=True))
    assert not cpu_gemm.available(x.double(), passes=CpuPasses(experts_mm=True))
    assert CpuPasses.decide(x) == CpuPasses(elementwise=True)


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
    monkeypatch.setattr(SETTINGS, "experts_mm", False)
    loop = step()
    for a, b in zip(side_by_side, loop):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["experts_mm", "experts_weight_grad"])
def test_gemm_is_a_proper_torch_operator(two_threads, name):
    """torch.library.opcheck: out is marked as written (and nothing else), the op runs under
    FakeTensorMode and through AOT dispatch with dynamic shapes to its eager results; and its Meta
    kernel takes meta tensors and writes nothing."""
    gen = torch.Generator().manual_seed(0)
    sizes, k, o = [2, 0, 5], 4, 3
    rows, grad = torch.randn(7, k, generator=gen), torch.randn(7, o, generator=gen)
    args = {"experts_mm": (rows, torch.randn(3, o, k, generator=gen).transpose(1, 2), sizes, torch.empty(7, o)),
            "experts_weight_grad": (grad, rows, sizes, torch.empty(3, o, k))}[name]
    op = getattr(torch.ops.shardmoe_gemm, name)
    torch.library.opcheck(op, args)
    assert op(*(a.to("meta") if isinstance(a, torch.Tensor) else a for a in args)) is None


def test_glu_expert_backward_compiles_to_the_eager_bits(two_threads):
    """The glu expert's backward as the torch backend runs it on CPU: g Wdown (experts_mm), the
    one-pass glu_grad writing a over g Wdown, dWgate_up (experts_weight_grad). Under
    torch.compile(fullgraph=True) Dynamo traces the wrappers into one graph (no break: they call
    torch.ops directly and the ops have Meta kernels), the written buffers are functionalized, and
    the compiled function runs the same kernels on the same operands: eager's bits."""
    from shardmoe.moe import elementwise

    gen = torch.Generator().manual_seed(0)
    sizes, hidden, ffn = (5, 0, 9, 3), 12, 10
    n = sum(sizes)
    g, x = torch.randn(n, hidden, generator=gen), torch.randn(n, hidden, generator=gen)
    h, w = torch.randn(n, 2 * ffn, generator=gen), torch.rand(n, generator=gen)
    down_t = torch.randn(len(sizes), ffn, hidden, generator=gen).transpose(1, 2)  # [E, H, F], strided

    def backward(g, down_t, h, w, x):
        g_down = cpu_gemm.experts_mm(g, down_t, sizes, g.new_empty(n, ffn))
        a, grad_h, dots = elementwise.glu_grad(h, g_down, w, "silu", a_out=g_down)
        return a, grad_h, dots, cpu_gemm.experts_weight_grad(grad_h, x, sizes)

    eager = backward(g, down_t, h, w, x)
    compiled = torch.compile(backward, fullgraph=True)(g, down_t, h, w, x)
    for want, got in zip(eager, compiled):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
