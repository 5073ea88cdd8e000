"""Combine-side helpers: exact fp32 formation for bf16 operands, no side effects, dropped pairs."""
import pytest
import torch

from shardmoe.moe import combine as comb
from shardmoe.moe import cpu
from shardmoe.moe.cpu import CpuOps
from shardmoe.moe.experts import TORCH_OPS


def _bf16(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


def _ops(on_cpu_ops: bool, *operands: torch.Tensor):
    """TORCH_OPS, or the CPU's ops, which must take `operands` on their C++ pass (else the "cpu" case
    would run torch's code again)."""
    if not on_cpu_ops:
        return TORCH_OPS
    if not cpu.library_loaded():
        pytest.skip("the C++ CPU passes are not built here (no compiler)")
    ops = CpuOps.decide(operands[0])
    assert ops.elementwise_fits(*operands)
    return ops


@pytest.mark.parametrize("on_cpu_ops", [False, True], ids=["torch", "cpu"])
def test_rowwise_dot_forms_bf16_products_exactly(on_cpu_ops):
    """Long rows (several chunks) of bf16 factors: every product of two bf16 values is exact in
    fp32, so only the fp32 summation differs from a float64 evaluation of the same inputs."""
    a, b, c = _bf16(3000, 700, seed=0), _bf16(3000, 700, seed=1), _bf16(3000, 700, seed=2)
    exact = (a.double() * b.double() * c.double()).sum(-1)
    got = _ops(on_cpu_ops, a, b, c).rowwise_dot(a, b, c)
    assert got.dtype == torch.float32
    assert ((got.double() - exact).abs().max() / exact.abs().max()).item() < 1e-6
    naive = (a * b * c).sum(-1, dtype=torch.float32)   # products rounded to bf16 first
    assert ((naive.double() - exact).abs().max() / exact.abs().max()).item() > 1e-4


@pytest.mark.parametrize("on_cpu_ops", [False, True], ids=["torch", "cpu"])
def test_scale_rows_rounds_once(on_cpu_ops):
    rows, w = _bf16(2000, 600, seed=3), torch.rand(2000, generator=torch.Generator().manual_seed(4))
    got = _ops(on_cpu_ops, rows).scale_rows(rows, w)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, (rows.double() * w.double()[:, None]).bfloat16())


@pytest.mark.parametrize("on_cpu_ops", [False, True], ids=["torch", "cpu"])
def test_helpers_leave_their_inputs_alone(on_cpu_ops):
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        rows = torch.randn(700, 400).to(dtype)
        ops = CpuOps.decide(rows) if on_cpu_ops else TORCH_OPS
        factor = torch.randn(700, 400).bfloat16()
        w = torch.rand(700)
        before = rows.clone()
        comb.combine(ops, rows, w, torch.arange(700), 350, 2)
        comb.grad_combine(ops, rows, w)
        ops.rowwise_dot(rows, factor)
        comb.grad_gate_combine(ops, rows, rows, rows)
        comb.grad_input_combine(ops, rows, torch.arange(700), 350, 2)
        assert torch.equal(rows, before), dtype


def test_combine_adds_each_kept_row_to_its_token_and_nothing_else():
    gen = torch.Generator().manual_seed(5)
    num_tokens, k = 6, 3
    row_pair = torch.tensor([0, 4, 5, 9, 10, 17, 2])       # pairs t*k + j; the other pairs were dropped
    rows = torch.randn(7, 4, generator=gen, dtype=torch.float64)
    w = torch.rand(7, generator=gen, dtype=torch.float64)
    expected = torch.zeros(num_tokens, 4, dtype=torch.float64)
    for r, pair in enumerate(row_pair.tolist()):
        expected[pair // k] += w[r] * rows[r]
    assert torch.allclose(comb.combine(TORCH_OPS, rows, w, row_pair, num_tokens, k), expected, rtol=1e-15, atol=0)
    assert torch.count_nonzero(comb.grad_input_combine(TORCH_OPS, rows, row_pair, num_tokens, k)[[4]]) == 0


def test_row_chunks_split_cpu_rows_only():
    """About 1 MiB of float32 rows per chunk on a CPU (cache-sized); one chunk elsewhere, where each
    chunk would be a kernel launch (on an H100 the glu backward's chunks were 1821 launches a step)."""
    rows = torch.empty(1000, 1024)
    chunks = comb.row_chunks(rows)
    assert [c.start for c in chunks] == list(range(0, 1000, 256)) and chunks[-1].stop >= 1000
    assert comb.row_chunks(torch.empty(1000, 1024, device="meta")) == [slice(None)]
