"""Grouped GEMMs: the grouped_mm path, the per-expert loop and the CPU's side-by-side GEMMs equal
per-expert matmuls, empty experts included."""
import pytest
import torch

from shardmoe.moe import experts as ex
from shardmoe.moe import cpu
from shardmoe.moe.cpu import CpuOps, Workspace
from shardmoe.moe.experts import TORCH_OPS


def _groups(sizes):
    return ex.Groups.from_counts(torch.tensor(sizes))


@pytest.mark.parametrize("on_cpu_ops", [False, True], ids=["torch", "cpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_grouped_gemms_match_per_expert_matmuls(dtype, on_cpu_ops):
    gen = torch.Generator().manual_seed(0)
    sizes = [3, 0, 5, 1]
    groups, n = _groups(sizes), sum(sizes)
    rows = torch.randn(n, 16, generator=gen, dtype=dtype)
    weight = torch.randn(4, 8, 16, generator=gen, dtype=dtype)
    grad = torch.randn(n, 8, generator=gen, dtype=dtype)
    starts = [0, 3, 3, 8]
    ops = CpuOps.decide(rows, Workspace(min_bytes=0)) if on_cpu_ops else TORCH_OPS
    if on_cpu_ops and dtype == torch.float32 and torch.get_num_threads() >= 2 and cpu.library_loaded():
        assert ops.gemm_fits(groups, rows, weight.transpose(1, 2))  # the side-by-side GEMMs run
    out = ops.linear(rows, weight, groups)
    back = ops.linear_t(grad, weight, groups)
    dw = ops.weight_grad(grad, rows, groups)
    db = ops.bias_grad(grad, groups)
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
    for ops in (TORCH_OPS, CpuOps.decide(w)):
        assert ops.linear(torch.zeros(0, 16), w, groups).shape == (0, 8)
        assert ops.linear_t(torch.zeros(0, 8), w, groups).shape == (0, 16)
        assert torch.count_nonzero(ops.weight_grad(torch.zeros(0, 8), torch.zeros(0, 16), groups)) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bias", [False, True])
def test_glu_backward_in_one_pass_equals_the_stage_functions(dtype, bias):
    """The one-pass glu backward (CpuOps.glu_backward_one_pass) against the stage functions run in turn,
    with an
    empty expert, biases, workspace buffers holding garbage from an earlier step: dx rows and every
    parameter gradient bit for bit, the gate dots too in bf16, and in float32 to the round-off of
    each row's sum (the compiler may fuse another multiply-add)."""
    if not CpuOps.decide(torch.zeros(1, dtype=dtype)).elementwise:
        pytest.skip("the C++ CPU library is not built here (no compiler): one path only")
    gen = torch.Generator().manual_seed(4)
    sizes, H, F = [40, 0, 70, 18], 32, 24
    groups, n = _groups(sizes), sum(sizes)
    h, g, xs = (torch.randn(n, d, generator=gen).to(dtype) for d in (2 * F, H, H))
    w = torch.rand(n, generator=gen)
    params = {"gate_up_proj": (torch.randn(4, 2 * F, H, generator=gen) / 6).to(dtype),
              "down_proj": (torch.randn(4, H, F, generator=gen) / 5).to(dtype),
              "gate_up_proj_bias": torch.randn(4, 2 * F, generator=gen).to(dtype) if bias else None,
              "down_proj_bias": torch.randn(4, H, generator=gen).to(dtype) if bias else None}
    workspace = Workspace(min_bytes=0)
    garbage = [workspace.empty((n, 2 * F), dtype, h.device).fill_(float("nan")) for _ in range(3)]
    del garbage  # three blocks holding NaN, free for the one-pass path to be lent
    ops = CpuOps.decide(h, workspace)
    assert ops.has_glu_backward_one_pass(g, h, w, "silu")
    one = ex._glu_expert_backward_one_pass(ops, "silu", g, w, xs, h, params, groups, bias)
    staged = ex._glu_expert_backward_by_stage(CpuOps.decide(h), "silu", g, w, xs, h, params, groups, bias)
    torch.testing.assert_close(one[0], staged[0], rtol=0, atol=0)
    assert one[2].keys() == staged[2].keys()
    for name, grad in one[2].items():
        if grad is None:
            assert staged[2][name] is None and not bias
        else:
            torch.testing.assert_close(grad, staged[2][name], rtol=0, atol=0)
    if dtype == torch.bfloat16:  # the same sums in the same order
        torch.testing.assert_close(one[1], staged[1], rtol=0, atol=0)
    else:  # a fused multiply-add apart: float32 round-off of each row's sum of |terms|
        starts = [0, 40, 40, 110]
        g_down = torch.cat([g[s:s + m] @ params["down_proj"][e] for e, (s, m) in enumerate(zip(starts, sizes))])
        terms = (g_down * torch.nn.functional.silu(h[:, :F]) * h[:, F:]).abs().sum(-1)
        assert bool(((one[1] - staged[1]).abs() <= 4 * F * torch.finfo(torch.float32).eps * terms).all())
